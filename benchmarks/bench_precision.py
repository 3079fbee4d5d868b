"""Decode and prefill speed and memory of the same model stored in float32, bfloat16, FP8 (Qwen's block-wise
e4m3 layout) and 8- and 4-bit integers (llm-compressor's W8A16, W8A8 and W4A16), on CPU, side by side in one
run.

For each `--arch` (default: medium dense and medium MoE, scaled-down Qwen3-VL-235B-A22B shapes), the float32
and bfloat16 checkpoints of one seed are written with `create_tiny_model`, the FP8 one quantized from the
bfloat16 one as Qwen's FP8 releases are, and the integer ones from the bfloat16 one by llm-compressor's
round-to-nearest `oneshot` (vlm_serve/testing/quantized.py: its own environment, as the tests'): W4A16 in
groups of `--group` columns (the published checkpoints' 128; the medium MoE's 96-wide experts take 32), W8A16
and W8A8 per channel. Each is served by an in-process `Engine` under `--dtype auto`: weights as stored,
activations float32.

- Decode: at each `--batch-sizes` size, that many text requests decode `--output-tokens` greedy tokens (EOS
  ignored) at once; the figures are the decode step time (the time after the first token, per step) and
  output tokens/s, and at batch 1 the GB/s of weights a step reads (the decoder layers' and lm_head's
  weights as the kernels hold them, scales included; of a MoE, the chosen experts' share) against the
  machine's memory-read roof (measured here, as bench_kernels.py does).
- Prefill: one prompt of `--prompt-tokens` tokens, tokens/s to its first token.
- Memory: the language model's weights as it holds them after loading (kernel panels, scales, plain
  tensors) against those tensors' bytes in the checkpoint (the vision tower, served apart, left out of both).
Each figure is the median of `--repeats` rounds, the formats' engines taking turns in each round. Goals
(issue 69): W4A16 decode at batch 1 at 85% of the roof and 3x bfloat16's tokens/s, W8A8 prefill 1.5x
bfloat16's where the CPU has VNNI, resident weights at most 1.15x the packed checkpoint's.

    python benchmarks/bench_precision.py [--arch dense moe] [--size medium] [--batch-sizes 1,16] [--formats ...]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from bench_kernels import roofs
from cpu_isa import describe_cpu
from safetensors import safe_open

from vlm_serve.engine import Engine
from vlm_serve.llm.kernels import linear_cpu
from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.testing.quantized import Recipe, quantize_checkpoints
from vlm_serve.testing.tiny_model import create_tiny_model

FORMATS = ["float32", "bfloat16", "fp8", "w8a16", "w8a8", "w4a16"]
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def held_tensors(value) -> list[torch.Tensor]:
    """The tensors a kernel's packed weights hold (panels, layouts' scales), found through their fields."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "__dataclass_fields__"):
        return [
            t for name in value.__dataclass_fields__ if name != "kernel" for t in held_tensors(getattr(value, name))
        ]
    return []


def nbytes(tensors: list[torch.Tensor]) -> int:
    sizes = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            key = tensor.data_ptr() if tensor.layout == torch.strided else id(tensor)
            sizes[key] = tensor.numel() * tensor.element_size()
    return sum(sizes.values())


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's own weights as it holds them: parameters, kernel panels, FP8 scales, integer codes."""
    tensors = list(module.parameters(recurse=False))
    for name in ("weight_scale_inv", "w13_scale", "w2_scale", "panels", "packed", "int_weight", "w13_int", "w2_int"):
        tensors += held_tensors(getattr(module, name, None))
    return tensors


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the language model holds for its weights."""
    return nbytes([t for module in model.modules() for t in module_tensors(module)])


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step of one request reads: every linear layer's (routers included) and
    lm_head's as the kernels hold them, and of each MoE layer the share of its experts a token chooses."""
    total = 0
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            total += nbytes(module_tensors(module)) * module.top_k // module.num_experts
        elif isinstance(module, LinearBase):
            total += nbytes(module_tensors(module))
    head = model.lm_head
    return total + nbytes(held_tensors(head.panels) if head.panels is not None else [head.weight])


def language_file_bytes(model_dir: Path) -> int:
    """Bytes of a checkpoint's language-model tensors in its weight files (the vision tower's left out)."""
    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.startswith("model.visual."):
                    piece = f.get_slice(name)
                    total += math.prod(piece.get_shape()) * DTYPE_BYTES[piece.get_dtype()]
    return total


DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "I16": 2}


def decode(engine: Engine, batch: int, tokens: int) -> tuple[float, float]:
    """(seconds per decode step, output tokens/s) of `batch` requests decoding `tokens` tokens each."""
    conversation = [{"role": "user", "content": PROMPT}]
    submissions = [
        engine.submit(
            engine.processor.process_messages(conversation, add_generation_prompt=True),
            max_tokens=tokens,
            temperature=0,
            ignore_eos=True,
        )
        for _ in range(batch)
    ]
    start = time.perf_counter()
    engine.step()
    while not any(s.choices[0].outs for s in submissions):  # prefill, up to every first token
        engine.step()
    first = time.perf_counter()
    while not all(s.done for s in submissions):
        engine.step()
    end = time.perf_counter()
    return (end - first) / max(tokens - 1, 1), batch * tokens / (end - start)


