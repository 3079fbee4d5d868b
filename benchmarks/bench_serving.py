"""Online serving benchmark: an OpenAI-API load generator for `vlm-serve serve` (or any server that
speaks `/v1/chat/completions` with image and video parts, such as `vllm serve`), in the spirit of
SGLang's `bench_serving` and vLLM's `benchmark_serving`.

Point it at a running server with `--base-url`, or let it start one with `--launch`: `vlm-serve
serve` on a free port with the flags of `--server-args` (write `--server-args='--vit-dp 2'`, with the
`=`, as argparse takes a lone `--flag` value for an option), waiting for its "serving ... on" line
and stopping it with SIGTERM at the end.

Workload (reproducible with `--seed`, the same requests for every server): `--num-prompts` chat
requests, each `--images-per-request` random-noise PNG images (sizes drawn from `--image-size`,
encoded once per distinct image), `--videos-per-request` videos and `--input-len` random words,
asking for exactly `--output-len` tokens (`max_tokens` with `ignore_eos`, so that every server
generates the same lengths). With `--output-len-sigma S` > 0 each request's `max_tokens` is drawn
from a log-normal distribution of median `--output-len` and shape S instead, rounded and clipped to
[1, 8 x `--output-len`]: the long tail of long answers real chat has; `--input-len-sigma` draws each
request's number of words the same way (median `--input-len`). Requests arrive as a Poisson process
at `--request-rate` per second (inf: all at once), at most `--max-concurrency` in flight.

A video is a `--video-frames`-frame MP4 of `--video-size` at `--video-fps` frames per second: a few
coloured rectangles moving over a gradient (small and quick to decode, unlike noise), encoded with
H.264 (or MPEG-4 Part 2 where this PyAV build has no H.264 encoder) and sent as a `data:video/mp4`
`video_url` part.

`--repeat-image-ratio` of the requests take their media, images and videos alike, from a pool of
`--image-pool-size` images and as many videos instead of fresh ones; each pool item is sent once
before the timed run (an untimed warm-up), so that reusing it measures the multimodal caches. The
media come before the text unless `--text-first`. An image whose tokens the prefix cache already
holds needs no embedding, so it is not looked up in the embedding cache: with the images first, a
repeated image is a processor cache hit and a prefix cache hit but no embedding cache lookup; with
`--text-first` (a distinct prefix in front of it), or a server started with
`--disable-radix-cache`, it is an embedding cache hit. Videos behave the same way.

Every request streams (SSE). Per request: TTFT (time to the first content chunk), ITL (gaps between
content chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency; token counts come from
the final usage chunk (image and video tokens from our server's `prompt_tokens_details.media`; 0 from
servers without it). The report gives the workload's settings and drawn lengths, throughputs, mean /
median / p99 of each latency, and the cache hit rates from the deltas of the server's `/metrics`
counters over the timed run: vision embedding cache, processor (preprocessed image) cache and prefix
cache (prompt tokens cached vs computed). `--output-json FILE` also writes the summary, the settings
and every request's numbers.

`--json-schema SCHEMA` (a JSON file or inline JSON) measures what structured output costs: the same
workload runs twice, plain and then with `response_format` of that schema, each after a cache flush
and the same warm-up, and the report ends with both output throughputs and their ratio. With
`ignore_eos` an answer still ends where its schema is complete: `benchmarks/caption_schema.json` (a
caption of at least 2000 characters) keeps the answers as long as the plain ones.

    python benchmarks/bench_serving.py --launch --num-prompts 40 --image-size 224x224 \\
        --repeat-image-ratio 0.5 --output-len 16 --max-concurrency 8
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 200 \\
        --image-size 448x448,896x672 --request-rate 4 --output-json result.json
    python benchmarks/bench_serving.py --launch --images-per-request 0 --input-len 256 \\
        --input-len-sigma 0.5 --output-len 128 --output-len-sigma 0.8 --max-concurrency 16
    python benchmarks/bench_serving.py --launch --images-per-request 0 --videos-per-request 1 \\
        --video-frames 16 --video-size 448x448 --video-fps 2 --num-prompts 16 --max-concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import math
import queue
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

import av
import httpx
import numpy as np
from PIL import Image

READY_LINE = re.compile(r"vlm-serve: serving (\S+) on (http://\S+)")
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are be have one "
    "had not but what all were when we there can an your their said if do will each about how up out "
    "them then she many some so these would other into has more two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know get through back much before go good new write our "
    "used me man too any day same right look think also around another came come work three word must "
    "because does part even place well such here take why things help put years different away again "
    "off went old number great tell men say small every found still between name should home big give "
    "air line set own under read last never us left end along while might next sound below saw something"
).split()
COUNTERS = {
    "embedding_hits": "vlm_serve:embedding_cache_hits_total",
    "embedding_misses": "vlm_serve:embedding_cache_misses_total",
    "processor_hits": "vlm_serve:processor_cache_hits_total",
    "processor_misses": "vlm_serve:processor_cache_misses_total",
    "prompt_cached": "vlm_serve:prompt_tokens_cached_total",
    "prompt_computed": "vlm_serve:prompt_tokens_computed_total",
}


# ---- workload ---------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt: str
    images: list[str]  # data: URLs
    videos: list[str]  # data: URLs
    max_tokens: int
    repeated: bool  # media from the shared pools


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0
    video_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_sizes(values: list[str]) -> list[tuple[int, int]]:
    """`["448x448", "224x224,896x672"]` -> [(448, 448), (224, 224), (896, 672)] (width x height)."""
    sizes = []
    for value in values:
        for item in value.split(","):
            match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", item)
            if not match:
                raise argparse.ArgumentTypeError(f"size {item!r} is not WIDTHxHEIGHT")
            sizes.append((int(match[1]), int(match[2])))
    return sizes


def noise_png_url(rng: np.random.Generator, size: tuple[int, int]) -> str:
    width, height = size
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@functools.cache
def video_codec() -> str:
    """H.264 (libx264), which every server decodes, when this PyAV build has it; else MPEG-4 Part 2."""
    try:
        av.codec.Codec("libx264", "w")
    except av.codec.codec.UnknownCodecError:
        return "mpeg4"
    return "libx264"


def moving_boxes(rng: np.random.Generator, num_frames: int, size: tuple[int, int]) -> Iterator[np.ndarray]:
    """RGB frames of three coloured rectangles moving (and wrapping) over a horizontal gradient."""
    width, height = size
    ramp = np.linspace(0.0, 1.0, width)[None, :, None]
    left, right = rng.integers(0, 256, (2, 3))
    background = np.broadcast_to(left * (1 - ramp) + right * ramp, (height, width, 3)).astype(np.uint8)
    boxes = [
        (
            rng.integers(0, 256, 3),
            rng.integers(width // 8, width // 3 + 1),
            rng.integers(height // 8, height // 3 + 1),
            rng.uniform(0, width),
            rng.uniform(0, height),
            rng.uniform(-width / 8, width / 8),
            rng.uniform(-height / 8, height / 8),
        )
        for _ in range(3)
    ]
    for t in range(num_frames):
        frame = background.copy()
        for color, w, h, x, y, dx, dy in boxes:
            left_edge, top_edge = int(x + dx * t) % width, int(y + dy * t) % height
            frame[top_edge : top_edge + h, left_edge : left_edge + w] = color
        yield frame


def random_video_url(rng: np.random.Generator, num_frames: int, size: tuple[int, int], fps: float) -> str:
    """A `data:video/mp4` URL of `moving_boxes` frames (moov atom last: faststart needs a file)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(video_codec(), rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for frame in moving_boxes(rng, num_frames, size):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choices(WORDS, k=num_words))


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float, count: int) -> list[int]:
    """`count` lengths drawn from a log-normal of this median and shape, rounded and clipped to
    [1, 8 x median]; all `median` when sigma is 0."""
    if sigma == 0:
        return [median] * count
    draws = rng.lognormal(math.log(median), sigma, count)
    return np.clip(np.rint(draws), 1, 8 * median).astype(int).tolist()


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The timed requests and the warm-up requests that send each pool image and video once (none
    when no request repeats media)."""
    rng = random.Random(args.seed)
    pixels = np.random.default_rng(args.seed)
    sizes = args.image_size
    new_video = functools.partial(random_video_url, pixels, args.video_frames, args.video_size, args.video_fps)
    has_media = args.images_per_request or args.videos_per_request
    num_repeated = round(args.repeat_image_ratio * args.num_prompts) if has_media else 0
    pool_size = args.image_pool_size if num_repeated else 0
    image_pool = (
        [noise_png_url(pixels, sizes[i % len(sizes)]) for i in range(pool_size)] if args.images_per_request else []
    )
    video_pool = [new_video() for _ in range(pool_size)] if args.videos_per_request else []
    repeated = set(rng.sample(range(args.num_prompts), num_repeated))
    # one generator per length, so that a sigma changes neither the other lengths nor the media and texts
    input_rng, output_rng = (np.random.default_rng((args.seed, stream)) for stream in (1, 2))
    input_lens = lognormal_lengths(input_rng, args.input_len, args.input_len_sigma, args.num_prompts)
    output_lens = lognormal_lengths(output_rng, args.output_len, args.output_len_sigma, args.num_prompts)
    requests = []
    for i, (num_words, max_tokens) in enumerate(zip(input_lens, output_lens, strict=True)):
        if i in repeated:
            images = [rng.choice(image_pool) for _ in range(args.images_per_request)]
            videos = [rng.choice(video_pool) for _ in range(args.videos_per_request)]
        else:
            images = [noise_png_url(pixels, rng.choice(sizes)) for _ in range(args.images_per_request)]
            videos = [new_video() for _ in range(args.videos_per_request)]
        requests.append(BenchRequest(random_text(rng, num_words), images, videos, max_tokens, i in repeated))
    warm_ups = [BenchRequest(f"warm-up image {i}", [url], [], 2, True) for i, url in enumerate(image_pool)]
    warm_ups += [BenchRequest(f"warm-up video {i}", [], [url], 2, True) for i, url in enumerate(video_pool)]
    return requests, warm_ups


# ---- one streamed request ---------------------------------------------------------------------------


def chat_payload(model: str, request: BenchRequest, text_first: bool, schema: dict | None = None) -> dict[str, Any]:
    media: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in request.images]
    media += [{"type": "video_url", "video_url": {"url": url}} for url in request.videos]
    text = [{"type": "text", "text": request.prompt}]
    content = text + media if text_first else media + text
    constrained = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    return (constrained if schema is not None else {}) | {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    details = usage.get("prompt_tokens_details") or {}
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.cached_tokens = details.get("cached_tokens", 0)
    media = details.get("media") or []
    result.image_tokens = sum(m.get("tokens", 0) for m in media if m.get("type") == "image")
    result.video_tokens = sum(m.get("tokens", 0) for m in media if m.get("type") == "video")


async def send_request(
    client: httpx.AsyncClient, model: str, request: BenchRequest, text_first: bool, schema: dict | None = None
) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    done = False
    payload = chat_payload(model, request, text_first, schema)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {chunk['error']}"
                    return result
                now = time.perf_counter()
                if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    read_usage(result, chunk["usage"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    if not done:
        result.error = "the stream ended without [DONE]"
    elif result.output_tokens == 0:
        result.error = "no usage chunk (or no output tokens)"
    elif result.ttft == 0.0:
        result.error = "no content chunk"
    result.success = not result.error
    return result


# ---- the run ----------------------------------------------------------------------------------------


async def fetch_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The `COUNTERS` from `/metrics` (Prometheus text; unlabelled samples only); zeros from a server
    without one (sglang-router serves its own metrics on another port)."""
    resp = await client.get("/metrics")
    if resp.status_code == 404:
        return dict.fromkeys(COUNTERS, 0.0)
    resp.raise_for_status()
    samples = {}
    for line in resp.text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            samples[parts[0]] = float(parts[1])
    return {key: samples.get(name, 0.0) for key, name in COUNTERS.items()}


