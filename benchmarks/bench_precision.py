"""Decode speed and memory of the same model stored in float32, bfloat16 and FP8 (Qwen's block-wise
e4m3 layout), on CPU, side by side in one run.

For each `--arch` (default: medium dense and medium MoE, scaled-down Qwen3-VL-235B-A22B shapes), the
float32, bfloat16 and FP8 checkpoints of one seed are written with `create_tiny_model` (the FP8 one
quantized from the bfloat16 one, as the published FP8 checkpoints are) and each is served by an
in-process `Engine` under `--dtype auto`: weights as stored, activations float32. At each `--batch-sizes`
size, that many text requests decode `--output-tokens` greedy tokens (EOS ignored) at once; the figure is
the decode step time (the time after the first token, per step) and output tokens/s, the median of
`--repeats` rounds, the formats' engines taking turns in each round. The resident weight bytes are those the model holds after loading (kernel panels,
scales and plain tensors). Goals (issue 30), at batch 1 where reading weights bounds decode: bfloat16
≥ 1.7x float32, FP8 ≥ 2.5x float32.

    python benchmarks/bench_precision.py [--arch dense moe] [--size medium] [--batch-sizes 1,16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from cpu_isa import describe_cpu

from vlm_serve.engine import Engine
from vlm_serve.testing.tiny_model import create_tiny_model

FORMATS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}, "fp8": {"quantize": "fp8"}}
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds for its weights: parameters, kernel panels and FP8 scales."""
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [getattr(module, name, None) for name in ("weight_scale_inv", "w13_scale", "w2_scale")]
        for held in (getattr(module, "panels", None), getattr(module, "packed", None)):
            tensors += (
                [held] if isinstance(held, torch.Tensor) else list(vars(held).values()) if held is not None else []
            )
    sizes = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            key = tensor.data_ptr() if tensor.layout == torch.strided else id(tensor)
            sizes[key] = tensor.numel() * tensor.element_size()
    return sum(sizes.values())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    parser.add_argument("--size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, isa = describe_cpu()
    print(f"CPU: {model} ({isa}), {torch.get_num_threads()} torch threads")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            with ExitStack() as stack:
                engines, weight_bytes = {}, {}
                for name, options in FORMATS.items():
                    path = create_tiny_model(Path(tmp) / f"{arch}-{name}", arch=arch, size=args.size, **options)
                    engine = stack.enter_context(Engine(path, max_running_requests=max(batches), vit_dp=0))
                    engines[name], weight_bytes[name] = engine, resident_weight_bytes(engine.scheduler.runner.model)
                    decode(engine, 1, 4)  # warm-up
                # the formats take turns round by round, so that they share the machine's other load alike
                runs = {(name, b): [] for name in FORMATS for b in batches}
                for _ in range(args.repeats):
                    for b in batches:
                        for name, engine in engines.items():
                            runs[name, b].append(decode(engine, b, args.output_tokens))
            print(f"\n{arch} ({args.size}), {args.output_tokens} tokens per request, median of {args.repeats}")
            header = "".join(f" | batch {b}: step ms, tok/s, x fp32" for b in batches)
            print(f"{'weights':>9} | resident MB{header}")
            for name in FORMATS:
                cells = ""
                for b in batches:
                    step, rate = median(runs[name, b])
                    cells += f" | {step * 1e3:8.1f} {rate:8.1f} {median(runs['float32', b])[0] / step:5.2f}x"
                print(f"{name:>9} | {weight_bytes[name] / 2**20:11.1f}{cells}")


def median(figures: list[tuple[float, float]]) -> tuple[float, float]:
    """The run of median step time."""
    return sorted(figures)[len(figures) // 2]


if __name__ == "__main__":
    main()
