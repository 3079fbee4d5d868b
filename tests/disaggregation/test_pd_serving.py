"""Prefill/decode disaggregation as a deployment runs it: sglang-router in PD mode in front of a prefill
server (an encoder pool of two ranks) and a decode server (no vision tower, media sized pixel-free), the
KV moving through Mooncake's transfer engine over TCP on loopback. Every greedy answer equals a
colocated server's — text, an image, a repeated image, a video, image + video, n=2, streaming, batches,
SGLang's /generate, json_schema, a named tool, 32 requests at once, the README's curl example — with the
README's own commands (the built-in model's EAGLE-3 draft on both servers, its KV sent with the target's),
under the overlap loop without drafts, and with both servers at TP 2 and n-gram drafts;
the decode server never decodes a pixel, and both servers' KV returns to idle. A server of the pair
killed while a request's KV moves fails that request on the other one, which returns to idle."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import (
    README_URL,
    ServerProcess,
    block_command,
    circle_image,
    deployment_answers,
    free_port,
    metric,
    readme_blocks,
    run_process,
    running_router,
    running_server,
    start_process,
    start_server,
)
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # every test here starts a real server

TOKENIZER = Tokenizer.from_pretrained(BUILTIN_MODEL)
BLOCKS = readme_blocks()
PD_COMMANDS = next(b for b in BLOCKS if "--pd-disaggregation" in b.code)  # the README's PD set-up
CURL = next(b for b in BLOCKS if "curl" in b.code and "circle.png" in b.code)  # its curl example
CONFIGS = {  # flags of both servers (None: the README's commands, run as written)
    "README (EAGLE-3 drafts)": None,  # (the built-in model's default: the prefill side computes the draft's KV)
    "overlap, no drafts": ["--speculative-algorithm", "none"],
    "TP 2, n-gram drafts": ["--tp-size", "2", "--speculative-algorithm", "ngram"],  # (the decode side drafts)
}


@pytest.fixture(scope="module")
def colocated_server() -> Iterator[ServerProcess]:
    with running_server(BUILTIN_MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def colocated(colocated_server) -> dict:
    """The answers of one colocated server."""
    return deployment_answers(colocated_server.url, TOKENIZER)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A reader's folder: the README's `circle.png`, for its curl example."""
    folder = tmp_path_factory.mktemp("readme")
    circle_image().save(folder / "circle.png")
    return folder


@pytest.fixture(scope="module", params=list(CONFIGS))
def pd(request, folder) -> Iterator[tuple[str, str, str]]:
    """The router's URL, and the URLs of the prefill and decode servers behind it."""
    flags = CONFIGS[request.param]
    if flags is None:
        with readme_pd_commands(folder) as urls:
            yield urls
        return
    bootstrap = str(free_port())
    prefill_flags = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap, "--vit-dp", "2"]
    with (
        running_server(BUILTIN_MODEL, *prefill_flags, *flags) as prefill,
        running_server(BUILTIN_MODEL, "--disaggregation-mode", "decode", *flags) as decode,
        running_router("--pd-disaggregation", "--prefill", prefill.url, bootstrap, "--decode", decode.url) as url,
    ):
        yield url, prefill.url, decode.url


@contextlib.contextmanager
def readme_pd_commands(folder: Path) -> Iterator[tuple[str, str, str]]:
    """The README's PD commands (prefill server, decode server, router), run as written in a process
    group of their own, their ports made free ones: the URLs of the router, prefill and decode servers.
    SIGTERM to the group stops them all."""
    ports = {port: str(free_port()) for port in ("30000", "30001", "30002", "8998")}
    command, env = block_command(PD_COMMANDS, ports)
    log = folder / "pd-commands.txt"
    with log.open("w") as out:
        trio = start_process(command, cwd=folder, env=env, stdout=out, stderr=out, start_new_session=True)
    router, prefill, decode = (f"http://127.0.0.1:{ports[port]}" for port in ("30000", "30001", "30002"))
    try:
        deadline = time.monotonic() + 180
        while not answers_chat(router):
            assert trio.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield router, prefill, decode
    finally:
        os.killpg(trio.pid, signal.SIGTERM)
        trio.wait(60)
        deadline = time.monotonic() + 60
        with contextlib.suppress(ProcessLookupError):  # (until no process of the group is left)
            while time.monotonic() < deadline:
                os.killpg(trio.pid, 0)
                time.sleep(0.2)
            os.killpg(trio.pid, signal.SIGKILL)
            raise AssertionError("the README's PD commands did not stop on SIGTERM:\n" + log.read_text())


