"""Offline generation throughput: vlm_serve's in-process Engine vs transformers' `generate` (and vLLM's
offline `LLM.generate` where a vLLM venv is given).

Both run the same checkpoint (default: the built-in model; `--model DIR` for another
Qwen3-VL checkpoint) in float32 on the same workload, built once with our `MultimodalProcessor`
(whose ids and pixel values are identical to transformers' processor, see test_preprocess):
`--requests` requests, each one image plus a prompt, `--images` distinct images of varied sizes
(64..256 px per side) shared round-robin, the same system prompt in every request and user texts of
different lengths; every request produces exactly `--output-tokens` tokens (greedy, EOS ignored).
With `--output-len-sigma S` > 0 each request produces its own number of tokens instead, drawn as
bench_serving.py draws them: log-normal of median `--output-tokens` and shape S, clipped to
[1, 8 x median] (the long tail of real answers; still greedy with EOS ignored, so that every
implementation produces the same tokens).

* vlm_serve: every request `Engine.submit`ted with its own `max_tokens`, then stepped until all are
  done (after a small warm-up call), with the default event loop (overlap scheduling).
* Overlap: batches of `--loop-batch-sizes` text-only requests under `event_loop_normal` and
  `event_loop_overlap`, in alternating rounds: tokens/s, and the share of wall time the model is idle
  waiting for the scheduler (wall time minus the model's busy time, `metrics.time_forward`: the
  forward thread's work under overlap). Goal: under 2% with overlap.
* transformers: `Qwen3VL(Moe)ForConditionalGeneration.generate`, greedy, left-padded batches of
  each of `--hf-batch-sizes` (images of a batch concatenated in order; transformers derives the
  M-RoPE positions from the attention mask). A static batch runs until its longest request is done:
  only each request's own tokens count as output, the rest is waste (reported). A batch size is timed
  on the first `max(2 batches, --hf-min-requests)` requests and its tokens/s is taken for the whole
  workload (with varied lengths, an estimate: its batches' waste depends on their longest requests);
  the best batch size is the baseline. Every measured request's own tokens are compared with the
  engine's (which match transformers' unbatched ones, see test_model_parity): broken left-padded batching
  (wrong positions or masks) would show as a low agreement, and a setting with less than
  `MIN_AGREEMENT` of its tokens equal to the engine's does not count as transformers' best.
* vLLM (with `--vllm-python`, the python of a venv with vLLM's CPU build; see ../shared/PEERS.md):
  `LLM(model, dtype="float32").generate` in a subprocess of that python (benchmarks/vllm_offline.py),
  loaded once, on the same requests (our rendered chat prompts, the images as lossless PNGs, each
  request's own `max_tokens`, greedy, `ignore_eos`), its prefix and multimodal caches emptied before
  every round, timed around `generate` alone; its prompt and output token ids are compared with
  ours. vLLM runs with `VLLM_CPU_OMP_THREADS_BIND` over as many cores as torch has threads here; the
  end of its log is printed if it fails.

The engine runs with its default options (on CPU `--vit-dp 0`: the vision tower in its scheduler's loop,
every core for both) unless `--vit-dp` is given; with encoder processes it sets this process's torch
thread count for its LLM, so transformers' runs set it back first: transformers always uses torch's
threads (`--threads`).

Timing is noisy on small shared machines, so the implementations alternate in `--repeats` rounds
(one engine run, one run of each transformers batch size, one vLLM run) and every setting counts
with its fastest round. Output tokens/s count generated tokens only; torch keeps its default thread
count unless `--threads` is given.

    python benchmarks/bench_offline.py [--model DIR] [--requests 64] [--output-tokens 64] [--quick]
    python benchmarks/bench_offline.py --model /tmp/preset-medium-moe --output-tokens 128 \\
        --output-len-sigma 0.8 --vllm-python ~/peers/vllm-cpu/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from bench_serving import lognormal_lengths  # benchmarks/, next to this script
from compare_peer import VllmScript

from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.engine import Engine
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.testing.media import make_image

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
HERE = Path(__file__).resolve().parent


@dataclass
class Workload:
    conversations: list[list[dict]]  # chat messages, images as PIL images
    inputs: list[ProcessedInput]  # the conversations processed
    max_tokens: list[int]  # each request's number of output tokens
    description: str


# -- workload --------------------------------------------------------------------------------------


def user_text(rng: np.random.Generator) -> str:
    """A question with 0..6 sentences of context in front: user texts of quite different lengths."""
    context = [FILLER[k] for k in rng.permutation(len(FILLER))[: rng.integers(0, len(FILLER) + 1)]]
    return " ".join([*context, QUESTIONS[rng.integers(len(QUESTIONS))]])


def build_workload(
    engine: Engine, requests: int, images: int, output_tokens: int, output_sigma: float, seed: int
) -> Workload:
    rng = np.random.default_rng(seed)
    pictures = [make_image(*rng.integers(64, 257, size=2), seed=seed + k) for k in range(images)]
    conversations = [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {
                "role": "user",
                "content": [{"type": "image", "image": pictures[i % images]}, {"type": "text", "text": user_text(rng)}],
            },
        ]
        for i in range(requests)
    ]
    inputs = [engine.processor.process_messages(messages, add_generation_prompt=True) for messages in conversations]
    # a generator of its own, so that the sigma changes neither the images nor the texts
    max_tokens = lognormal_lengths(np.random.default_rng(seed + 2), output_tokens, output_sigma, requests)
    merge = engine.model_config.vision.spatial_merge_size
    prompt_lens = [len(x.input_ids) for x in inputs]
    image_tokens = [item.num_tokens(merge) for x in inputs for item in x.mm_items]
    outputs = (
        f"x {output_tokens} output tokens"
        if output_sigma == 0
        else f"with log-normal output lengths (median {output_tokens}, sigma {output_sigma:g}: {min(max_tokens)}.."
        f"{max(max_tokens)}, mean {statistics.mean(max_tokens):.0f}, {sum(max_tokens)} in all)"
    )
    description = (
        f"{requests} requests {outputs} (greedy, EOS ignored); each one image "
        f"({images} distinct, 64..256 px per side, {min(image_tokens)}..{max(image_tokens)} image tokens) + "
        f"shared system prompt + user text; prompts {min(prompt_lens)}..{max(prompt_lens)} tokens "
        f"(mean {statistics.mean(prompt_lens):.0f})"
    )
    return Workload(conversations, inputs, max_tokens, description)


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


def warmup_messages() -> list[dict]:
    """A small image request that shares no prefix with the workload (no system prompt)."""
    content = [{"type": "image", "image": make_image(96, 64, seed=12345)}, {"type": "text", "text": "Hello."}]
    return [{"role": "user", "content": content}]


def warmup_input(engine: Engine) -> ProcessedInput:
    return engine.processor.process_messages(warmup_messages(), add_generation_prompt=True)


def cold_engine(path: Path, engine: Engine | None, **options: Any) -> Engine:
    """A warmed-up engine (of these `Engine` options) with an empty prefix cache, so that a round does
    not reuse the last one's prompts: `engine.flush_cache()` where the engine has one, else a new one."""
    flush = getattr(engine, "flush_cache", None)
    if not callable(flush) or flush() is False:
        if engine is not None:
            engine.shutdown()
        engine = Engine(model=path, dtype="float32", **options)
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


