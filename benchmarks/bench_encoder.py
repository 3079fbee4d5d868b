"""Vision encoder: encoder pool throughput, time to first token of a cached image, and decode latency
while large images arrive (encoder pool vs the vision tower inline in the scheduler loop).

The tiny random checkpoint's vision tower (hidden 32, depth 3) costs next to nothing, so the
benchmark builds its own checkpoint: the tiny MoE model with a larger random vision tower (`VISION_*`
below: hidden 256, depth 6; weights normal(0, 0.02), LayerNorms 1 and 0) and an image budget of
`MAX_IMAGE_PIXELS` = 768x768 (a 1024x1024 image becomes 48x48 = 2304 patches, 576 LLM tokens). It is
written to a temporary folder, or into `--model DIR` when DIR holds no checkpoint yet (a DIR with a
config.json is used as it is). Everything runs in float32 on the CPU; all figures come from one run.

1. Encode throughput. `--images` distinct images (448..768 px per side) are preprocessed once (not
   timed) and encoded by `EncoderPool`s of one rank with one thread, two ranks with one thread each
   (each rank's share of a 2-core machine) and one rank with two threads. All images go in one
   `submit`, as the scheduler hands over the new items of a burst of requests that arrive together
   (the pool splits them across its ranks by patch count, one job per rank); the time runs until the
   last result is polled. Pool startup and a warm-up batch are not timed. Every round encodes fresh
   copies of the pixels, so that it pays for moving them into shared memory as a server's new images
   do. The reference is `encode_tasks` on all images in this process with one thread, which is what
   a one-rank pool runs: the pool's time outside the vision tower (its wall time minus the results'
   `vit` seconds) is the inter-process overhead (shared memory, pickling, the channels). The CPU time
   of the encoding processes per wall second ("cores busy") shows whether the ranks got their cores.
2. TTFT. An `Engine` with its defaults (`vit_dp=1`), `stream()` with max_tokens=1, timed from the
   call to the first chunk; the image is PNG bytes of 1024x1024 px. Three kinds of request: a new
   image each trial (uncached); the same image with different text before it, so that the prefix
   cache stops before the image and only the multimodal caches (processed input, embeddings) serve
   it (cached); the same prompt again, so that the prefix cache covers the image too (repeated).
   Medians over `--ttft-trials`, and the per-stage `media_timings` of one request of each kind.
3. Decode inter-token latency (ITL) while large images arrive, with an encoder pool (`vit_dp=1`) and
   inline (`vit_dp=0`: the vision tower runs inside the scheduler step, so decode waits for it). The
   benchmark drives the scheduler itself: `--itl-requests` text-only requests decode (greedy, EOS
   ignored, at most `--itl-max-tokens`); after `WARMUP_STEPS` of their tokens a request with a new
   1024x1024 image (preprocessed beforehand, one output token) arrives every `--itl-every` of their
   decode steps, `--itl-images` in all, so both modes get the same images per decoded token. The ITL
   is the wall time between consecutive steps that give the text requests a token, counted from the
   first image's arrival until the first such step after the last image request is done (then the
   text requests are aborted). The window is longer with the pool, as decode goes on while the images
   queue for the encoder. The ITL before the first image is shown as a baseline.
4. The same through a real server in the target deployment's shape, `--tp-size 2 --ep-size 2` with an
   encoder pool of two ranks (`--vit-dp 2`) and inline (`--vit-dp 0`, the tower on TP rank 0):
   streamed text requests, an image request (the PNG as a data URL) every `--itl-every` chunks of the
   first stream; the ITL is the gap between a stream's chunks as the client sees it.

Caveats. On CPU an engine with a pool splits the cores: each rank takes its share and the LLM the
rest (on 2 cores, one each), while inline the LLM and its vision tower use every core in turn. With
a GPU the ranks run beside the LLM. The image requests' own prefill stalls decode in both modes
(chunked prefill bounds each stall; `--chunked-prefill-size` is kept modest so that what differs
between the modes is the vision tower). `--threads` sets the torch threads of this process (default:
all cores) for the throughput reference and the inline engine. Timing is noisy on small shared machines:
the throughput settings alternate in `--rounds` rounds and each counts with its fastest round; TTFT
figures are medians.

    python benchmarks/bench_encoder.py [--model DIR] [--images 48] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.engine import Engine, Submission
from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.models.base import VISION_PREFIX, VisionTower
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.llm.models.registry import model_family
from vlm_serve.multimodal.items import MEDIA_STAGES, MediaTimings, MultimodalItem
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.server.ports import free_port
from vlm_serve.testing.media import make_image
from vlm_serve.testing.tiny_model import create_tiny_model
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder import EncodeResult, EncodeTask, encode_tasks
from vlm_serve.vision.pool import EncoderConcerns, EncoderPool

# The benchmark checkpoint's vision tower (the text model is the tiny MoE one).
VISION_HIDDEN = 256
VISION_INTERMEDIATE = 1024
VISION_HEADS = 4
VISION_DEPTH = 6
VISION_POSITIONS = 48 * 48  # the learned position grid
DEEPSTACK_INDEXES = [2, 4]  # as many as the tiny model's, within the depth
INIT_STD = 0.02
MAX_IMAGE_PIXELS = 768 * 768  # images are shrunk to at most this: 1024x1024 -> 48x48 patches

LARGE_IMAGE = 1024  # side of the TTFT and decode-latency images
THROUGHPUT_SIDES = (448, 768)  # side range of the throughput images
WARMUP_IMAGES = 4  # untimed images encoded by each throughput setting first
WARMUP_STEPS = 16  # text-only decode steps before the first image arrives
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
CPU = torch.device("cpu")


# -- the benchmark checkpoint -----------------------------------------------------------------------


@torch.no_grad()
def init_tower(tower: VisionTower, seed: int) -> None:
    """Seeded random weights: normal(0, INIT_STD) for linear, convolution and embedding weights, zero
    biases, LayerNorms weight 1 and bias 0."""
    generator = torch.Generator().manual_seed(seed)
    for module in tower.modules():
        if isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (LinearBase, nn.Conv3d, nn.Embedding)):
            module.weight.normal_(0.0, INIT_STD, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_checkpoint(path: Path, seed: int) -> None:
    """The tiny MoE checkpoint with the larger vision tower (its text weights kept) and image budget."""
    create_tiny_model(path, arch="moe", seed=seed)
    vision = {
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": VISION_INTERMEDIATE,
        "num_heads": VISION_HEADS,
        "depth": VISION_DEPTH,
        "num_position_embeddings": VISION_POSITIONS,
        "deepstack_visual_indexes": DEEPSTACK_INDEXES,
    }
    edit_json(path / "config.json", lambda config: config["vision_config"].update(vision))
    # the image budget is stored as pixel counts in `size` (transformers 5's form)
    edit_json(path / "preprocessor_config.json", lambda config: config["size"].update(longest_edge=MAX_IMAGE_PIXELS))
    config = ModelConfig.from_pretrained(path)
    tower = model_family(config).vision(config.vision)
    init_tower(tower, seed)
    weights_file = path / "model.safetensors"
    tensors = {name: t for name, t in load_file(weights_file).items() if not name.startswith(VISION_PREFIX)}
    tensors |= {VISION_PREFIX + name: t.contiguous() for name, t in tower.state_dict().items()}
    save_file(tensors, str(weights_file), metadata={"format": "pt"})


def describe_tower(path: Path) -> str:
    vision = ModelConfig.from_pretrained(path).vision
    return (
        f"vision tower hidden {vision.hidden_size}, intermediate {vision.intermediate_size}, {vision.num_heads} heads, "
        f"depth {vision.depth}, deepstack {vision.deepstack_visual_indexes}"
    )


# -- 1. encode throughput ---------------------------------------------------------------------------


def throughput_items(path: Path, count: int, seed: int) -> list[MultimodalItem]:
    """`count` distinct preprocessed images, sides uniform in THROUGHPUT_SIDES."""
    processor = MultimodalProcessor.from_pretrained(path, Tokenizer.from_pretrained(path))
    rng = np.random.default_rng(seed)
    items = []
    for k in range(count):
        width, height = rng.integers(THROUGHPUT_SIDES[0], THROUGHPUT_SIDES[1] + 1, size=2)
        image = make_image(int(width), int(height), seed=seed + k)
        items.append(processor.process(IMAGE_PROMPT, images=[image]).mm_items[0])
    return items


def fresh_tasks(items: list[MultimodalItem]) -> list[EncodeTask]:
    """Tasks with their own copy of the pixels (a pool moves each new tensor into shared memory)."""
    return [EncodeTask(item.hash, item.grid_thw, replace(item.pixels, data=item.pixels.data.clone())) for item in items]


def rank_cpu_seconds(pool: EncoderPool) -> float:
    """CPU time (user + system) the pool's rank processes have used so far, from /proc."""
    total = 0
    for process in pool.supervisor.processes:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class EncodeRound:
    seconds: float
    cpu_seconds: float  # used by the processes that encoded: the ranks, or this one
    vit_seconds: float  # in vision tower forwards (the results' `vit`, summed)