def answers_chat(router: str) -> bool:
    """Whether the router answers a chat request (both servers are up and it has found them)."""
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        return httpx.post(router + "/v1/chat/completions", json=body, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def curl_example(folder: Path, url: str) -> str:
    """The answer to the README's curl example (about `circle.png`) from the server at `url`."""
    command, env = block_command(CURL, {README_URL: url})
    result = run_process(command, cwd=folder, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)["choices"][0]["message"]["content"]


def test_answers_through_the_pd_pair_equal_a_colocated_servers(pd, colocated, colocated_server, folder, request):
    url, prefill, decode = pd
    assert deployment_answers(url, TOKENIZER) == colocated
    assert curl_example(folder, url) == curl_example(folder, colocated_server.url)
    if CONFIGS[request.node.callspec.params["pd"]] is None:  # (the decode side's EAGLE-3 draft keeps drafts)
        assert metric(decode, "spec_decode_num_accepted_tokens") > 0
    assert metric(prefill, "spec_decode_num_draft_tokens") == 0  # (the prefill side never decodes)
    assert metric(decode, 'media_stage_seconds_sum{stage="decode"}') == 0  # no pixel was decoded there
    assert metric(decode, "vit_items") == 0 and metric(prefill, "vit_items") > 0
    for server in (prefill, decode):
        assert metric(server, "kv_transfer_bytes_total") > 0
        assert metric(server, "kv_transfer_failures_total") == 0
        assert metric(server, "num_requests_running") == metric(server, "disaggregation_queue_size") == 0
        assert httpx.get(server + "/health", timeout=30).status_code == 200  # (the idle self-check passed)


# ---- a server of the pair killed mid-transfer --------------------------------------------------------

LONG_PROMPT = [{"role": "user", "content": " ".join(["circle square triangle star"] * 100)}]  # (~1500 tokens)


@contextlib.contextmanager
def slow_pd_pair() -> Iterator[tuple[ServerProcess, ServerProcess, dict]]:
    """A prefill server that computes a long prompt in many chunks (so that its KV is on its way for a
    while) and a decode server; the bootstrap fields a router would add to a request for them. Each
    server is stopped at the end, whether or not a test killed it."""
    port = free_port()
    prefill = start_server(
        BUILTIN_MODEL,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(port),
        "--chunked-prefill-size",
        "8",
    )
    try:
        decode = start_server(BUILTIN_MODEL, "--disaggregation-mode", "decode")
        try:
            yield prefill, decode, {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7}
        finally:
            decode.stop(signal.SIGKILL, group=True)
    finally:
        prefill.stop(signal.SIGKILL, group=True)


def send_to_both(prefill: ServerProcess, decode: ServerProcess, bootstrap: dict) -> tuple[Future, Future]:
    """The long prompt to both servers at once with the same room, as sglang-router sends it."""
    body = {"messages": LONG_PROMPT, "max_tokens": 8, "temperature": 0, **bootstrap}
    pool = ThreadPoolExecutor(2)
    answers = tuple(
        pool.submit(httpx.post, s.url + "/v1/chat/completions", json=body, timeout=120) for s in (prefill, decode)
    )
    pool.shutdown(wait=False)
    return answers


def wait_for_metric(server: ServerProcess, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while metric(server.url, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def assert_idle(server: ServerProcess) -> None:
    """Nothing running or queued, no KV held (the idle self-check behind /health passed)."""
    wait_for_metric(server, "disaggregation_queue_size", 0)
    assert metric(server.url, "num_requests_running") == 0
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_decode_server_killed_during_a_transfer_fails_the_request_on_the_prefill_side_which_returns_to_idle():
    with slow_pd_pair() as (prefill, decode, bootstrap):
        on_prefill, on_decode = send_to_both(prefill, decode, bootstrap)
        wait_for_metric(decode, 'disaggregation_queue_size{queue="transfer"}', 1)  # (KV slots given: pages flow)
        decode.stop(signal.SIGKILL, group=True)
        with pytest.raises(httpx.TransportError):  # (the decode server's client sees its connection broken)
            on_decode.result()
        answer = on_prefill.result()
        assert answer.status_code == 503 and "to the decode rank" in answer.json()["error"]["message"], answer.text
        assert metric(prefill.url, 'kv_transfer_failures_total{stage="transfer"}') == 1
        assert_idle(prefill)


def test_a_prefill_server_killed_while_the_kv_is_on_its_way_fails_the_request_on_the_decode_side():
    with slow_pd_pair() as (prefill, decode, bootstrap):
        on_prefill, on_decode = send_to_both(prefill, decode, bootstrap)
        wait_for_metric(decode, 'disaggregation_queue_size{queue="transfer"}', 1)
        prefill.stop(signal.SIGKILL, group=True)
        with pytest.raises(httpx.TransportError):
            on_prefill.result()
        answer = on_decode.result()  # (once the prefill rank's heartbeats have been missed for 10 s)
        assert answer.status_code == 503 and "stopped answering" in answer.json()["error"]["message"], answer.text
        assert_idle(decode)  # (the failed transfer's slots are quarantined, not leaked)
        assert metric(decode.url, 'kv_transfer_failures_total{stage="transfer"}') == 1
