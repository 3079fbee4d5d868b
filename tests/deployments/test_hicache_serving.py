"""The prefix cache's tiers in real servers: `/metrics` tells what each tier served and holds, `cached_tokens`
counts every tier, a server restarted on the same storage finds its prefixes there, and two replicas behind
sglang-router on one storage (a directory, or Mooncake's store on loopback) serve each other's prefixes."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import free_port, metric, running_router, running_server, start_process, stop_tree
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # every test here starts real servers

POOL = 512  # tokens: the KV pool holds about 4 conversations, its host tier (twice as large) the 8 of them
CONVERSATIONS = 8


def tier_flags(storage: Path | None = None, mooncake: str | None = None) -> tuple[str, ...]:
    """A small KV pool over a host tier and a storage tier: the `storage` directory, or the Mooncake store
    whose master serves at `mooncake`."""
    backend = (
        ("file", "--hicache-storage-dir", str(storage))
        if mooncake is None
        else ("mooncake", "--hicache-storage-backend-extra-config", json.dumps({"master_server_address": mooncake}))
    )
    return (
        "--page-size", "16", "--max-total-tokens", str(POOL), "--enable-hierarchical-cache",
        "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend", *backend,
    )  # fmt: skip


def picture_url(seed: int) -> str:
    buffer = io.BytesIO()
    make_image(160, 160, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(url: str, seed: int) -> dict:
    """A chat about picture `seed`: its answer and usage."""
    content = [
        {"type": "image_url", "image_url": {"url": picture_url(seed)}},
        {"type": "text", "text": "Describe this image. Then say where each shape is, and what colour it has."},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def tier_metric(url: str, name: str, **label: str) -> float:
    ((key, value),) = label.items()
    return metric(url, f'{name}{{{key}="{value}"}}')


def wait_for_storage(url: str) -> None:
    """Until the pages backed up so far are written (storage writes run on a thread of their own)."""
    deadline = time.monotonic() + 30
    written = -1.0
    while time.monotonic() < deadline:
        now = tier_metric(url, "hicache_copied_bytes_total", copy="host_to_storage")
        if now == written and now > 0:
            return
        written = now
        time.sleep(0.3)
    raise AssertionError("the storage writes did not settle")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_metrics_count_every_tier_and_a_restarted_server_finds_its_prefixes_in_storage(tmp_path, tp_size):
    """(With TP 2 each rank stores and reads its own heads' pages; the ranks agree on what they use.)"""
    flags = (*tier_flags(tmp_path / "storage"), "--tp-size", str(tp_size))
    with running_server(BUILTIN_MODEL, *flags) as server:
        first = [ask(server.url, seed) for seed in range(CONVERSATIONS)]
        again = [ask(server.url, seed) for seed in range(CONVERSATIONS)]  # (most left the pool meanwhile)
        assert [a["choices"][0]["message"] for a in again] == [a["choices"][0]["message"] for a in first]
        cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in again)
        tiers = ("device", "host", "storage")
        served = sum(tier_metric(server.url, "hicache_hit_tokens_total", tier=t) for t in tiers)
        assert cached > 0 and served == metric(server.url, "prompt_tokens_cached_total")
        assert tier_metric(server.url, "hicache_hit_tokens_total", tier="host") > 0
        assert tier_metric(server.url, "hicache_usage_tokens", tier="host") > 0
        assert tier_metric(server.url, "hicache_copied_bytes_total", copy="host_to_device") > 0
        assert tier_metric(server.url, "hicache_copy_seconds_total", copy="device_to_host") > 0
        wait_for_storage(server.url)
        assert tier_metric(server.url, "hicache_usage_tokens", tier="storage") > 0
    with running_server(BUILTIN_MODEL, *flags) as server:
        warm = ask(server.url, 0)
        assert warm["choices"][0]["message"] == first[0]["choices"][0]["message"]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # the picture's tokens and more
        assert tier_metric(server.url, "hicache_hit_tokens_total", tier="storage") > 0


@pytest.fixture(params=["file", "mooncake"])
def shared_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ...]]:
    """The flags of servers sharing a storage tier: a directory, or Mooncake's store (its master started here,
    on loopback)."""
    if request.param == "file":
        yield tier_flags(tmp_path / "storage")
        return
    rpc = free_port()
    log = tmp_path / "mooncake_master.log"
    command = ["mooncake_master", f"--rpc_port={rpc}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"]
    with log.open("w") as out:
        master = start_process([*command, "--metrics_host=127.0.0.1"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), 0.2).close()
            break
        except OSError:
            assert master.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    try:
        yield tier_flags(mooncake=f"127.0.0.1:{rpc}")
    finally:
        stop_tree(master)


def test_two_replicas_behind_the_router_on_one_storage_serve_each_others_prefixes(shared_storage):
    """sglang-router (round robin) sends the same prompt to one replica, then to the other, which finds its
    prefix in the storage they share. (Mooncake keeps a page in the memory one of its clients lends it:
    both servers live meanwhile.)"""
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # (Mooncake's data then goes over loopback)
    with (
        running_server(BUILTIN_MODEL, *shared_storage, env=env) as a,
        running_server(BUILTIN_MODEL, *shared_storage, env=env) as b,
        running_router("--worker-urls", a.url, b.url, "--policy", "round_robin") as router,
    ):
        before = {s.url: metric(s.url, "requests_total") for s in (a, b)}
        answer = ask(router, 7)
        first, other = (a, b) if metric(a.url, "requests_total") > before[a.url] else (b, a)
        wait_for_storage(first.url)
        for _ in range(4):  # (round robin: the next request goes to the other replica)
            again = ask(router, 7)
            if metric(other.url, "requests_total") > before[other.url]:
                break
        assert again["choices"][0]["message"] == answer["choices"][0]["message"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert tier_metric(other.url, "hicache_hit_tokens_total", tier="storage") > 0
