"""The prefix cache's tiers on a multi-turn workload with pictures: `vlm-serve serve` with tiers off, with the
host tier (L2) and with the host and file storage tiers (L2+L3), side by side, then the restart case.

Workload (the same for every configuration, `--seed`): `--conversations` conversations of `--turns` turns;
each turn adds a picture (a built-in scene of `--image-size`) and a question to the conversation so far (its
earlier answers included), asking for `--output-len` tokens. Every conversation is open at once and at
most `--concurrency` requests are in flight, so the turns cycle through all conversations: by the time a
conversation's next turn comes, the others have passed through the KV pool. The KV pool is
`--max-total-tokens` (default: a fifth of the workload's prefixes, so that they are 4-8x the pool), pages
of 16 tokens (the storage tier's minimum) in every configuration; the host tier is `--hicache-ratio` times
the pool.

Per configuration: TTFT mean and p99, requests and output tokens per second, the prefix cache's hit rate
(prompt tokens cached / all, from /metrics) and the tokens each tier served. The restart case: a server
started again on the L2+L3 run's storage answers the last turn of the first `--restart-requests`
conversations one at a time (their whole history is a prefix in storage), against a server on an empty
storage directory: TTFT of each, warm vs cold.

    python benchmarks/bench_hicache.py
    python benchmarks/bench_hicache.py --conversations 32 --turns 4 --image-size 448 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_serving import launched_server  # noqa: E402
from cpu_isa import describe_cpu  # noqa: E402

from vlm_serve.builtin.scenes import random_scene, render  # noqa: E402

QUESTIONS = ("Describe this picture.", "What shapes are here?", "What colour is the circle?", "Where is the square?")
PAGE_SIZE = 16
SAMPLE = re.compile(r'^vlm_serve:(\w+)(?:\{(\w+)="([^"]*)"\})? (\S+)$')


@dataclass
class Turn:
    ttft: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class Conversation:
    pictures: list[str]
    messages: list[dict] = field(default_factory=list)


def picture_url(seed: int, size: int) -> str:
    scene = dataclasses.replace(random_scene(random.Random(seed)), width=size, height=size)
    buffer = io.BytesIO()
    render(scene).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user_turn(picture: str, turn: int) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": picture}},
            {"type": "text", "text": QUESTIONS[turn % 4]},
        ],
    }


async def ask(client: httpx.AsyncClient, messages: list[dict], output_len: int) -> tuple[Turn, str]:
    payload = {
        "model": "default",
        "messages": messages,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, text, usage = 0.0, [], {}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    ttft = ttft or time.perf_counter() - start
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    turn = Turn(
        ttft,
        time.perf_counter() - start,
        usage["prompt_tokens"],
        details.get("cached_tokens", 0),
        usage["completion_tokens"],
    )
    return turn, "".join(text)


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's counters: `name` or `name/label` -> value."""
    out = {}
    for line in (await client.get("/metrics")).text.splitlines():
        match = SAMPLE.match(line)
        if match:
            name, _, label, value = match.groups()
            out[name + (f"/{label}" if label else "")] = float(value)
    return out


async def run_workload(url: str, conversations: list[Conversation], args: argparse.Namespace) -> dict:
    gate = asyncio.Semaphore(args.concurrency)
    turns: list[Turn] = []
    working_set = 0

    async def converse(client: httpx.AsyncClient, conversation: Conversation) -> None:
        nonlocal working_set
        conversation.messages = []
        for t, picture in enumerate(conversation.pictures):
            conversation.messages.append(user_turn(picture, t))
            async with gate:
                turn, answer = await ask(client, conversation.messages, args.output_len)
            turns.append(turn)
            conversation.messages.append({"role": "assistant", "content": answer})
        working_set += turn.prompt_tokens + turn.output_tokens

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        before = await metrics(client)
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, c) for c in conversations))
        duration = time.perf_counter() - start
        after = await metrics(client)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    cached, computed = delta.get("prompt_tokens_cached_total", 0), delta.get("prompt_tokens_computed_total", 0)
    ttfts = sorted(t.ttft for t in turns)
    return {
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "requests_per_s": len(turns) / duration,
        "output_tokens_per_s": sum(t.output_tokens for t in turns) / duration,
        "hit_rate": cached / (cached + computed) if cached + computed else 0.0,
        "tier_hits": {k.split("/")[1]: v for k, v in delta.items() if k.startswith("hicache_hit_tokens_total/")},
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "vit_items": delta.get("vit_items_total", 0),
        "working_set": working_set,
    }


