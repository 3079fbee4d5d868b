"""Where a decode step's time goes on CPU: in the C kernels, in the model's Python around them, and in the
rest of the engine's step (batch building, sampling, output processing, detokenization), with each decoder
layer as two decoder_cpu.c calls (`fused`) and as its modules' nine kernel calls (`modules`, the layers'
calls switched off), side by side in one run.

An in-process `Engine` serves `--model` (default: the small MoE, made here); at each `--batch-sizes` size
that many text requests decode `--output-tokens` greedy tokens at once, the two ways taking turns for
`--repeats` rounds; figures are medians per step. "C" is the time inside the kernel libraries' calls
(argument conversion included), "model Python" the rest of the model's forward, "engine" the rest of the
step. The issue's target: Python and engine time under 15% of a step at batch 1 on the small MoE.

    python benchmarks/bench_decode_step.py [--model CKPT] [--batch-sizes 1,16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from cpu_isa import describe_cpu

import vlm_serve.llm.kernels as kernels
from vlm_serve.engine import Engine
from vlm_serve.testing.tiny_model import create_tiny_model

PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."
clock = {"c": 0.0, "forward": 0.0}


def timed_calls(with_pointers):
    """kernels._with_pointers, adding each call's time to clock["c"] (patched before any library loads,
    so that calls bound to layers are timed too)."""

    def wrap(c_function):
        call = with_pointers(c_function)

        def timed(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                clock["c"] += time.perf_counter() - start

        return timed

    return wrap


def decode(engine: Engine, batch: int, tokens: int) -> dict[str, float]:
    """ms per decode step: whole, in C, in the model's Python, in the rest of the engine."""
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
    while not any(s.choices[0].outs for s in submissions):  # prefill, up to every first token
        engine.step()
    clock.update(c=0.0, forward=0.0)
    steps, start = 0, time.perf_counter()
    while not all(s.done for s in submissions):
        engine.step()
        steps += 1
    step = (time.perf_counter() - start) / steps * 1e3
    c, forward = clock["c"] / steps * 1e3, clock["forward"] / steps * 1e3
    return {"step": step, "c": c, "model python": forward - min(c, forward), "engine": step - forward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the small MoE, made here)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels._with_pointers = timed_calls(kernels._with_pointers)
    model, isa = describe_cpu()
    print(f"CPU: {model} ({isa}), {torch.get_num_threads()} torch threads")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or create_tiny_model(Path(tmp) / "small-moe", arch="moe", size="small")
        batches = [int(b) for b in args.batch_sizes.split(",")]
        with Engine(path, max_running_requests=max(batches), vit_dp=0, disable_overlap_schedule=True) as engine:
            runner = engine.scheduler.runner
            forward = runner.forward_with_aux

            def timed_forward(*a, **k):
                start = time.perf_counter()
                try:
                    return forward(*a, **k)
                finally:
                    clock["forward"] += time.perf_counter() - start

            runner.forward_with_aux = timed_forward
            layers = runner.model.model.language_model.layers
            calls = [layer.fused for layer in layers]
            if any(c is None for c in calls):
                print("(some layers have no decoder_cpu.c calls here: both columns run the modules)")
            ways = {"fused": calls, "modules": [None] * len(layers)}
            decode(engine, 1, 4)  # warm-up
            runs = {(way, b): [] for way in ways for b in batches}
            for _ in range(args.repeats):
                for b in batches:
                    for way, fused in ways.items():
                        for layer, f in zip(layers, fused):
                            layer.fused = f
                        runs[way, b].append(decode(engine, b, args.output_tokens))
    print(
        f"\n{path.name if args.model else 'small MoE'}, {args.output_tokens} tokens per request, "
        f"median of {args.repeats}, ms per decode step"
    )
    print(f"{'batch':>5} {'layers':>8} | {'step':>6} {'C':>6} {'model py':>8} {'engine':>6} | {'not C':>6} | tokens/s")
    for b in batches:
        for way in ways:
            figures = {k: statistics.median(r[k] for r in runs[way, b]) for k in runs[way, b][0]}
            other = (figures["step"] - figures["c"]) / figures["step"]
            print(
                f"{b:>5} {way:>8} | {figures['step']:6.2f} {figures['c']:6.2f} {figures['model python']:8.2f} "
                f"{figures['engine']:6.2f} | {other:6.1%} | {b / figures['step'] * 1e3:8.1f}"
            )
        fused, modules = (statistics.median(r["step"] for r in runs[w, b]) for w in ways)
        print(f"{b:>5} fused / modules: {modules / fused:.2f}x tokens/s")


if __name__ == "__main__":
    main()