def prefill(engine: Engine, tokens: int, round_: int) -> float:
    """Prompt tokens/s of one prompt of about `tokens` tokens to its first token (a new prompt each round:
    no prefix-cache hit)."""
    words = f"Round {round_}: " + " ".join(f"the sea {i} and the light" for i in range(tokens // 6))
    start = time.perf_counter()
    out = engine.generate(words, max_tokens=1, temperature=0)
    return out.prompt_tokens / (time.perf_counter() - start)


def checkpoints(folder: Path, arch: str, size: str, group: int, formats: list[str]) -> dict[str, Path]:
    """Each format's checkpoint of one seed, written into `folder`."""
    made = {}
    for name in ("float32", "bfloat16", "fp8"):
        if name in formats or (name == "bfloat16" and any(f.startswith("w") for f in formats)):
            options = {"quantize": "fp8"} if name == "fp8" else {"dtype": name}
            made[name] = create_tiny_model(folder / f"{arch}-{name}", arch=arch, size=size, **options)
    recipes = {
        "w8a16": Recipe(8, None, True),
        "w8a8": Recipe(8, None, True, int8_activations=True),
        "w4a16": Recipe(4, group if arch == "dense" else 32, True),
    }
    jobs = [(made["bfloat16"], folder / f"{arch}-{name}", recipes[name]) for name in formats if name in recipes]
    for (_, out, _), name in zip(jobs, [n for n in formats if n in recipes]):
        made[name] = out
    if jobs:
        quantize_checkpoints(jobs)
    return {name: made[name] for name in formats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--group", type=int, default=128, help="W4A16's group size (the dense model's)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, isa = describe_cpu()
    threads = torch.get_num_threads()
    kernel = linear_cpu.LIBRARY.get()
    _, roof = roofs(torch, "native", threads)
    print(
        f"CPU: {model} ({isa}), {threads} threads; kernels: {kernel.isa}, W8A8 products: {kernel.kernel_int8_dot().decode()}, "
    )
    print(f"bfloat16 dot products: {'yes' if kernel.bf16_dot else 'no'}; memory read roof {roof:.1f} GB/s")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            paths = checkpoints(Path(tmp), arch, args.size, args.group, args.formats)
            with ExitStack() as stack:
                engines, held, step_bytes = {}, {}, {}
                for name, path in paths.items():
                    engine = stack.enter_context(Engine(path, max_running_requests=max(batches), vit_dp=0))
                    runner_model = engine.scheduler.runner.model
                    engines[name] = engine
                    held[name], step_bytes[name] = resident_weight_bytes(runner_model), step_weight_bytes(runner_model)
                    decode(engine, 1, 4)  # warm-up
                    prefill(engine, 64, -1)
                runs = {(name, b): [] for name in paths for b in batches}
                prefills = {name: [] for name in paths}
                for r in range(args.repeats):  # (the formats take turns, so that they share the machine's load alike)
                    for name, engine in engines.items():
                        for b in batches:
                            runs[name, b].append(decode(engine, b, args.output_tokens))
                        prefills[name].append(prefill(engine, args.prompt_tokens, r))
            print(f"\n{arch} ({args.size}), decode {args.output_tokens} tokens a request, prefill "
                  f"{args.prompt_tokens} tokens, median of {args.repeats}")  # fmt: skip
            header = "".join(f" | batch {b}: step ms, tok/s, x bf16" for b in batches)
            print(f"{'weights':>9}{header} | GB/s at 1, % roof | prefill tok/s, x bf16 | held MB, file MB, ratio")
            base = "bfloat16" if "bfloat16" in paths else next(iter(paths))
            for name, path in paths.items():
                cells = ""
                for b in batches:
                    step, rate = median(runs[name, b])
                    cells += f" | {step * 1e3:8.1f} {rate:8.1f} {median(runs[base, b])[0] / step:5.2f}x"
                step1 = median(runs[name, batches[0]])[0]
                rate = sorted(prefills[name])[len(prefills[name]) // 2]
                base_rate = sorted(prefills[base])[len(prefills[base]) // 2]
                gbs = step_bytes[name] / step1 / 1e9
                file_mb = language_file_bytes(path) / 2**20
                cells += f" | {gbs:6.1f} {100 * gbs / roof:5.0f}% | {rate:9.0f} {rate / base_rate:5.2f}x"
                cells += f" | {held[name] / 2**20:7.0f} {file_mb:7.0f} {held[name] / 2**20 / file_mb:5.2f}"
                print(f"{name:>9}{cells}")


def median(figures: list[tuple[float, float]]) -> tuple[float, float]:
    """The run of median step time."""
    return sorted(figures)[len(figures) // 2]


if __name__ == "__main__":
    main()