def checked(results: list[EncodeResult]) -> list[EncodeResult]:
    for result in results:
        if result.error is not None:
            raise RuntimeError(result.error)
    return results


def encode_with_pool(pool: EncoderPool, tasks: list[EncodeTask]) -> EncodeRound:
    """One `submit` of all tasks, then polls until the last result is back."""
    cpu = rank_cpu_seconds(pool)
    start = time.perf_counter()
    pool.submit(tasks)
    results: list[EncodeResult] = []
    while len(results) < len(tasks):
        results += checked(pool.poll(timeout=1.0))
    seconds = time.perf_counter() - start
    return EncodeRound(seconds, rank_cpu_seconds(pool) - cpu, sum(r.vit for r in results))


def encode_in_process(visual: VisionTower, max_patches: int, tasks: list[EncodeTask]) -> EncodeRound:
    """`encode_tasks` on all tasks in this process with one torch thread, as a rank runs its job."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu, start = time.process_time(), time.perf_counter()
        results = checked(encode_tasks(visual, tasks, max_patches))
        seconds = time.perf_counter() - start
        return EncodeRound(seconds, time.process_time() - cpu, sum(r.vit for r in results))
    finally:
        torch.set_num_threads(threads)


@dataclass
class EncodeSetting:
    label: str
    encode: Callable[[list[EncodeTask]], EncodeRound]
    rounds: list[EncodeRound] = field(default_factory=list)

    @property
    def best(self) -> EncodeRound:
        return min(self.rounds, key=lambda r: r.seconds)

    def rate(self, count: float) -> float:
        """`count` (images or patches) per second in the fastest round."""
        return count / self.best.seconds

    @property
    def cores(self) -> float:
        """Cores kept busy in the fastest round: CPU time / wall time."""
        return self.best.cpu_seconds / self.best.seconds


POOL_SETTINGS = (("pool dp1 x 1 thread", 1, 1), ("pool dp2 x 1 thread", 2, 1), ("pool dp1 x 2 threads", 1, 2))


def measure_throughput(path: Path, items: list[MultimodalItem], rounds: int) -> list[EncodeSetting]:
    """The in-process reference and the pool settings, alternating in `rounds` rounds."""
    server_args = ServerArgs(model=str(path))
    visual = load_vision_model(ModelConfig.from_pretrained(path), CPU, torch.float32)
    settings = [
        EncodeSetting(
            "in-process, 1 thread", lambda tasks: encode_in_process(visual, server_args.vit_max_patches_per_pass, tasks)
        )
    ]
    pools: list[EncoderPool] = []
    try:
        for label, dp, threads in POOL_SETTINGS:
            pool = EncoderPool.start(
                EncoderConcerns.of(ServerArgs(model=str(path), vit_dp=dp, vit_threads=threads)), CPU
            )
            pools.append(pool)
            settings.append(EncodeSetting(label, lambda tasks, pool=pool: encode_with_pool(pool, tasks)))
        for setting in settings:
            setting.encode(fresh_tasks(items[:WARMUP_IMAGES]))
        for round_ in range(rounds):
            for setting in settings:
                setting.rounds.append(setting.encode(fresh_tasks(items)))
            rates = " | ".join(f"{s.label} {len(items) / s.rounds[-1].seconds:.2f}" for s in settings)
            print(f"round {round_ + 1}: {rates} images/s")
    finally:
        for pool in pools:
            pool.shutdown()
    return settings


# -- 2. time to first token -------------------------------------------------------------------------


def png_bytes(side: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    make_image(side, side, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def png_url(side: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(side, seed)).decode()


def conversation(image: bytes | Image.Image, before: str) -> list[dict]:
    """One user turn: `before`, the image, a question."""
    content = [
        {"type": "text", "text": before},
        {"type": "image", "image": image},
        {"type": "text", "text": "What is in this picture?"},
    ]
    return [{"role": "user", "content": content}]


def time_to_first_token(engine: Engine, messages: list[dict]) -> float:
    start = time.perf_counter()
    with closing(engine.stream(messages, max_tokens=1, temperature=0)) as stream:
        next(stream)
        return time.perf_counter() - start


@dataclass
class TtftRun:
    seconds: dict[str, list[float]]  # by kind: uncached, cached, repeated
    timings: dict[str, MediaTimings]  # one request of each kind
    prefix_cached: dict[str, int]  # prompt tokens served from the prefix cache, same requests
    prompt_tokens: int

    def median(self, kind: str) -> float:
        return statistics.median(self.seconds[kind])


TTFT_KINDS = ("uncached", "cached", "repeated")


def ttft_prompts(image: bytes, k: int) -> dict[str, list[dict]]:
    """The three kinds of request for picture `k`: the cached one's text differs before the image."""
    first = conversation(image, f"Request {k}: please look carefully.")
    return {"uncached": first, "cached": conversation(image, f"Another question on picture {k}."), "repeated": first}


