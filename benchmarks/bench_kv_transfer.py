"""KV transfer rate between a prefill rank and a decode rank through Mooncake's transfer engine (TCP), two
processes on this machine's loopback, as the PD servers move a prompt's KV.

The KV is that of `--tokens` (4096) prompt tokens of a tiny-model preset's text decoder (`--size small`:
8 layers, 2 KV heads, head_dim 64, float32, so 2 x 8 x 2 x 64 x 4 B = 8 KiB per token and 32 MiB per
4k-token prompt), in real `TokenToKVPool`s with the metadata buffers the servers register. Each round
sends it as the prefill scheduler does, chunk by chunk (`--chunk` tokens, chunked prefill's size on CPU)
then the record with the last chunk, and is timed from the first `send` until the sender reports
SUCCESS (the decode side has been told that every byte arrived). Two slot patterns:
- contiguous: both pools hand out consecutive slots (a fresh server), so each chunk is one write per
  KV buffer (16 pieces);
- scattered pages: `--page-size` (16) token pages in random order on both sides (a busy server), so
  each page is a write per buffer unless neighbours happen to be consecutive on both sides.

Prints the rate of the fastest of `--rounds` rounds and the median, in GB/s (10^9 bytes per second).

    python benchmarks/bench_kv_transfer.py [--tokens 4096] [--size small] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from multiprocessing.connection import Connection

import torch

from vlm_serve.disaggregation.bootstrap import BootstrapServer
from vlm_serve.disaggregation.mooncake import MooncakeBackend
from vlm_serve.disaggregation.transfer import KVLayout, KVPoll
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, TokenToKVPool
from vlm_serve.messages.backend import BootstrapInfo
from vlm_serve.testing.tiny_model import SIZES

HOST = "127.0.0.1"
META_SLOTS, META_BYTES = 4, 4096


def rank(
    mode: str, size: str, tokens: int, page_size: int, bootstrap_port: int | None
) -> tuple[TokenToKVPool, MooncakeBackend]:
    """A rank's KV pool (room for the prompt and a page in front) and its Mooncake backend."""
    text = SIZES[size].dense
    layout = KVPoolLayout(text.layers, text.kv_heads, text.head_dim, page_size, torch.float32)
    pool = TokenToKVPool(tokens, layout, torch.device("cpu"))
    meta = torch.zeros(META_SLOTS, META_BYTES, dtype=torch.uint8)
    bootstrap = None if bootstrap_port is None else (HOST, bootstrap_port)
    backend = MooncakeBackend(mode, 0, 1, HOST, KVLayout.of(pool, meta), bootstrap)
    backend.keep = (pool, meta)  # (the layout holds their addresses only)
    return pool, backend


def slots(tokens: int, page_size: int, scattered: bool, seed: int) -> list[int]:
    pages = list(range(1, tokens // page_size + 1))  # (page 0 holds the dummy slot)
    if scattered:
        random.Random(seed).shuffle(pages)
    return [page * page_size + i for page in pages for i in range(page_size)]


def wait(transfer: object, passing: set[KVPoll]) -> KVPoll:
    while (state := transfer.poll()) in passing:
        time.sleep(0.001)
    return state


def decode_main(conn: Connection, size: str, tokens: int, page_size: int) -> None:
    """The decode rank: for each (room, slots, bootstrap port) it is sent, pre-allocates and waits."""
    _, backend = rank("decode", size, tokens, page_size, None)
    while (job := conn.recv()) is not None:
        room, dst, port = job
        receiver = backend.receiver(BootstrapInfo(HOST, port, room))
        wait(receiver, {KVPoll.BOOTSTRAPPING})
        receiver.init(dst, 0)
        conn.send(wait(receiver, {KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING}).name)
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    text = SIZES[args.size].dense
    per_token = KVPoolLayout(text.layers, text.kv_heads, text.head_dim, 1, torch.float32).bytes_per_token
    total = per_token * args.tokens
    print(
        f"KV of a {args.tokens}-token prompt, {args.size} preset ({text.layers} layers, {text.kv_heads} KV heads, "
        f"head_dim {text.head_dim}, float32): {per_token // 1024} KiB/token, {total / 2**20:.1f} MiB; Mooncake TCP "
        f"on loopback, {torch.get_num_threads()} cores; chunks of {args.chunk} tokens"
    )
    context = mp.get_context("spawn")
    with BootstrapServer(HOST, 0) as server:
        conn, child = context.Pipe()
        decode = context.Process(target=decode_main, args=(child, args.size, args.tokens, args.page_size), daemon=True)
        decode.start()
        _, prefill = rank("prefill", args.size, args.tokens, args.page_size, server.port)
        try:
            for name, scattered in (("contiguous", False), (f"scattered {args.page_size}-token pages", True)):
                rates = []
                for r in range(args.rounds + 1):  # (round 0 warms the connection up, untimed)
                    room = f"{name}-{r}/0"
                    src, dst = (slots(args.tokens, args.page_size, scattered, seed) for seed in (2 * r, 2 * r + 1))
                    conn.send((room, dst, server.port))
                    sender = prefill.sender(BootstrapInfo(HOST, server.port, room))
                    wait(sender, {KVPoll.BOOTSTRAPPING})
                    start = time.perf_counter()
                    for begin in range(0, args.tokens, args.chunk):
                        end = min(begin + args.chunk, args.tokens)
                        sender.send(src[begin:end], begin, b"{}" if end == args.tokens else None)
                    state = wait(sender, {KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING})
                    seconds = time.perf_counter() - start
                    if state != KVPoll.SUCCESS or conn.recv() != "SUCCESS":
                        raise SystemExit(f"transfer failed: {sender.failure}")
                    if r:
                        rates.append(total / seconds / 1e9)
                print(
                    f"  {name:<28} {max(rates):5.2f} GB/s (fastest of {args.rounds}), median {statistics.median(rates):.2f}"
                )
        finally:
            conn.send(None)
            decode.join(timeout=30)
            prefill.close()


if __name__ == "__main__":
    main()
