"""Offline generation throughput: vlm_serve's in-process Engine vs transformers' `generate`.

Both run the same checkpoint (default: the built-in tiny MoE model; `--model DIR` for another
Qwen3-VL checkpoint) in float32 on the same workload, built once with our `MultimodalProcessor`
(whose ids and pixel values are identical to transformers' processor, see test_preprocess):
`--requests` requests, each one image plus a prompt, `--images` distinct images of varied sizes
(64..256 px per side) shared round-robin, the same system prompt in every request and user texts of
different lengths; every request produces exactly `--output-tokens` tokens (greedy, EOS ignored).

* vlm_serve: `Engine.generate_processed` over the whole workload at once (after a small warm-up
  call), with the default event loop (overlap scheduling).
* Overlap: batches of `--loop-batch-sizes` text-only requests under `event_loop_normal` and
  `event_loop_overlap`, in alternating rounds: tokens/s, and the share of wall time the model is idle
  waiting for the scheduler (wall time minus the model's busy time, `metrics.time_forward`: the
  forward thread's work under overlap). Goal: under 2% with overlap.
* transformers: `Qwen3VL(Moe)ForConditionalGeneration.generate`, greedy, left-padded batches of
  each of `--hf-batch-sizes` (images of a batch concatenated in order; transformers derives the
  M-RoPE positions from the attention mask). A batch size is timed on the first
  `max(2 batches, --hf-min-requests)` requests and its tokens/s is taken for the whole workload; the
  best batch size is the baseline. Every measured request's tokens are compared with the engine's
  (which match transformers' unbatched ones, see test_model_parity): broken left-padded batching
  (wrong positions or masks) would show as a low agreement, and a setting with less than
  `MIN_AGREEMENT` of its tokens equal to the engine's does not count as transformers' best.

Timing is noisy on small shared machines, so the two implementations alternate in `--repeats`
rounds (one engine run, then one run of each transformers batch size) and every setting counts with
its fastest round. Output tokens/s count generated tokens only; torch keeps its default thread
count unless `--threads` is given.

    python benchmarks/bench_offline.py [--model DIR] [--requests 64] [--output-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers

from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image
from vlm_serve.testing.tiny_model import default_model_path
from vlm_serve.multimodal import ProcessedInput

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


MIN_AGREEMENT = 0.9  # share of a transformers setting's tokens equal to the engine's for it to count


@dataclass
class Workload:
    inputs: list[ProcessedInput]
    description: str


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
    return Workload(inputs, description)


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


def warmup_input(engine: Engine) -> ProcessedInput:
    """A small image request that shares no prefix with the workload (no system prompt)."""
    content = [{"type": "image", "image": make_image(96, 64, seed=12345)}, {"type": "text", "text": "Hello."}]
    return engine.processor.process_messages([{"role": "user", "content": content}], add_generation_prompt=True)


def cold_engine(path: Path, engine: Engine | None) -> Engine:
    """A warmed-up engine with an empty prefix cache, so that a round does not reuse the last one's
    prompts: `engine.flush_cache()` where the engine has one, else a new engine."""
    flush = getattr(engine, "flush_cache", None)
    if not callable(flush) or flush() is False:
        if engine is not None:
            engine.shutdown()
        engine = Engine(model=path, dtype="float32")
    engine.generate_processed([warmup_input(engine)] * 2, max_tokens=4, temperature=0, ignore_eos=True)
    return engine


@dataclass
class EngineRun:
    seconds: float
    tokens: list[list[int]]
    cached_share: float | None  # prompt tokens served from the prefix cache
    busy_seconds: float  # the model's forwards (and sampling) during the run

    @property
    def rate(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds

    @property
    def idle_share(self) -> float:
        """Share of the run's wall time the model spent waiting for the scheduler."""
        return max(1.0 - self.busy_seconds / self.seconds, 0.0)