def measure_ttft(path: Path, trials: int, seed: int) -> TtftRun:
    pictures = [png_bytes(LARGE_IMAGE, seed=seed + 1000 + k) for k in range(trials + 2)]
    seconds: dict[str, list[float]] = {kind: [] for kind in TTFT_KINDS}
    with Engine(path, dtype="float32") as engine:
        engine.chat(conversation(pictures[0], "Warm-up."), max_tokens=1, temperature=0)
        for k in range(trials):
            for kind, messages in ttft_prompts(pictures[k + 1], k).items():
                seconds[kind].append(time_to_first_token(engine, messages))
        # the same three kinds once more through `chat`, for their media timings
        outputs = {
            kind: engine.chat(messages, max_tokens=1, temperature=0)
            for kind, messages in ttft_prompts(pictures[-1], trials).items()
        }
    return TtftRun(
        seconds,
        {kind: out.media_timings[0] for kind, out in outputs.items()},
        {kind: out.cached_tokens for kind, out in outputs.items()},
        outputs["uncached"].prompt_tokens,
    )


def print_media_timings(run: TtftRun) -> None:
    print(f"{'media timings (ms)':<30}" + "".join(f"{kind:>12}" for kind in TTFT_KINDS))
    for stage in MEDIA_STAGES:
        print(f"{stage:<30}" + "".join(f"{1000 * getattr(run.timings[kind], stage):12.1f}" for kind in TTFT_KINDS))
    hits = ("yes" if run.timings[kind].processor_cache_hit else "no" for kind in TTFT_KINDS)
    print(f"{'processor_cache_hit':<30}" + "".join(f"{hit:>12}" for hit in hits))
    print(f"{'embedding_source':<30}" + "".join(f"{run.timings[kind].embedding_source:>12}" for kind in TTFT_KINDS))
    tokens = (f"{run.prefix_cached[kind]}/{run.prompt_tokens}" for kind in TTFT_KINDS)
    print(f"{'prompt tokens in prefix cache':<30}" + "".join(f"{t:>12}" for t in tokens))


