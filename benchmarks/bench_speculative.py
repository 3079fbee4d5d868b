"""Decode speed with and without speculative decoding, side by side in one run, on CPU.

n-gram drafts (`--speculative-algorithm ngram`) on a copy-heavy workload: a prompt holding a passage
and a JSON object with repeated keys, asked to be repeated. The same checkpoint is served by two
in-process engines, one speculating, taking turns round by round; at each `--batch-sizes` size that
many requests decode `--output-tokens` greedy tokens (EOS ignored) at once. Figures: output tokens/s,
TPOT (time after the first token per output token, per request), and of the speculating engine the
mean accepted length (tokens emitted per verify step of a request that had drafts) and the share of
drafts kept. Greedy answers are checked to be the same both ways.

The model is random (`create_tiny_model`, medium dense by default): it does not follow the instruction,
so how much it copies, and so the acceptance, is what its own repetitions give; the built-in model and a
trained EAGLE-3 draft are the figures to come.

    python benchmarks/bench_speculative.py [--arch dense] [--size medium] [--batch-sizes 1,16]
"""

from __future__ import annotations

import dataclasses
import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from cpu_isa import describe_cpu

from vlm_serve.engine import Engine
from vlm_serve.testing.tiny_model import create_tiny_model

PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote in the log: "
    '{"date": "12 May", "wind": "north-east", "sea": "rough", "ships": 3}, '
    '{"date": "13 May", "wind": "north", "sea": "calm", "ships": 5}, '
    '{"date": "14 May", "wind": "north", "sea": "calm", "ships": 4}. '
)
PROMPT = PASSAGE * 3 + "Repeat the log above exactly."


def run(engine: Engine, batch: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    """(output tokens/s, mean TPOT in s, answers) of `batch` requests decoding `tokens` tokens at once."""
    conversation = [{"role": "user", "content": PROMPT}]
    x = engine.processor.process_messages(conversation, add_generation_prompt=True)
    submissions = [engine.submit(x, max_tokens=tokens, temperature=0, ignore_eos=True) for _ in range(batch)]
    start = time.perf_counter()
    first: dict[int, float] = {}
    while not all(s.done for s in submissions):
        engine.step()
        for i, s in enumerate(submissions):
            if i not in first and s.choices[0].outs:
                first[i] = time.perf_counter()
    end = time.perf_counter()
    tpot = statistics.mean((end - first[i]) / max(tokens - 1, 1) for i in range(batch))
    return batch * tokens / (end - start), tpot, [s.choices[0].completion().token_ids for s in submissions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="dense", choices=["dense", "moe"])
    parser.add_argument("--size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, isa = describe_cpu()
    print(f"CPU: {model} ({isa}), {torch.get_num_threads()} torch threads")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        path = create_tiny_model(Path(tmp) / "model", arch=args.arch, size=args.size, dtype="bfloat16")
        common = {"max_running_requests": max(batches), "vit_dp": 0, "disable_overlap_schedule": True}
        engines = {
            "off": stack.enter_context(Engine(path, **common)),
            "ngram": stack.enter_context(Engine(path, speculative_algorithm="ngram",
                                                speculative_num_draft_tokens=args.draft_tokens, **common)),
        }  # fmt: skip
        for engine in engines.values():
            run(engine, 1, 4)  # warm-up
        print(f"\n{args.arch} ({args.size}, bfloat16 weights), {args.output_tokens} greedy tokens per request, "
              f"median of {args.repeats}; overlap off for both (speculation runs the normal loop)")  # fmt: skip
        print(f"{'batch':>5} | {'spec':>5} | {'tok/s':>7} | {'TPOT ms':>8} | {'x off':>5} | drafts proposed | "
              "accepted length | drafts kept")  # fmt: skip
        for batch in batches:
            figures = {name: [] for name in engines}
            answers = {}
            metrics = engines["ngram"].scheduler.metrics
            before = dataclasses.replace(metrics.spec)
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    rate, tpot, answers[name] = run(engine, batch, args.output_tokens)
                    figures[name].append((rate, tpot))
            if answers["off"] != answers["ngram"]:
                raise SystemExit("the speculating engine's greedy answers differ")
            proposed = metrics.spec.draft_tokens - before.draft_tokens
            accepted = metrics.spec.accepted_tokens - before.accepted_tokens
            verifies = metrics.spec.verify_steps - before.verify_steps
            base = statistics.median(r for r, _ in figures["off"])
            for name in engines:
                rate = statistics.median(r for r, _ in figures[name])
                tpot = statistics.median(t for _, t in figures[name])
                extra = (f" | {proposed:15d} | {1 + accepted / max(verifies, 1):15.2f} | {accepted / max(proposed, 1):10.0%}"
                         if name == "ngram" else "")  # fmt: skip
                print(f"{batch:>5} | {name:>5} | {rate:7.1f} | {tpot * 1e3:8.1f} | {rate / base:5.2f}{extra}")


if __name__ == "__main__":
    main()