def engine_run(engine: Engine, inputs: list[ProcessedInput], max_tokens: int) -> EngineRun:
    """One timed `generate_processed` call over all `inputs`, with the model's busy time over it."""
    busy = engine.scheduler.metrics.time_forward
    start = time.perf_counter()
    outputs = engine.generate_processed(inputs, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seconds = time.perf_counter() - start
    busy = engine.scheduler.metrics.time_forward - busy
    cached_share = sum(out.cached_tokens for out in outputs) / sum(out.prompt_tokens for out in outputs)
    return EngineRun(seconds, [list(out.token_ids) for out in outputs], cached_share, busy)


@dataclass
class LoopRuns:
    """The fastest round of each event loop at one batch size of text-only requests."""

    batch_size: int
    normal: EngineRun
    overlap: EngineRun


def compare_loops(path: Path, batch_sizes: list[int], output_tokens: int, repeats: int, seed: int) -> list[LoopRuns]:
    """`event_loop_normal` vs `event_loop_overlap` on batches of text-only requests, alternating in
    `repeats` rounds; a fresh engine each run (an engine under overlap moves the intra-op threads of
    this thread to its forward thread, and gives them back at shutdown)."""
    results = []
    for batch_size in batch_sizes:
        best: dict[bool, EngineRun] = {}
        for _ in range(repeats):
            for overlap in (False, True):
                with Engine(path, dtype="float32", vit_dp=0, disable_overlap_schedule=not overlap) as engine:
                    inputs = build_text_workload(engine, batch_size, seed)
                    engine.generate_processed([warmup_input(engine)], max_tokens=4, temperature=0)
                    run = engine_run(engine, inputs, output_tokens)
                if overlap not in best or run.seconds < best[overlap].seconds:
                    best[overlap] = run
        results.append(LoopRuns(batch_size, best[False], best[True]))
        r = results[-1]
        print(
            f"batch {batch_size:3d}: normal {r.normal.rate:7.0f} tok/s, model idle {percent(r.normal.idle_share)} | "
            f"overlap {r.overlap.rate:7.0f} tok/s, model idle {percent(r.overlap.idle_share)}"
        )
    return results


def percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f}%"


# -- transformers -----------------------------------------------------------------------------------


def load_hf_model(path: Path, device: torch.device) -> torch.nn.Module:
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in HF_CLASSES:
        raise SystemExit(f"{path}: model_type {model_type!r} is not a Qwen3-VL model")
    return HF_CLASSES[model_type].from_pretrained(path, dtype=torch.float32).to(device).eval()


def hf_batch(
    inputs: list[ProcessedInput], pad_id: int, image_token_id: int, video_token_id: int
) -> dict[str, torch.Tensor]:
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