async def restart_ttfts(url: str, requests: list[list[dict]], output_len: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return [(await ask(client, messages, output_len))[0].ttft for messages in requests]


def server_args(args: argparse.Namespace, pool: int, tiers: list[str]) -> str:
    common = f"--page-size {PAGE_SIZE} --max-total-tokens {pool} --max-running-requests {args.concurrency}"
    return " ".join([common, args.server_args, *tiers])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-total-tokens", type=int, default=None, help="the KV pool (default: see above)")
    parser.add_argument("--hicache-ratio", type=float, default=4.0)
    parser.add_argument("--restart-requests", type=int, default=8)
    parser.add_argument("--server-args", default="", help="more `vlm-serve serve` flags for every server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    cpu, isa = describe_cpu()
    conversations = [
        Conversation([picture_url(args.seed * 100_000 + c * 100 + t, args.image_size) for t in range(args.turns)])
        for c in range(args.conversations)
    ]
    # the workload's prefixes, estimated for the default pool: the built-in model sees a picture as 64 tokens
    estimate = args.conversations * args.turns * (64 + 30 + args.output_len)
    pool = args.max_total_tokens or max(PAGE_SIZE * 64, estimate // 5 // PAGE_SIZE * PAGE_SIZE)
    storage = Path(tempfile.mkdtemp(prefix="bench-hicache-"))
    host = ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
    file_tier = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(storage)]
    configs = {"tiers off": [], "L2 (host)": host, "L2+L3 (file)": host + file_tier}
    results = {}
    for name, tiers in configs.items():
        with launched_server(server_args(args, pool, tiers), 300) as url:
            results[name] = asyncio.run(run_workload(url, conversations, args))
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr)
    # (measured: every conversation's whole last prompt and answer)
    working_set = results["tiers off"]["working_set"]
    last_turns = [c.messages[:-1] for c in conversations[: args.restart_requests]]
    with launched_server(server_args(args, pool, host + file_tier), 300) as url:
        warm = asyncio.run(restart_ttfts(url, last_turns, args.output_len))
    cold_dir = ["--hicache-storage-backend", "file", "--hicache-storage-dir", tempfile.mkdtemp(prefix="bench-cold-")]
    with launched_server(server_args(args, pool, host + cold_dir), 300) as url:
        cold = asyncio.run(restart_ttfts(url, last_turns, args.output_len))

    print(f"\nCPU: {cpu} ({isa}); built-in model unless --server-args names one")
    print(
        f"{args.conversations} conversations x {args.turns} turns, one {args.image_size}x{args.image_size} picture per"
        f" turn, {args.output_len} output tokens, {args.concurrency} in flight; KV pool {pool} tokens (pages of"
        f" {PAGE_SIZE}), the workload's prefixes ~{working_set} tokens ({working_set / pool:.1f}x the pool);"
        f" host tier {args.hicache_ratio:g}x the pool\n"
    )
    header = f"{'':<14}{'TTFT mean':>11}{'TTFT p99':>11}{'req/s':>8}{'out tok/s':>11}{'hit rate':>10}  tokens per tier"
    print(header)
    base = results["tiers off"]
    for name, r in results.items():
        hits = ", ".join(f"{k} {int(v)}" for k, v in r["tier_hits"].items()) or "-"
        print(
            f"{name:<14}{r['ttft_mean_ms']:>9.0f}ms{r['ttft_p99_ms']:>9.0f}ms{r['requests_per_s']:>8.2f}"
            f"{r['output_tokens_per_s']:>11.1f}{r['hit_rate']:>10.2f}  {hits}"
        )
    for name, r in results.items():
        if name != "tiers off":
            print(
                f"{name} vs tiers off: TTFT mean x{r['ttft_mean_ms'] / base['ttft_mean_ms']:.2f}, "
                f"throughput x{r['requests_per_s'] / base['requests_per_s']:.2f}"
            )
    print(
        f"\nrestart, the last turn of {len(last_turns)} conversations one at a time: TTFT with warm storage "
        f"{1000 * statistics.mean(warm):.0f} ms, cold {1000 * statistics.mean(cold):.0f} ms "
        f"(x{statistics.mean(warm) / statistics.mean(cold):.2f})"
    )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"cpu": cpu, "isa": isa, "pool": pool, "results": results, "warm": warm, "cold": cold}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