async def served_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def warm_pools(client: httpx.AsyncClient, model: str, warm_ups: list[BenchRequest], text_first: bool) -> None:
    """Sends the warm-up requests (one per pool item), so that the timed run's reuses can hit the caches."""
    for request in warm_ups:
        result = await send_request(client, model, request, text_first)
        if not result.success:
            raise RuntimeError(f"the warm-up request failed: {result.error}")


def arrival_gaps(rng: random.Random, rate: float, count: int) -> list[float]:
    """Seconds to wait before sending each request (none before the first): Poisson arrivals at
    `rate`/s, or all at once at inf."""
    return [0.0 if i == 0 or math.isinf(rate) else rng.expovariate(rate) for i in range(count)]


async def run_requests(
    client: httpx.AsyncClient, model: str, requests: list[BenchRequest], args: argparse.Namespace, schema: dict | None
) -> tuple[list[RequestResult], float]:
    """Sends every request on schedule; the results in request order and the run's duration."""
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(request: BenchRequest) -> RequestResult:
        async with limit or contextlib.nullcontext():
            return await send_request(client, model, request, args.text_first, schema)

    gaps = arrival_gaps(random.Random(args.seed + 1), args.request_rate, len(requests))
    tasks = []
    start = time.perf_counter()
    for request, gap in zip(requests, gaps, strict=True):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def benchmark(base_url: str, args: argparse.Namespace, schema: dict | None = None) -> dict[str, Any]:
    """One timed run of the workload (answers following `schema` if given)."""
    requests, warm_ups = build_workload(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(args.timeout), limits=limits
    ) as client:
        model = args.model or await served_model(client)
        if args.json_schema is not None:  # both runs start from the same (cold) caches
            (await client.post("/flush_cache")).raise_for_status()
        await warm_pools(client, model, warm_ups, args.text_first)
        before = await fetch_counters(client)
        results, duration = await run_requests(client, model, requests, args, schema)
        after = await fetch_counters(client)
    delta = {key: after[key] - before[key] for key in COUNTERS}
    return summarize(model, requests, results, duration, delta) | {
        "requests": [request_record(q, r) for q, r in zip(requests, results, strict=True)]
    }


