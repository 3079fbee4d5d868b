"""What serving LoRA adapters costs: one batch of text requests spread over 1, 4 and 16 adapters (rank 16), side
by side with the base model alone and with one adapter merged into the weights (what a server without
LoRA would run, one fine-tune at a time); and the time to load an adapter at run time.

The checkpoint is `--model DIR`, else the small dense random checkpoint (`create-tiny-model --size small`,
made in a temporary folder). The adapters are made by peft with random weights on q/k/v/o and gate/up/down
of every decoder layer. Every run is the in-process Engine with its defaults: `--requests` prompts submitted
at once, `--output-tokens` each (greedy, EOS ignored), a new engine for each (an empty prefix cache);
request i goes through adapter i mod N. The merged model is peft's `merge_and_unload` of adapter 0, saved as
a checkpoint. Each setting counts with its fastest of `--repeats` rounds.

    python benchmarks/bench_lora.py [--model DIR] [--requests 32] [--output-tokens 64] [--rank 16]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cpu_isa import describe_cpu  # noqa: E402

from vlm_serve.engine import Engine  # noqa: E402
from vlm_serve.llm.lora.adapter import read_adapter  # noqa: E402
from vlm_serve.testing.lora_adapter import hf_model, make_adapter  # noqa: E402
from vlm_serve.testing.tiny_model import create_tiny_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPREADS = (1, 4, 16)
WORDS = "the sea wind sails boat harbour light keeper morning birds rope deck storm calm shore wave".split()


def make_adapters(model_dir: Path, folder: Path, count: int, rank: int) -> list[Path]:
    return [make_adapter(folder / f"adapter-{i}", model_dir, seed=i, rank=rank, targets=TARGETS) for i in range(count)]


def merged_checkpoint(model_dir: Path, adapter: Path, folder: Path) -> Path:
    """The base with `adapter` merged into its weights, in the base's layout (its other files copied)."""
    import peft

    merged = peft.PeftModel.from_pretrained(hf_model(model_dir), adapter).merge_and_unload()
    target = folder / "merged"
    merged.save_pretrained(target)
    for file in model_dir.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy(file, target / file.name)
    return target


def prompts(engine: Engine, count: int) -> list:
    return [
        engine.processor.process_messages(
            [{"role": "user", "content": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(24))}],
            add_generation_prompt=True,
        )
        for i in range(count)
    ]


def run(model_dir: Path, args: argparse.Namespace, adapters: list[Path] | None = None) -> float:
    """Output tokens/s of the workload (through `adapters`, spread round robin; None: the base)."""
    options = {}
    if adapters:
        options = {
            "enable_lora": True,
            "lora_paths": [f"a{i}={p}" for i, p in enumerate(adapters)],
            "max_loras": len(adapters),
            "max_lora_rank": args.rank,
        }
    with Engine(model_dir, dtype="float32", **options) as engine:
        inputs = prompts(engine, args.requests)
        engine.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)  # (warm-up)
        start = time.perf_counter()
        jobs = [
            engine.submit(
                x,
                lora=f"a{i % len(adapters)}" if adapters else None,
                max_tokens=args.output_tokens,
                temperature=0,
                ignore_eos=True,
            )
            for i, x in enumerate(inputs)
        ]
        while not all(job.done for job in jobs):
            engine.step()
        seconds = time.perf_counter() - start
        generated = sum(len(engine.result(job).token_ids) for job in jobs)
    return generated / seconds


def load_seconds(model_dir: Path, adapter: Path, rank: int, times: int = 5) -> float:
    """The median time to read an adapter and put it in a slot, with the engine running."""
    with Engine(model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=rank) as engine:
        manager, seconds = engine.scheduler.runner.lora, []
        for _ in range(times):
            start = time.perf_counter()
            slot = manager.load(read_adapter("x", adapter, rank))
            seconds.append(time.perf_counter() - start)
            manager.unload(slot)
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cpu, isa = describe_cpu()
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    model_dir = args.model or create_tiny_model(work / "small-dense", arch="dense", size="small", seed=0)
    adapters = make_adapters(model_dir, work, max(SPREADS), args.rank)
    merged = merged_checkpoint(model_dir, adapters[0], work)
    settings = {"base": (model_dir, None), "merged": (merged, None)}
    settings |= {f"{n} adapter{'s' if n > 1 else ''}": (model_dir, adapters[:n]) for n in SPREADS}
    rates = {name: 0.0 for name in settings}
    for _ in range(args.repeats):
        for name, (path, spread) in settings.items():
            rates[name] = max(rates[name], run(path, args, spread))
            print(f"{name}: {rates[name]:.1f} tokens/s", file=sys.stderr)
    loading = load_seconds(model_dir, adapters[0], args.rank)

    print(f"\nCPU: {cpu} ({isa}); {model_dir}")
    print(
        f"{args.requests} requests at once, {args.output_tokens} output tokens each (greedy), adapters of rank "
        f"{args.rank} on q/k/v/o and gate/up/down; best of {args.repeats} rounds\n"
    )
    print(f"{'':<14}{'tokens/s':>10}{'vs base':>10}{'vs merged':>11}")
    for name, rate in rates.items():
        print(f"{name:<14}{rate:>10.1f}{rate / rates['base']:>10.2f}{rate / rates['merged']:>11.2f}")
    print(f"\nloading an adapter at run time (read + into its slots): {1000 * loading:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