# -- 3. decode latency while images arrive ----------------------------------------------------------


@dataclass
class DecodeRun:
    label: str
    llm_threads: int  # torch threads of the LLM (this process) during the run
    baseline: list[float]  # ITLs of the text requests before the first image arrived
    window: list[float]  # ITLs from the first image's arrival until the images are done
    images_done: int
    images: int


def latency_stats(gaps: list[float]) -> dict[str, float]:
    """mean, p50, p99 and max in milliseconds."""
    ms = 1000 * np.asarray(gaps)
    return {"mean": ms.mean(), "p50": np.percentile(ms, 50), "p99": np.percentile(ms, 99), "max": ms.max()}


def measure_decode_latency(path: Path, vit_dp: int, args: argparse.Namespace) -> DecodeRun:
    """Text requests decode while image requests arrive every `args.itl_every` of their steps, through
    an in-process `Engine` stepped here. Inline, the LLM (and its vision tower) get this process's
    threads; with a pool, the engine leaves the LLM the cores its ranks do not take."""
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    with Engine(path, dtype="float32", vit_dp=vit_dp, chunked_prefill_size=args.chunked_prefill_size) as engine:
        llm_threads = torch.get_num_threads()
        texts_in = [
            engine.processor.process_messages([{"role": "user", "content": f"Story {i}: a long tale of the sea."}])
            for i in range(args.itl_requests)
        ]
        images_in = [
            engine.processor.process_messages(
                conversation(make_image(LARGE_IMAGE, LARGE_IMAGE, seed=args.seed + 2000 + j), "Describe it.")
            )
            for j in range(args.itl_images + 1)
        ]
        warmup = images_in.pop()  # same size as the measured ones: warms the tower for that grid
        engine.generate_processed([warmup, texts_in[0]], max_tokens=4, temperature=0, ignore_eos=True)

        texts = [engine.submit(x, max_tokens=args.itl_max_tokens, temperature=0, ignore_eos=True) for x in texts_in]
        images: list[Submission] = []
        token_times: list[float] = []  # end of each step that gave the text requests a token
        first_arrival: int | None = None  # index in token_times after which the first image arrived

        def produced() -> int:
            return sum(len(out.new_ids) for job in texts for choice in job.choices for out in choice.outs)

        while not all(job.done for job in texts):
            images_done = len(images) == len(images_in) and all(job.done for job in images)
            before = produced()
            engine.step()
            if produced() == before:
                continue
            token_times.append(time.perf_counter())
            if images_done:
                break  # the first text token after the last image request finished closes the window
            steps = len(token_times) - 1 - WARMUP_STEPS
            if steps >= 0 and steps % args.itl_every == 0 and len(images) < len(images_in):
                images.append(engine.submit(images_in[len(images)], max_tokens=1, temperature=0))
                if first_arrival is None:
                    first_arrival = len(token_times) - 1
        if first_arrival is None:
            raise SystemExit("the text requests ended before the first image arrived: raise --itl-max-tokens")
        finished_images = sum(job.done for job in images)
        for job in texts + images:
            engine.abort(job, "the measurement is over")
        while not all(job.done for job in texts + images):
            engine.step()
    gaps = np.diff(token_times).tolist()
    label = f"pool (vit_dp={vit_dp})" if vit_dp else "inline (vit_dp=0)"
    return DecodeRun(label, llm_threads, gaps[:first_arrival], gaps[first_arrival:], finished_images, len(images_in))