def hf_generate(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int, pad_id: int
) -> torch.Tensor:
    """Greedy tokens (batch, max_new_tokens). `eos_token_id=None`: EOS is neither a stop nor
    suppressed, as with the engine's ignore_eos, so every row runs to `max_new_tokens`."""
    out = model.generate(
        **{name: tensor.to(model.device) for name, tensor in batch.items()},
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    return out[:, batch["input_ids"].shape[1] :].cpu()


@dataclass
class HfSetting:
    """One batch size, timed on the first `requests` requests of the workload."""

    batch_size: int
    requests: int
    batches: list[dict[str, torch.Tensor]]
    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    def run(self, model: torch.nn.Module, max_new_tokens: int, pad_id: int) -> None:
        start = time.perf_counter()
        outputs = [hf_generate(model, batch, max_new_tokens, pad_id) for batch in self.batches]
        self.seconds.append(time.perf_counter() - start)
        self.tokens = [row.tolist() for out in outputs for row in out]

    @property
    def rate(self) -> float:
        """Output tokens/s of the fastest run, which is also the estimate for the whole workload."""
        return sum(len(t) for t in self.tokens) / min(self.seconds)

    def agreement(self, reference: list[list[int]]) -> tuple[int, int, int]:
        """(tokens equal to the reference's, tokens, requests identical to the reference's)."""
        pairs = list(zip(self.tokens, reference))
        equal = sum(a == b for row, ref in pairs for a, b in zip(row, ref))
        return equal, sum(len(row) for row in self.tokens), sum(row == ref for row, ref in pairs)

    def agrees(self, reference: list[list[int]]) -> bool:
        equal, total, _ = self.agreement(reference)
        return equal >= MIN_AGREEMENT * total


def hf_settings(
    inputs: list[ProcessedInput], batch_sizes: list[int], min_requests: int, token_ids: tuple[int, int, int]
) -> list[HfSetting]:
    """Each batch size gets the first max(2 batches, `min_requests`) requests, left-padded per batch."""
    settings = []
    for size in batch_sizes:
        if size > len(inputs):
            print(f"transformers batch {size} skipped: the workload has {len(inputs)} requests")
            continue
        count = min(len(inputs), max(2 * size, min_requests))
        batches = [hf_batch(inputs[s : min(s + size, count)], *token_ids) for s in range(0, count, size)]
        settings.append(HfSetting(size, count, batches))
    return settings


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: built-in tiny MoE)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=16, help="distinct images, shared round-robin")
    parser.add_argument("--hf-batch-sizes", default="1,8,16,32,64", help="comma-separated")
    parser.add_argument("--hf-min-requests", type=int, default=16, help="requests timed per batch size (>= 2 batches)")
    parser.add_argument("--loop-batch-sizes", default="1,8,32", help="text-only batches run under both event loops")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; each setting counts with its fastest")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 requests x 16 tokens, 8 images, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.output_tokens, args.images, args.repeats = 16, 16, 8, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    print(f"model {path}, float32, torch threads {torch.get_num_threads()}, fastest of {args.repeats} rounds")

    engine = cold_engine(path, None)
    workload = build_workload(engine, args.requests, args.images, args.output_tokens, args.seed)
    print(f"workload: {workload.description}")
    token_ids = (
        engine.tokenizer.token_to_id("<|endoftext|>"),  # pad
        engine.model_config.image_token_id,
        engine.model_config.video_token_id,
    )
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    settings = hf_settings(workload.inputs, batch_sizes, args.hf_min_requests, token_ids)
    if not settings:
        raise SystemExit("no transformers batch size fits the workload")
    model = load_hf_model(path, engine.server_args.resolved_device())  # the engine's device
    hf_generate(model, hf_batch([warmup_input(engine)], *token_ids), 4, token_ids[0])

    # Rounds alternate the two implementations so that both see the same machine load. Each engine
    # round starts with an empty prefix cache and its own copy of the inputs (as a server receives
    # them: the engine hashes and annotates the media items).
    runs: list[EngineRun] = []
    for round_ in range(args.repeats):
        if round_ > 0:
            engine = cold_engine(path, engine)
        runs.append(engine_run(engine, copy.deepcopy(workload.inputs), args.output_tokens))
        if runs[-1].tokens != runs[0].tokens:
            print(f"note: the engine's tokens in round {round_ + 1} differ from round 1's")
        for setting in settings:
            setting.run(model, args.output_tokens, token_ids[0])
        hf_rates = " ".join(f"b{s.batch_size}={sum(map(len, s.tokens)) / s.seconds[-1]:.0f}" for s in settings)
        print(f"round {round_ + 1}: vlm_serve {runs[-1].rate:.0f} tok/s | transformers {hf_rates} tok/s")
    best_run = min(runs, key=lambda run: run.seconds)
    reference = runs[0].tokens

    print()
    print(f"event loops, {args.output_tokens} tokens per request, fastest of {args.repeats} rounds:")
    loops = compare_loops(path, [int(b) for b in args.loop_batch_sizes.split(",")], args.output_tokens, args.repeats, args.seed)

    print()
    print(
        f"vlm_serve    : {best_run.rate:8.1f} tok/s (all {args.requests} requests in one call) | model idle "
        f"{percent(best_run.idle_share)} | prompt tokens from the prefix cache {percent(best_run.cached_share)}"
    )
    for s in settings:
        equal, total, identical = s.agreement(reference)
        print(
            f"transformers : {s.rate:8.1f} tok/s at batch {s.batch_size:3d} (timed on {s.requests} requests) | "
            f"tokens equal to vlm_serve's {equal}/{total}, requests identical {identical}/{s.requests}"
        )
    correct = [s for s in settings if s.agrees(reference)]
    if len(correct) < len(settings):
        print(f"note: transformers settings with under {MIN_AGREEMENT:.0%} of their tokens equal to the engine's "
              f"are left out of its best")
    best = max(correct or settings, key=lambda s: s.rate)

    print()
    print(f"{'workload':<28}{workload.description}")
    print(f"{'torch threads':<28}{torch.get_num_threads()}")
    print(f"{'vlm_serve engine':<28}{best_run.rate:.1f} tok/s")
    print(f"{'transformers, best batch':<28}{best.rate:.1f} tok/s (batch {best.batch_size})")
    print(f"{'ratio':<28}{best_run.rate / best.rate:.2f}x (target >= 3x)")
    for r in loops:
        print(
            f"{'model idle at batch ' + str(r.batch_size):<28}normal {percent(r.normal.idle_share)}, overlap "
            f"{percent(r.overlap.idle_share)} (goal < 2%) | overlap/normal tok/s {r.overlap.rate / r.normal.rate:.2f}x"
        )
    print(f"{'total run time':<28}{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
