"""Offline generation throughput: vlm_serve's in-process Engine vs transformers' `generate`.

Both run the same checkpoint (default: the built-in tiny MoE model; `--model DIR` for another
Qwen3-VL checkpoint) in float32 on the same workload, built once with our `MultimodalProcessor`
(whose ids and pixel values are identical to transformers' processor, see test_preprocess):
`--requests` requests, each one image plus a prompt, `--images` distinct images of varied sizes
(64..256 px per side) shared round-robin, the same system prompt in every request and user texts of
different lengths; every request produces exactly `--output-tokens` tokens (greedy, EOS ignored).

* vlm_serve: `Engine.generate_processed` over the whole workload at once, after a small warm-up
  call; the best of `--repeats` runs counts. Afterwards the scheduler overhead (share of step time
  outside the model forward, from `engine.scheduler.metrics` when the engine has it) is reported for
  that run and for a dedicated batch of `--overhead-batch` text-only requests (target < 10%).
* transformers: `Qwen3VL(Moe)ForConditionalGeneration.generate`, greedy, left-padded batches of
  each of `--hf-batch-sizes` (images of a batch concatenated in order; M-RoPE positions come from
  the attention mask). A batch size is timed on the first `max(2 batches, --hf-min-requests)`
  requests (best of `--repeats`) and its tokens/s taken for the whole workload; the best batch size
  is the baseline. Every measured request's tokens are compared with the engine's, which shows
  whether batched, left-padded generation in transformers is correct (it should agree exactly).

Output tokens/s count generated tokens only. torch keeps its default thread count.

    python benchmarks/bench_offline.py [--model DIR] [--requests 64] [--output-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image
from vlm_serve.testing.tiny_model import default_model_path
from vlm_serve.vision.items import ProcessedInput

HF_CLASSES = {
    "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
}
SYSTEM_PROMPT = (
    "You are a careful visual assistant. Look at the picture the user sends, describe what you see "
    "in plain words, answer the question that follows, and say so when something is unclear."
)
QUESTIONS = [
    "What is in this picture?",
    "Describe the colours and the light in this image.",
    "Which objects can you see, and where are they placed relative to each other?",
    "Is there anything unusual here?",
    "Write a short story about this scene for a child.",
]
FILLER = [
    "The picture was taken early in the morning near the old harbour.",
    "My friend says the left side looks brighter than the right side.",
    "Please keep the answer short and avoid guessing names of places.",
    "We want to use the image for a school report about the city.",
    "There might be a small animal hidden somewhere in the corner.",
    "Mention the weather too if you can tell it from the sky.",
]


@dataclass
class Workload:
    inputs: list[ProcessedInput]
    output_tokens: int
    description: str


@dataclass
class Measurement:
    tokens: int
    seconds: list[float]  # one per repeat

    @property
    def rate(self) -> float:
        """Output tokens per second of the fastest repeat."""
        return self.tokens / min(self.seconds)


@dataclass
class HfResult:
    batch_size: int
    requests: int
    measurement: Measurement
    agreeing_tokens: int
    identical_requests: int


# -- workload --------------------------------------------------------------------------------------


def user_text(rng: np.random.Generator) -> str:
    """A question with 0..6 sentences of context in front: user texts of quite different lengths."""
    context = [FILLER[k] for k in rng.permutation(len(FILLER))[: rng.integers(0, len(FILLER) + 1)]]
    return " ".join([*context, QUESTIONS[rng.integers(len(QUESTIONS))]])


def build_workload(engine: Engine, requests: int, images: int, output_tokens: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    pictures = [make_image(*rng.integers(64, 257, size=2), seed=seed + k) for k in range(images)]
    inputs = []
    for i in range(requests):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [{"type": "image", "image": pictures[i % images]}, {"type": "text", "text": user_text(rng)}],
            },
        ]
        inputs.append(engine.processor.process_messages(messages, add_generation_prompt=True))
    merge = engine.model_config.vision.spatial_merge_size
    prompt_lens = [len(x.input_ids) for x in inputs]
    image_tokens = [item.num_tokens(merge) for x in inputs for item in x.mm_items]
    description = (
        f"{requests} requests x {output_tokens} output tokens (greedy, EOS ignored); each one image "
        f"({images} distinct, 64..256 px per side, {min(image_tokens)}..{max(image_tokens)} image tokens) + "
        f"shared system prompt + user text; prompts {min(prompt_lens)}..{max(prompt_lens)} tokens "
        f"(mean {statistics.mean(prompt_lens):.0f})"
    )
    return Workload(inputs, output_tokens, description)


def build_text_workload(engine: Engine, requests: int, seed: int) -> list[ProcessedInput]:
    rng = np.random.default_rng(seed + 1)
    return [
        engine.processor.process_messages(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_text(rng)}],
            add_generation_prompt=True,
        )
        for _ in range(requests)
    ]


# -- vlm_serve --------------------------------------------------------------------------------------


def run_engine(engine: Engine, inputs: list[ProcessedInput], max_tokens: int, repeats: int) -> tuple[Measurement, list[list[int]]]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine.generate_processed(inputs, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        seconds.append(time.perf_counter() - start)
    tokens = [list(out.token_ids) for out in outputs]
    return Measurement(sum(len(t) for t in tokens), seconds), tokens


METRIC_FIELDS = ("time_schedule", "time_forward", "time_process")


class MetricsWindow:
    """Scheduler step times (cumulative seconds on `engine.scheduler.metrics`) over a window of work.

    Starts a fresh window with the metrics' `reset()` where there is one, else diffs the counters.
    `overhead_share()` is None when the engine does not keep these metrics.
    """

    def __init__(self, engine: Engine) -> None:
        self.metrics = getattr(engine.scheduler, "metrics", None)
        if self.metrics is not None and callable(getattr(self.metrics, "reset", None)):
            self.metrics.reset()
            self.start = dict.fromkeys(METRIC_FIELDS, 0.0)
        else:
            self.start = self._read()

    def _read(self) -> dict[str, float] | None:
        values = {name: getattr(self.metrics, name, None) for name in METRIC_FIELDS}
        if any(not isinstance(v, (int, float)) for v in values.values()):
            return None
        return {name: float(v) for name, v in values.items()}

    def overhead_share(self) -> float | None:
        """(schedule + process) / (schedule + forward + process) since the window started."""
        end = self._read()
        if end is None or self.start is None:
            return None
        spent = {name: end[name] - self.start[name] for name in METRIC_FIELDS}
        total = sum(spent.values())
        return (spent["time_schedule"] + spent["time_process"]) / total if total > 0 else None


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


# -- transformers -----------------------------------------------------------------------------------


def load_hf_model(path: Path) -> torch.nn.Module:
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in HF_CLASSES:
        raise SystemExit(f"{path}: model_type {model_type!r} is not a Qwen3-VL model")
    return HF_CLASSES[model_type].from_pretrained(path, dtype=torch.float32).eval()


def hf_batch(inputs: list[ProcessedInput], pad_id: int, image_token_id: int, video_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded `generate` inputs of a batch, media of all its requests concatenated in order."""
    length = max(len(x.input_ids) for x in inputs)
    input_ids = torch.full((len(inputs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(inputs), length), dtype=torch.long)
    for row, x in enumerate(inputs):
        input_ids[row, length - len(x.input_ids) :] = torch.tensor(x.input_ids)
        attention_mask[row, length - len(x.input_ids) :] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": (input_ids == image_token_id).int() + 2 * (input_ids == video_token_id).int(),
    }
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        items = [item for x in inputs for item in x.mm_items if item.modality == modality]
        if items:
            batch[key] = torch.cat([item.pixel_values for item in items])
            batch[f"{modality}_grid_thw"] = torch.tensor([item.grid_thw for item in items])
    return batch