# ---- report -----------------------------------------------------------------------------------------


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ms = np.asarray(values_s) * 1000.0
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p99_ms": float(np.percentile(ms, 99))}


def length_stats(values: list[int]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "median": float(np.median(values)), "max": int(max(values))}


def summarize(
    model: str, requests: list[BenchRequest], results: list[RequestResult], duration: float, delta: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model,
        "input_words": length_stats([len(q.prompt.split()) for q in requests]),  # as drawn, all requests
        "requested_output_tokens": length_stats([q.max_tokens for q in requests]),
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_image_tokens": sum(r.image_tokens for r in ok),
        "total_video_tokens": sum(r.video_tokens for r in ok),
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft": latency_stats([r.ttft for r in ok]),
        "tpot": latency_stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e": latency_stats([r.e2e for r in ok]),
        "embedding_cache_hit_rate": ratio(delta["embedding_hits"], delta["embedding_hits"] + delta["embedding_misses"]),
        "processor_cache_hit_rate": ratio(delta["processor_hits"], delta["processor_hits"] + delta["processor_misses"]),
        "prefix_cache_hit_rate": ratio(delta["prompt_cached"], delta["prompt_cached"] + delta["prompt_computed"]),
        "metrics_delta": delta,
        "errors": sorted({r.error for r in results if r.error}),
    }


