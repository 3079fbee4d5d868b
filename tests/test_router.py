"""vlm_serve behind sglang-router, started as the README starts it. In the router's normal mode two
colocated servers of the built-in model are data-parallel replicas: chat completions (with an image,
with n=2, streamed), text completions (a batch with n=2) and SGLang's /generate (with an image,
streamed, a batch with n=2) come back through the router exactly as one server answers them (greedy),
and the router names the model as the servers' /model_info does. The router in its PD mode, over the
same two colocated servers (which accept the bootstrap fields it adds and ignore them), answers the
same too. Real processes: the router's binary and two `vlm-serve serve`."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers import ServerProcess, free_port, running_server, stop_with_parent
from PIL import Image, ImageDraw

from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.tokenizer import Tokenizer

pytest.importorskip("sglang_router")

TOKENIZER = Tokenizer.from_pretrained(BUILTIN_MODEL)
QUESTION = "What colour is the circle?"
# the chat template's text of QUESTION about one image, as an SGLang user sends it to /generate
PROMPT = f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"


def circle_url() -> str:
    """The README's picture: a red circle on white."""
    image = Image.new("RGB", (96, 96), "white")
    ImageDraw.Draw(image).ellipse([35, 35, 61, 61], fill="red")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": circle_url()}}, {"type": "text", "text": QUESTION},
]}]  # fmt: skip


@contextlib.contextmanager
def running_router(*args: str, workers: int = 2, timeout: float = 60) -> Iterator[str]:
    """`python -m sglang_router.launch_router ARGS` on a free loopback port: its URL once it reports
    `workers` healthy workers. SIGTERM stops it at the end."""
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(free_port()), "--log-level", "warn", *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=stop_with_parent
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while _healthy_workers(url) < workers:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the router did not start:\n" + process.communicate()[0])
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=30)


def _healthy_workers(url: str) -> int:
    try:
        return httpx.get(url + "/readiness", timeout=5).json()["healthy_workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    with running_server(BUILTIN_MODEL) as first, running_server(BUILTIN_MODEL) as second:
        yield [first, second]


@pytest.fixture(scope="module")
def replicas(servers: list[ServerProcess]) -> Iterator[str]:
    """The router in its normal mode, cache-aware, over both servers."""
    with running_router("--worker-urls", *(s.url for s in servers), "--policy", "cache_aware") as url:
        yield url


def answers(base_url: str) -> dict:
    """What a client gets from `base_url` for each kind of request (greedy)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    greedy = {"max_tokens": 24, "temperature": 0}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, **greedy)
    # no model (the router sends "unknown"), n=2 (in PD mode the router gives each choice its own room)
    two = httpx.post(base_url + "/v1/chat/completions", json={"messages": MESSAGES, "n": 2, **greedy}, timeout=60)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **greedy)
    # batches of prompts with n=2 (in PD mode the router gives each prompt its own room)
    completion = client.completions.create(model=model, prompt=["A red circle", "A blue square"], n=2, **greedy)
    sampling = {"max_new_tokens": 24, "temperature": 0}
    ids = [TOKENIZER.encode(text) for text in ("A red circle", "A blue square")]
    batch_body = {"input_ids": ids, "sampling_params": {**sampling, "n": 2}}
    batch = httpx.post(base_url + "/generate", json=batch_body, timeout=60)
    body = {"text": PROMPT, "image_data": circle_url(), "sampling_params": sampling}
    generate = httpx.post(base_url + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", base_url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return {
        "chat": (chat.choices[0].message.content, chat.usage.prompt_tokens, chat.usage.completion_tokens),
        "chat n=2": [choice["message"]["content"] for choice in two.json()["choices"]],
        "chat streamed": "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices),
        "completions": [choice.text for choice in completion.choices],
        "generate": (generate["text"], generate["output_ids"], generate["meta_info"]["finish_reason"]),
        "generate batch": [out["text"] for out in batch.json()],
        "generate streamed": (json.loads(events[-2])["text"], events[-1]),
    }


def test_the_router_names_the_model_as_the_servers_report_it(servers: list[ServerProcess], replicas: str) -> None:
    served = httpx.get(servers[0].url + "/model_info").json()["served_model_name"]
    assert [model["id"] for model in httpx.get(replicas + "/v1/models").json()["data"]] == [served]
    workers = httpx.get(replicas + "/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(s.url for s in servers)
    assert all(w["is_healthy"] and w["metadata"]["model_path"] == str(BUILTIN_MODEL) for w in workers)
    # the router probes each server for gRPC first: they answer with a 400 and print nothing about it
    assert [line for server in servers for line in server.output if "serving" not in line] == []


def requests_received(server: ServerProcess) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    return float(next(line for line in metrics.splitlines() if line.startswith("vlm_serve:requests_total")).split()[1])


def test_replicas_behind_the_router_answer_as_one_server(servers: list[ServerProcess], replicas: str) -> None:
    """Both replicas take a share of the requests (cache-aware: a prompt goes where its prefix is cached,
    a new one to the replica with the least cached)."""
    one_server = answers(servers[0].url)
    assert one_server["chat"][0] == "The circle is red."
    before = [requests_received(server) for server in servers]
    assert answers(replicas) == one_server
    received = [requests_received(server) - count for server, count in zip(servers, before)]
    assert sum(received) == len(one_server) and min(received) > 0


def test_the_router_in_pd_mode_over_colocated_servers_answers_as_one_server(servers: list[ServerProcess]) -> None:
    """Each request goes to both servers with bootstrap_host/port/room (lists for chat with n=2 and for
    batches); a colocated server serves it whole, and the router returns the "decode" server's answer."""
    prefill, decode = servers
    with running_router("--pd-disaggregation", "--prefill", prefill.url, "8998", "--decode", decode.url) as url:
        assert answers(url) == answers(decode.url)
