"""Prefill/decode disaggregation against one colocated server on the same cores: does decoding stall
while long image prompts are prefilled?

Two set-ups serve the same `--model`, one after the other (`--rounds` alternating rounds):
  colocated  one `vlm-serve serve` on every core (its encoder pool of one beside the scheduler: the
             defaults)
  pd         sglang-router in PD mode in front of a prefill server on the first half of the cores (the
             vision tower in its scheduler: --vit-dp 0) and a decode server on the other half, the KV
             moving through Mooncake's transfer engine over TCP on loopback

Each gets the same mixed load (bench_serving.py's workloads, two at once through its client):
  decoders   text requests of 64 words answering --decode-len tokens, --decoders in flight throughout
  images     fresh --image-size images with 16 words answering 8 tokens, arriving as a Poisson process
             at --image-rate per second while the decoders decode

Printed per set-up: the decoders' TPOT and ITL (median, p99) and output tok/s, the images' TTFT (median,
p99), the ratios pd / colocated, and the KV the prefill server sent (bytes, and the mean time from a
prompt's first KV page sent to the end of its transfer, as its /metrics count them; bench_kv_transfer.py
measures the bare transfer rate). Each set-up first gets an untimed load like it, with other texts and
images. The CPU and its ISA are printed with the figures.

    python benchmarks/bench_pd.py --model /tmp/small-moe [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
from bench_serving import benchmark, build_parser, check_args
from compare_peer import Server, free_port, our_server, running
from cpu_isa import describe_cpu

from vlm_serve.testing.deployments import router_command

CORES = sorted(os.sched_getaffinity(0))


def on_cores(server: Server, cores: list[int]) -> Server:
    """`server` pinned to `cores` (so that each set-up uses the same cores in all)."""
    pinned = ["taskset", "-c", ",".join(map(str, cores)), *server.command]
    return Server(server.name, pinned, server.env, server.url)


@contextlib.contextmanager
def colocated(model: Path, name: str, logs: Path, timeout: float) -> Iterator[tuple[str, list[str]]]:
    """One server on every core: its URL, and the URLs whose /metrics count KV transfers (none)."""
    server = on_cores(our_server(model, name, "", "native"), CORES)
    with running(server, logs / "colocated.log", timeout):
        yield server.url, []


@contextlib.contextmanager
def disaggregated(model: Path, name: str, logs: Path, timeout: float) -> Iterator[tuple[str, list[str]]]:
    """A prefill and a decode server on half the cores each, behind sglang-router in PD mode: the
    router's URL, and the two servers' URLs."""
    half = max(1, len(CORES) // 2)
    bootstrap = str(free_port())
    prefill_flags = f"--disaggregation-mode prefill --disaggregation-bootstrap-port {bootstrap} --vit-dp 0"
    prefill = on_cores(our_server(model, name, prefill_flags, "native"), CORES[:half])
    decode = on_cores(our_server(model, name, "--disaggregation-mode decode", "native"), CORES[half:] or CORES)
    port = free_port()
    router = Server(
        "router",
        router_command(port, "--pd-disaggregation", "--prefill", prefill.url, bootstrap, "--decode", decode.url),
        {},
        f"http://127.0.0.1:{port}",
    )
    with (
        running(prefill, logs / "prefill.log", timeout),
        running(decode, logs / "decode.log", timeout),
        running(router, logs / "router.log", timeout),
    ):
        yield router.url, [prefill.url, decode.url]


def workload(flags: str) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(["--base-url", "unused", *flags.split()])
    check_args(parser, args)
    return args


async def mixed_load(url: str, args: argparse.Namespace, seed: int) -> dict[str, dict]:
    """The decoders and the images at once, through bench_serving's client: each one's summary. Another
    `seed` draws other texts and images (none in the caches)."""
    decoders = workload(
        f"--images-per-request 0 --input-len 64 --output-len {args.decode_len} --num-prompts {2 * args.decoders} "
        f"--max-concurrency {args.decoders} --seed {seed}"
    )
    images = workload(
        f"--image-size {args.image_size} --input-len 16 --output-len 8 --num-prompts {args.images} "
        f"--request-rate {args.image_rate} --seed {seed + 1}"
    )
    summaries = await asyncio.gather(benchmark(url, decoders), benchmark(url, images))
    return dict(zip(("decoders", "images"), summaries))


def transferred(prefill_url: str) -> tuple[float, float, float]:
    """KV bytes, transfers and their seconds, as the prefill server's /metrics count them so far."""
    text = httpx.get(prefill_url + "/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line and line[0] != "#"}
    names = ("kv_transfer_bytes_total", "kv_transfer_seconds_count", "kv_transfer_seconds_sum")
    return tuple(values.get(f"vlm_serve:{name}", 0.0) for name in names)


FIGURES = {  # name -> (workload, the summary's value)
    "decode TPOT mean (ms)": ("decoders", lambda s: s["tpot"]["mean_ms"]),
    "decode ITL median (ms)": ("decoders", lambda s: s["itl"]["median_ms"]),
    "decode ITL p99 (ms)": ("decoders", lambda s: s["itl"]["p99_ms"]),
    "decode output tok/s": ("decoders", lambda s: s["output_throughput"]),
    "image TTFT median (ms)": ("images", lambda s: s["ttft"]["median_ms"]),
    "image TTFT p99 (ms)": ("images", lambda s: s["ttft"]["p99_ms"]),
    "failed requests": (None, None),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint directory both set-ups serve")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; figures are medians (2)")
    parser.add_argument("--decoders", type=int, default=4, help="text requests decoding at once (4)")
    parser.add_argument("--decode-len", type=int, default=256, help="tokens each decoder answers (256)")
    parser.add_argument("--images", type=int, default=8, help="image requests (8)")
    parser.add_argument("--image-size", default="896x896", help="WIDTHxHEIGHT of the images (896x896)")
    parser.add_argument("--image-rate", type=float, default=0.5, help="image requests per second (0.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_pd"), help="servers' output (/tmp/bench_pd)")
    args = parser.parse_args()
    if len(CORES) < 2:
        parser.error("PD needs two cores at least (one for each side)")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    setups = {"colocated": colocated, "pd": disaggregated}
    figures: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in setups}
    kv: list[tuple[float, ...]] = []  # (bytes, transfers, seconds) per timed PD run
    for round_ in range(args.rounds):
        for name in list(setups) if round_ % 2 == 0 else list(setups)[::-1]:
            print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            with setups[name](args.model, args.model.name, args.log_dir, args.startup_timeout) as (url, servers):
                asyncio.run(mixed_load(url, args, args.seed + 1000))  # (warm-up: a load like it, untimed)
                before = transferred(servers[0]) if servers else None
                summaries = asyncio.run(mixed_load(url, args, args.seed))
                if servers:
                    kv.append(tuple(b - a for a, b in zip(before, transferred(servers[0]))))
            for figure, (load, value) in FIGURES.items():
                if load is None:
                    figures[name][figure].append(sum(s["failed_requests"] for s in summaries.values()))
                else:
                    figures[name][figure].append(value(summaries[load]))
            print("  " + ", ".join(f"{f} {v[-1]:.1f}" for f, v in figures[name].items()), file=sys.stderr)
    model, isa = describe_cpu()
    print(
        f"\nCPU: {model}, {len(CORES)} cores, {isa}; model {args.model.name}; {args.decoders} decoders x {args.decode_len} tokens while "
        f"{args.images} {args.image_size} images arrive at {args.image_rate}/s; medians of {args.rounds} rounds\n"
    )
    print("| figure | colocated | PD (router + prefill + decode) | PD / colocated |")
    print("|---|---|---|---|")
    for figure in FIGURES:
        ours, pd = (statistics.median(figures[name][figure]) for name in setups)
        print(
            f"| {figure} | {ours:.1f} | {pd:.1f} | {pd / ours:.2f}x |"
            if ours
            else f"| {figure} | {ours:.0f} | {pd:.0f} | |"
        )
    nbytes, count, seconds = (sum(x) for x in zip(*kv))
    print(
        f"\nKV moved by PD in the timed runs: {nbytes / 2**20:.1f} MiB in {count:.0f} transfers, "
        f"{1000 * seconds / max(count, 1):.0f} ms each on average from a prompt's first KV page sent to the end "
        "of its transfer (its later chunks computed meanwhile; bench_kv_transfer.py measures the bare rate)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