def engine_run(engine: Engine, inputs: list[ProcessedInput], max_tokens: list[int]) -> EngineRun:
    """All `inputs` submitted at once, each with its own `max_tokens`, and stepped until they are done
    and the scheduler is idle (as `generate_processed` does); timed, with the model's busy time."""
    busy = engine.scheduler.metrics.time_forward
    start = time.perf_counter()
    submissions = [engine.submit(x, max_tokens=n, temperature=0, ignore_eos=True) for x, n in zip(inputs, max_tokens)]
    while not all(s.done for s in submissions) or not engine.scheduler.is_idle():
        engine.step()
    outputs = [engine.result(s) for s in submissions]
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
                    run = engine_run(engine, inputs, [output_tokens] * batch_size)
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


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, int, int]:
    """(tokens equal to the reference's at the same place, tokens, requests identical to the
    reference's), over the first `len(tokens)` requests of `reference`."""
    pairs = list(zip(tokens, reference))
    equal = sum(a == b for row, ref in pairs for a, b in zip(row, ref))
    return equal, sum(map(len, tokens)), sum(row == ref for row, ref in pairs)


def own_tokens(rows: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each row of a static batch cut to its request's own length (the batch ran to its longest)."""
    return [row[:n] for row, n in zip(rows, max_tokens, strict=True)]


@dataclass
class HfSetting:
    """One batch size, timed on the first `requests` requests of the workload."""

    batch_size: int
    requests: int
    batches: list[dict[str, torch.Tensor]]
    max_tokens: list[list[int]]  # per batch, its requests' own lengths
    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # each request's own tokens

    def run(self, model: torch.nn.Module, pad_id: int) -> None:
        start = time.perf_counter()
        batches = list(zip(self.batches, self.max_tokens))
        outputs = [hf_generate(model, batch, max(lengths), pad_id) for batch, lengths in batches]
        self.seconds.append(time.perf_counter() - start)
        self.tokens = [row for out, (_, lengths) in zip(outputs, batches) for row in own_tokens(out.tolist(), lengths)]

    @property
    def rate(self) -> float:
        """Output tokens/s of the fastest run, which is also the estimate for the whole workload."""
        return sum(map(len, self.tokens)) / min(self.seconds)

    @property
    def waste(self) -> float:
        """Share of the generated tokens that lie past their request's own length."""
        generated = sum(len(lengths) * max(lengths) for lengths in self.max_tokens)
        return 1 - sum(map(sum, self.max_tokens)) / generated

    def agrees(self, reference: list[list[int]]) -> bool:
        equal, total, _ = agreement(self.tokens, reference)
        return equal >= MIN_AGREEMENT * total


def hf_settings(
    inputs: list[ProcessedInput],
    max_tokens: list[int],
    batch_sizes: list[int],
    min_requests: int,
    token_ids: tuple[int, int, int],
) -> list[HfSetting]:
    """Each batch size gets the first max(2 batches, `min_requests`) requests, left-padded per batch."""
    settings = []
    for size in batch_sizes:
        if size > len(inputs):
            print(f"transformers batch {size} skipped: the workload has {len(inputs)} requests")
            continue
        count = min(len(inputs), max(2 * size, min_requests))
        starts = range(0, count, size)
        batches = [hf_batch(inputs[s : min(s + size, count)], *token_ids) for s in starts]
        settings.append(HfSetting(size, count, batches, [max_tokens[s : min(s + size, count)] for s in starts]))
    return settings


# -- vLLM -------------------------------------------------------------------------------------------


def vllm_request(
    engine: Engine, messages: list[dict], max_tokens: int, images: dict[int, str], directory: Path
) -> dict[str, object]:
    """A request as vllm_offline.py reads it: the prompt rendered with our chat template, its images
    saved as PNG (lossless: the same pixels) into `directory`, once each (`images`: path by id)."""
    parts = [part for m in messages if isinstance(m["content"], list) for part in m["content"]]
    pictures = [part["image"] for part in parts if part["type"] == "image"]
    for picture in pictures:
        if id(picture) not in images:
            images[id(picture)] = str(directory / f"image{len(images)}.png")
            picture.save(images[id(picture)])
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt": prompt, "images": [images[id(p)] for p in pictures], "max_tokens": max_tokens}


@dataclass
class VllmRun:
    seconds: float
    tokens: list[list[int]]
    prompt_ids: list[list[int]]

    @property
    def rate(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


class VllmOffline:
    """vLLM's `LLM.generate` on a workload (conversations, each with its `max_tokens`), in a subprocess
    of the vLLM venv's python (benchmarks/vllm_offline.py) that loads the model once and runs one timed
    round per `run()`. `llm_options` go to `LLM(...)` (dtype, speculative_config). Its requests, images
    and log live in a temporary directory, removed on exit."""

    def __init__(
        self,
        python: Path,
        engine: Engine,
        model: Path,
        conversations: list[list[dict]],
        max_tokens: list[int],
        threads: int,
        **llm_options: object,
    ) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="bench_offline_vllm_")
        directory = Path(self._directory.name)
        images: dict[int, str] = {}
        requests = [
            vllm_request(engine, messages, n, images, directory) for messages, n in zip(conversations, max_tokens)
        ]
        inputs = [engine.processor.process_messages(m, add_generation_prompt=True) for m in conversations]
        longest = max(len(x.input_ids) + n for x, n in zip(inputs, max_tokens))
        spec = {
            "model": str(model.absolute()),
            "max_model_len": max(4096, longest),
            "warmup": vllm_request(engine, warmup_messages(), 4, images, directory),
            "requests": requests,
            "llm_options": llm_options,
        }
        (directory / "requests.json").write_text(json.dumps(spec))
        self.vllm = VllmScript(python, "vllm_offline.py", directory / "requests.json", directory / "vllm.log", threads)
        self.vllm.reply()  # {"ready": true}: loaded and warmed up

    def run(self, count: int | None = None) -> VllmRun:
        """One timed round: every request, or the first `count`."""
        reply = self.vllm.ask("run" if count is None else f"run {count}")
        return VllmRun(reply["seconds"], reply["token_ids"], reply["prompt_token_ids"])

    def __enter__(self) -> VllmOffline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Ends the subprocess and removes the directory."""
        self.vllm.close()
        self._directory.cleanup()


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--images", type=int, default=16, help="distinct images, shared round-robin")
    parser.add_argument("--hf-batch-sizes", default="1,8,16,32,64", help="comma-separated")
    parser.add_argument("--hf-min-requests", type=int, default=16, help="requests timed per batch size (>= 2 batches)")
    parser.add_argument(
        "--output-len-sigma",
        type=float,
        default=0.0,
        help="log-normal shape of each request's output tokens around the median --output-tokens; 0: all equal (0)",
    )
    parser.add_argument(
        "--loop-batch-sizes", default="1,8,32", help="text-only batches run under both event loops; empty: none"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; each setting counts with its fastest")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--vit-dp", type=int, default=None, help="the engine's encoder processes (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="16 requests x 16 tokens, 8 images, 2 rounds")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="python of a venv with vLLM's CPU build: also time vLLM's LLM.generate",
    )
    args = parser.parse_args()
    if not 0 <= args.output_len_sigma < math.inf:
        parser.error("--output-len-sigma must be finite and >= 0")
    if args.vllm_python is not None and not args.vllm_python.exists():
        parser.error(f"--vllm-python {args.vllm_python}: no such file")
    if args.quick:
        args.requests, args.output_tokens, args.images, args.repeats = 16, 16, 8, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()  # transformers' and vLLM's; the engine sets its own
    engine_options = {} if args.vit_dp is None else {"vit_dp": args.vit_dp}
    path = args.model or BUILTIN_MODEL
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    print(
        f"model {path}, float32, torch threads {threads}, engine options {engine_options or 'default'}, "
        f"fastest of {args.repeats} rounds"
    )

    engine = cold_engine(path, None, **engine_options)
    workload = build_workload(engine, args.requests, args.images, args.output_tokens, args.output_len_sigma, args.seed)
    print(f"workload: {workload.description}")
    token_ids = (
        engine.tokenizer.token_to_id("<|endoftext|>"),  # pad
        engine.model_config.image_token_id,
        engine.model_config.video_token_id,
    )
    batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    settings = hf_settings(workload.inputs, workload.max_tokens, batch_sizes, args.hf_min_requests, token_ids)
    if not settings:
        raise SystemExit("no transformers batch size fits the workload")
    vllm = (
        VllmOffline(args.vllm_python, engine, path, workload.conversations, workload.max_tokens, threads)
        if args.vllm_python
        else contextlib.nullcontext()
    )
    torch.set_num_threads(threads)
    model = load_hf_model(path, engine.server_args.resolved_device())  # the engine's device
    hf_generate(model, hf_batch([warmup_input(engine)], *token_ids), 4, token_ids[0])

    # Rounds alternate the implementations so that all see the same machine load. Each engine round
    # starts with an empty prefix cache and its own copy of the inputs (as a server receives them:
    # the engine hashes and annotates the media items); each vLLM round with empty caches too.
    runs: list[EngineRun] = []
    vllm_runs: list[VllmRun] = []
    with vllm:
        for round_ in range(args.repeats):
            if round_ > 0:
                engine = cold_engine(path, engine, **engine_options)
            runs.append(engine_run(engine, copy.deepcopy(workload.inputs), workload.max_tokens))
            if runs[-1].tokens != runs[0].tokens:
                print(f"note: the engine's tokens in round {round_ + 1} differ from round 1's")
            torch.set_num_threads(threads)
            for setting in settings:
                setting.run(model, token_ids[0])
            if args.vllm_python:
                vllm_runs.append(vllm.run())
            hf_rates = " ".join(f"b{s.batch_size}={sum(map(len, s.tokens)) / s.seconds[-1]:.0f}" for s in settings)
            vllm_rate = f" | vLLM {vllm_runs[-1].rate:.0f} tok/s" if vllm_runs else ""
            print(f"round {round_ + 1}: vlm_serve {runs[-1].rate:.0f} tok/s | transformers {hf_rates} tok/s{vllm_rate}")
    best_run = min(runs, key=lambda run: run.seconds)
    reference = runs[0].tokens

    loop_sizes = [int(b) for b in args.loop_batch_sizes.split(",") if b.strip()]
    if loop_sizes:
        print()
        print(f"event loops, {args.output_tokens} tokens per request, fastest of {args.repeats} rounds:")
    loops = compare_loops(path, loop_sizes, args.output_tokens, args.repeats, args.seed)

    print()
    print(
        f"vlm_serve    : {best_run.rate:8.1f} tok/s (all {args.requests} requests at once) | model idle "
        f"{percent(best_run.idle_share)} | prompt tokens from the prefix cache {percent(best_run.cached_share)}"
    )
    for s in settings:
        equal, total, identical = agreement(s.tokens, reference)
        print(
            f"transformers : {s.rate:8.1f} tok/s at batch {s.batch_size:3d} (timed on {s.requests} requests) | "
            f"tokens past their request's length {percent(s.waste)} | tokens equal to vlm_serve's {equal}/{total}, "
            f"requests identical {identical}/{s.requests}"
        )
    correct = [s for s in settings if s.agrees(reference)]
    if len(correct) < len(settings):
        print(
            f"note: transformers settings with under {MIN_AGREEMENT:.0%} of their tokens equal to the engine's "
            f"are left out of its best"
        )
    best = max(correct or settings, key=lambda s: s.rate)
    best_vllm = min(vllm_runs, key=lambda run: run.seconds) if vllm_runs else None
    if best_vllm is not None:
        equal, total, identical = agreement(vllm_runs[0].tokens, reference)
        same_prompts = sum(ids == x.input_ids for ids, x in zip(vllm_runs[0].prompt_ids, workload.inputs))
        print(
            f"vLLM         : {best_vllm.rate:8.1f} tok/s (LLM.generate, all {args.requests} requests at once) | "
            f"tokens equal to vlm_serve's {equal}/{total}, requests identical {identical}/{args.requests}, "
            f"prompt token ids identical {same_prompts}/{args.requests}"
        )

    print()
    print(f"{'workload':<28}{workload.description}")
    print(f"{'threads':<28}{threads} (transformers' torch, vLLM's OpenMP); engine {engine_options or 'default'}")
    print(f"{'':<28}{'output tok/s':>12}  {'vlm_serve / it':>14}")
    print(f"{'vlm_serve engine':<28}{best_run.rate:12.1f}")
    hf_label = f"transformers, batch {best.batch_size}"
    print(f"{hf_label:<28}{best.rate:12.1f}  {best_run.rate / best.rate:13.2f}x (target >= 3x)")
    if best_vllm is not None:
        print(f"{'vLLM LLM.generate':<28}{best_vllm.rate:12.1f}  {best_run.rate / best_vllm.rate:13.2f}x")
    for r in loops:
        print(
            f"{'model idle at batch ' + str(r.batch_size):<28}normal {percent(r.normal.idle_share)}, overlap "
            f"{percent(r.overlap.idle_share)} (goal < 2%) | overlap/normal tok/s {r.overlap.rate / r.normal.rate:.2f}x"
        )
    print(f"{'total run time':<28}{time.perf_counter() - began:.0f} s")
    engine.shutdown()


if __name__ == "__main__":
    main()