def request_record(request: BenchRequest, result: RequestResult) -> dict[str, Any]:
    asked = {"input_words": len(request.prompt.split()), "max_tokens": request.max_tokens}
    return {"repeated_media": request.repeated, **asked, **asdict(result), "tpot": result.tpot}


def format_report(summary: dict[str, Any], args: argparse.Namespace) -> str:
    def row(label: str, value: object, fmt: str = "") -> str:
        text = "n/a" if value is None else format(value, fmt)
        return f"{label:<40} {text:>12}"

    lines = [
        f"{' Serving Benchmark Result ':=^53}",
        row("Model:", summary["model"]),
        row("Request rate (req/s):", "inf" if math.isinf(args.request_rate) else args.request_rate),
        row("Max concurrency:", args.max_concurrency or "none"),
        f"{' Workload ':-^53}",
    ]
    for label, median, sigma, drawn in (
        ("Input words", args.input_len, args.input_len_sigma, summary["input_words"]),
        ("Output tokens", args.output_len, args.output_len_sigma, summary["requested_output_tokens"]),
    ):
        lines.append(row(f"{label} (median, sigma):", f"{median}, {sigma:g}"))
        lines.append(row("  drawn (mean, max):", f"{drawn['mean']:.1f}, {drawn['max']}"))
    sizes = ",".join(f"{w}x{h}" for w, h in args.image_size)
    video = f"{args.video_frames} x {args.video_size[0]}x{args.video_size[1]} at {args.video_fps:g} fps"
    lines += [
        row("Images per request (sizes):", f"{args.images_per_request} ({sizes})"),
        row("Videos per request:", f"{args.videos_per_request} ({video})"),
        row("Repeated media (ratio, pool):", f"{args.repeat_image_ratio:g}, {args.image_pool_size}"),
        f"{' Totals and Throughput ':-^53}",
        row("Successful requests:", summary["successful_requests"]),
        row("Failed requests:", summary["failed_requests"]),
        row("Benchmark duration (s):", summary["duration_s"], ".2f"),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("  of which image tokens:", summary["total_image_tokens"]),
        row("  of which video tokens:", summary["total_video_tokens"]),
        row("  of which cached (usage):", summary["total_cached_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Request throughput (req/s):", summary["request_throughput"], ".2f"),
        row("Input token throughput (tok/s):", summary["input_throughput"], ".2f"),
        row("Output token throughput (tok/s):", summary["output_throughput"], ".2f"),
        row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f"),
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2e", "End-to-end Latency"),
    ):
        lines.append(f"{' ' + title + ' ':-^53}")
        name = key.upper()
        for stat, label in (("mean_ms", "Mean"), ("median_ms", "Median"), ("p99_ms", "P99")):
            lines.append(row(f"{label} {name} (ms):", summary[key][stat], ".2f"))
    lines.append(f"{' Cache Hit Rates (/metrics delta) ':-^53}")
    for key, label in (
        ("embedding_cache_hit_rate", "Vision embedding cache:"),
        ("processor_cache_hit_rate", "Processor cache:"),
        ("prefix_cache_hit_rate", "Prefix cache (prompt tokens):"),
    ):
        lines.append(row(label, summary[key], ".1%"))
    if "json_schema_cost" in summary:
        cost = summary["json_schema_cost"]
        lines.append(f"{' Structured output (--json-schema) ':-^53}")
        lines.append(row("Output tok/s without the schema:", cost["plain_output_throughput"], ".2f"))
        lines.append(row("Output tok/s with the schema:", cost["schema_output_throughput"], ".2f"))
        lines.append(row("Ratio (with / without):", cost["ratio"], ".3f"))
    lines.append("=" * 53)
    return "\n".join(lines)


# ---- server ----------------------------------------------------------------------------------------


def forward_output(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Hands the server's stdout lines to `lines` (None at its end) and echoes them to stderr."""
    for line in stream:
        sys.stderr.write(f"[server] {line}")
        lines.put(line)
    lines.put(None)


@contextlib.contextmanager
def launched_server(server_args: str, startup_timeout: float) -> Iterator[str]:
    """Starts `vlm-serve serve` on a free port (`--port` in `server_args` wins); yields its URL."""
    cmd = [sys.executable, "-m", "vlm_serve.cli", "serve", "--port", "0", *shlex.split(server_args)]
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=forward_output, args=(proc.stdout, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the server was not ready after {startup_timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the server exited during start-up (status {proc.wait()})")
            match = READY_LINE.search(line)
            if match:
                yield match[2].replace("//0.0.0.0:", "//127.0.0.1:")
                return
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="URL of a running server, e.g. http://127.0.0.1:30000")
    target.add_argument("--launch", action="store_true", help="start `vlm-serve serve` on a free port, stop it after")
    add("--server-args", default="", help="flags for the launched server, e.g. --server-args='--vit-dp 2'")
    add("--startup-timeout", type=float, default=600.0, help="seconds to wait for the launched server (600)")
    add("--model", default=None, help="model name to send (default: the first one of /v1/models)")
    add("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add("--num-prompts", type=int, default=40, help="timed requests (40)")
    add("--image-size", action="append", default=None, help="WIDTHxHEIGHT, repeatable or a comma list (448x448)")
    add("--images-per-request", type=int, default=1, help="images in each request (1)")
    add("--videos-per-request", type=int, default=0, help="videos in each request (0)")
    add("--video-frames", type=int, default=16, help="frames of each video (16)")
    add("--video-size", default="448x448", help="WIDTHxHEIGHT of the videos, both even (448x448)")
    add("--video-fps", type=float, default=2.0, help="frame rate of the videos (2)")
    add("--repeat-image-ratio", type=float, default=0.0, help="share of requests with pool images and videos (0)")
    add("--image-pool-size", type=int, default=4, help="distinct images, and distinct videos, in the pools (4)")
    add("--input-len", type=int, default=64, help="random words of text per request, about a token each (64)")
    add("--input-len-sigma", type=float, default=0.0, help="log-normal shape of --input-len; 0: all equal (0)")
    add("--text-first", action="store_true", help="put the text before the images and videos")
    add("--output-len", type=int, default=32, help="tokens to generate per request, EOS ignored (32)")
    add("--output-len-sigma", type=float, default=0.0, help="log-normal shape of --output-len; 0: all equal (0)")
    add("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    add("--max-concurrency", type=int, default=None, help="requests in flight at most (no limit)")
    add("--timeout", type=float, default=600.0, help="seconds per request (600)")
    add("--seed", type=int, default=0, help="seeds the media, texts, lengths, repeats and arrivals (0)")
    add("--output-json", default=None, help="also write the summary, settings and per-request numbers here")
    add("--json-schema", default=None, help="run plain and then with this response_format schema (file or JSON)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.image_size = parse_sizes(args.image_size or ["448x448"])
    args.video_size, *more = parse_sizes([args.video_size])
    if more or args.video_size[0] % 2 or args.video_size[1] % 2:
        parser.error("--video-size must be one WIDTHxHEIGHT with even sides (the videos are yuv420p)")
    if args.num_prompts < 1 or args.images_per_request < 0 or args.input_len < 0 or args.output_len < 1:
        parser.error("need --num-prompts >= 1, --output-len >= 1, --images-per-request >= 0, --input-len >= 0")
    if args.videos_per_request < 0 or args.video_frames < 1 or not 0 < args.video_fps < math.inf:
        parser.error("need --videos-per-request >= 0, --video-frames >= 1 and a finite --video-fps > 0")
    if not (0 <= args.input_len_sigma < math.inf and 0 <= args.output_len_sigma < math.inf):
        parser.error("--input-len-sigma and --output-len-sigma must be finite and >= 0")
    if args.input_len_sigma and args.input_len < 1:
        parser.error("--input-len-sigma needs --input-len >= 1 (the median of the drawn lengths)")
    if not 0.0 <= args.repeat_image_ratio <= 1.0:
        parser.error("--repeat-image-ratio must be within [0, 1]")
    if args.image_pool_size < 1 or args.request_rate <= 0 or (args.max_concurrency or 1) < 1:
        parser.error("--image-pool-size, --request-rate and --max-concurrency must be positive")
    if args.json_schema is not None:
        text = args.json_schema
        try:
            args.json_schema = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"--json-schema: {exc}")


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    try:
        check_args(parser, args)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    try:
        with contextlib.ExitStack() as stack:
            base_url = args.base_url
            if args.launch:
                base_url = stack.enter_context(launched_server(args.server_args, args.startup_timeout))
            summary = asyncio.run(benchmark(base_url.rstrip("/"), args))
            if args.json_schema is not None:
                print(format_report(summary, args))
                plain, summary = summary, asyncio.run(benchmark(base_url.rstrip("/"), args, args.json_schema))
                summary["json_schema_cost"] = {
                    "plain_output_throughput": plain["output_throughput"],
                    "schema_output_throughput": summary["output_throughput"],
                    "ratio": ratio(summary["output_throughput"], plain["output_throughput"]),
                }
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(summary, args))
    for error in summary["errors"][:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.output_json:
        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        settings["video_codec"] = video_codec() if args.videos_per_request else None
        settings["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
        with open(args.output_json, "w") as f:
            json.dump({"settings": settings} | summary, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