def measure_server_decode_latency(path: Path, vit_dp: int, args: argparse.Namespace) -> DecodeRun:
    """The same through a real server with `--tp-size 2 --ep-size 2` (the target deployment's shape):
    text requests stream; an image request (its PNG as a data URL) is sent every `args.itl_every`
    tokens of the first stream. The ITL is the gap between a stream's chunks, as its client sees it."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vlm_serve.cli",
        "serve",
        "--model",
        str(path),
        "--port",
        str(port),
        "--tp-size",
        "2",
        "--ep-size",
        "2",
        "--vit-dp",
        str(vit_dp),
        "--chunked-prefill-size",
        str(args.chunked_prefill_size),
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if "serving" in line:
                break
        else:
            raise SystemExit(f"the server did not start (exit code {server.wait()})")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        images = [png_url(LARGE_IMAGE, args.seed + 3000 + j) for j in range(args.itl_images + 1)]
        return asyncio.run(_stream_while_images_arrive(url, images, vit_dp, args))
    finally:
        server.terminate()
        server.wait(30)


async def _stream_while_images_arrive(url: str, images: list[str], vit_dp: int, args: argparse.Namespace) -> DecodeRun:
    def image_request(data_url: str) -> dict:
        content = [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "Describe it."}]
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}

    arrivals: list[list[float]] = [[] for _ in range(args.itl_requests)]  # chunk times per stream
    sent: list[float] = []  # when each image request was sent
    image_tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=600) as client:
        await client.post(url, json=image_request(images.pop()))  # warms the tower for this grid

        async def stream(i: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"Story {i}: a long tale of the sea."}],
                "stream": True,
                "max_tokens": args.itl_max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with client.stream("POST", url, json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    arrivals[i].append(time.perf_counter())
                    count = len(arrivals[0])
                    steps = count - WARMUP_STEPS
                    if i == 0 and steps >= 0 and steps % args.itl_every == 0 and len(sent) < len(images):
                        sent.append(time.perf_counter())
                        image_tasks.append(
                            asyncio.create_task(client.post(url, json=image_request(images[len(sent) - 1])))
                        )
                    if len(sent) == len(images) and all(t.done() for t in image_tasks):
                        return  # the images are done: the window is closed

        streams = [asyncio.create_task(stream(i)) for i in range(args.itl_requests)]
        await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)
        done_at = time.perf_counter()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, *image_tasks, return_exceptions=True)
    if not sent:
        raise SystemExit("the text requests ended before the first image arrived: raise --itl-max-tokens")
    baseline, window = [], []
    for times in arrivals:
        for earlier, later in zip(times, times[1:]):
            if later <= sent[0]:
                baseline.append(later - earlier)
            elif later <= done_at:
                window.append(later - earlier)
    finished = sum(t.done() and not t.cancelled() and t.exception() is None for t in image_tasks)
    label = f"TP2 pool (vit_dp={vit_dp})" if vit_dp else "TP2 inline (vit_dp=0)"
    return DecodeRun(label, 1, baseline, window, finished, len(images))


def print_decode_run(run: DecodeRun) -> None:
    base, window = latency_stats(run.baseline), latency_stats(run.window)
    print(
        f"{run.label:<20} LLM threads {run.llm_threads}, ITL before images: p50 {base['p50']:.1f} ms, max {base['max']:.1f} ms | while "
        f"{run.images_done}/{run.images} images arrive ({len(run.window)} gaps): mean {window['mean']:.1f}, "
        f"p50 {window['p50']:.1f}, p99 {window['p99']:.1f}, max {window['max']:.1f} ms"
    )


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint dir, built there if it has none (default: a temp dir)")
    parser.add_argument("--images", type=int, default=48, help="distinct images of the throughput runs")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds; each setting counts with its fastest")
    parser.add_argument("--ttft-trials", type=int, default=5)
    parser.add_argument("--itl-requests", type=int, default=8, help="text-only requests decoding")
    parser.add_argument("--itl-images", type=int, default=4, help="image requests arriving while they decode")
    parser.add_argument("--itl-every", type=int, default=32, help="decode steps between image arrivals")
    parser.add_argument("--itl-max-tokens", type=int, default=3072, help="text requests' output cap")
    parser.add_argument("--chunked-prefill-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of this process (the LLM's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 images x 2 rounds, 3 TTFT trials, 2 ITL images")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds, args.ttft_trials, args.itl_images = 12, 2, 3, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-encoder-") as tmp:
        path = args.model or Path(tmp) / "model"
        if not (path / "config.json").is_file():
            build_checkpoint(path, args.seed)
        print(
            f"model {path}: {describe_tower(path)}; float32, {torch.get_num_threads()} torch threads in this "
            f"process, {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.2f} at start"
        )

        items = throughput_items(path, args.images, args.seed)
        patches = [item.num_patches for item in items]
        print(
            f"\n[1] encode throughput: {len(items)} images, {min(patches)}..{max(patches)} patches "
            f"(mean {statistics.mean(patches):.0f}), all in one submit, fastest of {args.rounds} rounds"
        )
        settings = measure_throughput(path, items, args.rounds)

        side = f"{LARGE_IMAGE}x{LARGE_IMAGE}"
        print(f"\n[2] TTFT of a {side} PNG, engine defaults (vit_dp=1), medians of {args.ttft_trials}")
        ttft = measure_ttft(path, args.ttft_trials, args.seed)
        print_media_timings(ttft)

        print(
            f"\n[3] decode ITL: {args.itl_requests} text requests; a {side} image request every "
            f"{args.itl_every} decode steps after {WARMUP_STEPS}, {args.itl_images} in all; chunked prefill "
            f"{args.chunked_prefill_size}"
        )
        decode_runs = []
        for vit_dp in (1, 0):
            decode_runs.append(measure_decode_latency(path, vit_dp, args))
            print_decode_run(decode_runs[-1])
        print(f"\n[4] the same through the server with --tp-size 2 --ep-size 2 (streamed; {args.itl_requests} streams)")
        server_runs = []
        for vit_dp in (2, 0):
            server_runs.append(measure_server_decode_latency(path, vit_dp, args))
            print_decode_run(server_runs[-1])

    total_patches = sum(patches)
    rates = {s.label: s.rate(len(items)) for s in settings}
    outside = {s.label: (s.best.seconds - s.best.vit_seconds) / len(items) for s in settings}
    pool, inline = (latency_stats(run.window) for run in decode_runs)
    print("\nsummary")
    for s in settings:
        print(
            f"  {s.label:<28}{s.rate(len(items)):7.2f} images/s {s.rate(total_patches):9.0f} patches/s "
            f"{s.cores:6.2f} cores busy"
        )
    dp1, dp2 = rates["pool dp1 x 1 thread"], rates["pool dp2 x 1 thread"]
    print(f"  {'dp2 / dp1 (1 thread)':<28}{dp2 / dp1:7.2f}x (target >= 1.7x)")
    print(f"  {'dp2 / dp1 (2 threads)':<28}{dp2 / rates['pool dp1 x 2 threads']:7.2f}x")
    print(f"  {'dp1 pool / in-process':<28}{dp1 / rates['in-process, 1 thread']:7.2f}x")
    print(
        f"  {'time outside the tower':<28}{1000 * outside['pool dp1 x 1 thread']:7.1f} ms per image with the dp1 pool, "
        f"{1000 * outside['in-process, 1 thread']:.1f} ms in-process (the difference is the IPC overhead)"
    )
    uncached = ttft.median("uncached")
    print(f"  {'TTFT uncached image':<28}{1000 * uncached:7.1f} ms")
    for kind in ("cached", "repeated"):
        median = ttft.median(kind)
        target = " (target <= 0.2x)" if kind == "cached" else ""
        print(f"  {'TTFT ' + kind + ' image':<28}{1000 * median:7.1f} ms = {median / uncached:.3f}x uncached{target}")
    for run, stats in zip(decode_runs, (pool, inline)):
        figures = ", ".join(f"{name} {value:.1f}" for name, value in stats.items())
        before = latency_stats(run.baseline)["p50"]
        print(f"  {'ITL ' + run.label:<28}{figures} ms (before the images: p50 {before:.1f} ms)")
    print(f"  {'ITL inline / pool':<28}p99 {inline['p99'] / pool['p99']:.2f}x, max {inline['max'] / pool['max']:.2f}x")
    for run in (decode_runs[0], server_runs[0]):
        p99, idle = latency_stats(run.window)["p99"], latency_stats(run.baseline)["p99"]
        print(f"  {'ITL p99 ' + run.label:<28}{p99:.1f} ms = {p99 / idle:.2f}x idle p99 {idle:.1f} ms (target <= 1.2x)")
    tp_pool, tp_inline = (latency_stats(run.window) for run in server_runs)
    print(
        f"  {'TP2 ITL inline / pool':<28}p99 {tp_inline['p99'] / tp_pool['p99']:.2f}x, max {tp_inline['max'] / tp_pool['max']:.2f}x"
    )
    print(f"  {'total run time':<28}{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