def hf_generate(model: torch.nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int, pad_id: int) -> torch.Tensor:
    """Greedy tokens (batch, max_new_tokens). `eos_token_id=None`: EOS is neither a stop nor
    suppressed, as with the engine's ignore_eos, so every row runs to `max_new_tokens`."""
    out = model.generate(
        **batch,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    return out[:, batch["input_ids"].shape[1] :]


def run_hf(
    model: torch.nn.Module,
    inputs: list[ProcessedInput],
    batch_size: int,
    min_requests: int,
    max_new_tokens: int,
    repeats: int,
    reference: list[list[int]],
    token_ids: tuple[int, int, int],
) -> HfResult:
    count = min(len(inputs), max(2 * batch_size, min_requests))
    batches = [hf_batch(inputs[s : min(s + batch_size, count)], *token_ids) for s in range(0, count, batch_size)]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = [hf_generate(model, batch, max_new_tokens, token_ids[0]) for batch in batches]
        seconds.append(time.perf_counter() - start)
    rows = [row.tolist() for out in outputs for row in out]
    agreeing = sum(a == b for row, ref in zip(rows, reference) for a, b in zip(row, ref))
    identical = sum(row == ref for row, ref in zip(rows, reference))
    return HfResult(batch_size, count, Measurement(sum(len(r) for r in rows), seconds), agreeing, identical)


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: built-in tiny MoE)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=16, help="distinct images, shared round-robin")
    parser.add_argument("--hf-batch-sizes", default="1,8,16,32,64", help="comma-separated")
    parser.add_argument("--hf-min-requests", type=int, default=16, help="requests timed per batch size (at least 2 batches)")
    parser.add_argument("--overhead-batch", type=int, default=32, help="text-only requests of the overhead measurement")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 requests x 16 tokens, 8 images, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.output_tokens, args.images, args.repeats = 16, 16, 8, 1
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    path = args.model or default_model_path()
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    print(f"model {path}, float32, torch threads {torch.get_num_threads()}, fastest of {args.repeats} run(s)")

    engine = Engine(model=path, dtype="float32")
    workload = build_workload(engine, args.requests, args.images, args.output_tokens, args.seed)
    print(f"workload: {workload.description}")
    hf_inputs = copy.deepcopy(workload.inputs)  # transformers' own copy: the engine may annotate the items
    token_ids = (
        engine.tokenizer.token_to_id("<|endoftext|>"),
        engine.model_config.image_token_id,
        engine.model_config.video_token_id,
    )

    # vlm_serve: the whole workload at once
    engine.generate_processed(workload.inputs[:2], max_tokens=4, temperature=0, ignore_eos=True)  # warm-up
    window = MetricsWindow(engine)
    ours, reference = run_engine(engine, workload.inputs, args.output_tokens, args.repeats)
    run_share = window.overhead_share()
    runs = ", ".join(f"{ours.tokens / s:.0f}" for s in ours.seconds)
    print(f"vlm_serve    : {ours.rate:8.1f} tok/s ({ours.tokens} tokens; runs: {runs} tok/s) | "
          f"scheduler overhead {percent(run_share)}")

    # vlm_serve: scheduler overhead at a fixed text-only batch
    text_inputs = build_text_workload(engine, args.overhead_batch, args.seed)
    window = MetricsWindow(engine)
    text_run, _ = run_engine(engine, text_inputs, args.output_tokens, 1)
    batch_share = window.overhead_share()
    print(f"vlm_serve    : {text_run.rate:8.1f} tok/s at {args.overhead_batch} text-only requests x "
          f"{args.output_tokens} tokens | scheduler overhead {percent(batch_share)} (target < 10%)")
    engine.shutdown()
    del engine
    gc.collect()

    # transformers: each batch size on a subset, extrapolated
    model = load_hf_model(path)
    hf_generate(model, hf_batch(hf_inputs[:1], *token_ids), 4, token_ids[0])  # warm-up
    results: list[HfResult] = []
    for batch_size in batch_sizes:
        if batch_size > len(hf_inputs):
            print(f"transformers : batch {batch_size:3d} skipped (only {len(hf_inputs)} requests)")
            continue
        result = run_hf(model, hf_inputs, batch_size, args.hf_min_requests, args.output_tokens, args.repeats,
                        reference, token_ids)
        results.append(result)
        full = len(hf_inputs) * args.output_tokens / result.measurement.rate
        print(
            f"transformers : {result.measurement.rate:8.1f} tok/s at batch {batch_size:3d} "
            f"(timed on {result.requests} requests, whole workload ~{full:.1f} s) | tokens equal to vlm_serve's "
            f"{result.agreeing_tokens}/{result.measurement.tokens}, requests identical "
            f"{result.identical_requests}/{result.requests}"
        )
    if not results:
        raise SystemExit("no transformers batch size was measured")
    correct = [r for r in results if r.identical_requests == r.requests]
    if len(correct) < len(results):
        print("note: some transformers settings did not reproduce the engine's tokens (see above)")
    best = max(correct or results, key=lambda r: r.measurement.rate)
    ratio = ours.rate / best.measurement.rate

    print()
    print(f"{'workload':<28}{workload.description}")
    print(f"{'torch threads':<28}{torch.get_num_threads()}")
    print(f"{'vlm_serve engine':<28}{ours.rate:.1f} tok/s")
    print(f"{'transformers, best batch':<28}{best.measurement.rate:.1f} tok/s (batch {best.batch_size})")
    print(f"{'ratio':<28}{ratio:.2f}x (target >= 3x)")
    print(f"{'overhead share at batch ' + str(args.overhead_batch):<28}{percent(batch_share)} (target < 10%)")
    print(f"{'total run time':<28}{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
