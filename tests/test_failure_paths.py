"""A request the server could not serve is never a success. It ends as an error the client sees, whose
status says whose fault it is (400 the request's, 5xx the server's) and whose message names the cause:
the body of a non-streaming answer, or an error event before `[DONE]` in a stream that had started.
Such failures are counted in /metrics apart from client aborts; only a client's own cancellation ends as
a quiet "abort".

Through a real server with an encoder pool of two (`--vit-dp 2`): both ranks SIGKILLed at once under
load (they are replaced, and every request still gets its answer), then killed again with their
restarts failing (every image request gets a 503, /health says why, text is still served), then the
scheduler killed mid-stream (stream error events, 503s, the server stops and leaves no process behind).
Through `Engine` and the pool: the other failure paths, each raised as the server's error class."""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import ServerProcess, descendants, openai_client, process_name, start_server

from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.server.errors import BadRequest, InternalError, ServiceUnavailable
from vlm_serve.testing.media import make_image
from vlm_serve.vision.encoder import EncodeTask
from vlm_serve.vision.encoder_pool import EncoderPool

MAX_TOKENS = 6
LONG = 2000  # tokens: an answer still streaming when its server fails
TEXT = [{"role": "user", "content": "Tell me about the sea."}]


def _image_chat(seed: int) -> list[dict]:
    buffer = io.BytesIO()
    make_image(64 + 16 * (seed % 4), 96, seed=seed).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
    return [{"role": "user", "content": parts}]


@dataclass
class Outcome:
    """How a chat request ended, as seen on the wire."""

    status: int
    text: str = ""  # the answer (a stream's deltas joined)
    finish_reason: str | None = None
    error: dict | None = None  # OpenAI's error object: the body's, or a stream's error event


def _chat(server: ServerProcess, messages: list[dict], stream: bool = False, max_tokens: int = MAX_TOKENS) -> Outcome:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        response.read()
    if response.status_code != 200:
        return Outcome(response.status_code, error=response.json()["error"])
    if not stream:
        choice = response.json()["choices"][0]
        return Outcome(200, choice["message"]["content"], choice["finish_reason"])
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    assert not errors or "error" in chunks[-1], "an error event is the stream's last"
    choices = [chunk["choices"][0] for chunk in chunks if chunk.get("choices")]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    return Outcome(200, text, finish, errors[0] if errors else None)


def _metrics(server: ServerProcess) -> dict[str, float]:
    samples = [line.rsplit(" ", 1) for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines()]
    return {name.removeprefix("vlm_serve:"): float(value) for name, value in samples if not name.startswith("#")}


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _encoder_pids(server: ServerProcess) -> list[int]:
    return [pid for pid in descendants(server.process.pid) if process_name(pid).startswith("vlm-encoder-")]


def _under_fire(server: ServerProcess, conversations: list[list[dict]]) -> list[Outcome]:
    """Sends the conversations (every other one streamed) while both encoder ranks hold their images,
    and SIGKILLs both ranks at once: stopped first, they take work but never answer it."""
    victims = _encoder_pids(server)
    assert len(victims) == 2
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    with ThreadPoolExecutor(len(conversations)) as pool:
        outcomes = [pool.submit(_chat, server, c, i % 2 == 1) for i, c in enumerate(conversations)]
        loaded = lambda: all(_metrics(server)[f'encoder_load_patches{{rank="{r}"}}'] > 0 for r in (0, 1))  # noqa: E731
        _wait_until(loaded, "both encoder ranks hold work")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return [o.result() for o in outcomes]


def test_killed_encoder_ranks_and_a_killed_scheduler_never_pass_for_answers(tiny_moe_dir, tmp_path):
    model = Path(shutil.copytree(tiny_moe_dir, tmp_path / "model"))  # its config is taken away later
    server = start_server(model, "--vit-dp", "2")
    try:
        conversations = [_image_chat(seed) for seed in range(100, 104)]
        expected = [_chat(server, c).text for c in conversations]
        assert all(expected)
        assert _chat(server, TEXT, max_tokens=10**6).status == 400  # the request's fault: not a failure of the server
        assert httpx.post(server.url + "/flush_cache").status_code == 200  # the images must be encoded again

        # both ranks killed at once: they are restarted, and every request still gets its answer (neither
        # had begun its work, so no attempt is lost even where it went to the other, dying, rank)
        outcomes = _under_fire(server, conversations)
        assert [(o.status, o.error, o.text) for o in outcomes] == [(200, None, text) for text in expected]
        _wait_until(lambda: _metrics(server)["encoder_restarts_total"] >= 2, "both ranks are back")

        # killed again, and the replacements cannot start (their model is gone): each image request fails
        # visibly, streamed or not
        (model / "config.json").rename(model / "config.json.gone")
        httpx.post(server.url + "/flush_cache")
        for outcome in _under_fire(server, conversations):
            assert outcome.status == 503, outcome  # (a stream that had not started yet is answered with the status)
            assert outcome.error["type"] == "ServiceUnavailableError"
            assert outcome.error["message"] == (
                "image 0 of the request could not be encoded: no encoder rank is running (they fail to start)"
            )
        health = lambda: httpx.get(server.url + "/health")  # noqa: E731
        _wait_until(lambda: health().status_code == 503, "/health reports the encoders")
        reason = "no encoder rank is running (each failed to start 3 times in a row)"
        assert health().json() == {"status": "unhealthy", "reason": reason}
        assert _chat(server, [*conversations[0]]).status == 503  # fails at once now
        assert _chat(server, TEXT).finish_reason in ("stop", "length")  # text is still served
        metrics = _metrics(server)
        assert metrics['request_failure_total{reason="encoder_unavailable"}'] == len(conversations) + 1
        assert metrics["requests_rejected_total"] == 1
        assert metrics['requests_finished_total{reason="abort"}'] == 0  # failures are not client aborts

        # the scheduler killed mid-stream: streams end with an error event, other requests with a 503, and
        # the server stops, leaving no process behind
        everything = descendants(server.process.pid)
        scheduler = next(pid for pid in everything if process_name(pid) == "vlm-scheduler-0")
        client = openai_client(server)

        def stream_a_completion() -> openai.APIError | None:
            stream = client.completions.create(
                model=None, prompt="Once upon a time", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
            )
            try:
                for _ in stream:
                    pass
            except openai.APIError as exc:
                return exc
            return None

        with ThreadPoolExecutor(3) as pool:
            streamed = pool.submit(_chat, server, TEXT, True, LONG)
            blocking = pool.submit(_chat, server, TEXT, False, LONG)
            completion = pool.submit(stream_a_completion)
            _wait_until(lambda: _metrics(server)["num_requests_running"] == 3, "three requests are running")
            tokens = _metrics(server)["generation_tokens_total"]
            _wait_until(lambda: _metrics(server)["generation_tokens_total"] > tokens + 30, "they stream")
            os.kill(scheduler, signal.SIGKILL)
            streamed, blocking, completion = streamed.result(), blocking.result(), completion.result()
        cause = "the scheduler TP0 process exited (code -9)"
        assert streamed.status == 200 and streamed.text and streamed.finish_reason is None
        assert (streamed.error["message"], streamed.error["type"]) == (cause, "ServiceUnavailableError")
        assert blocking.status == 503 and blocking.error["message"] == cause
        assert isinstance(completion, openai.APIError) and cause in str(completion)
        assert _chat(server, TEXT).error["message"] == cause  # a new request fails at once
        assert health().json() == {"status": "unhealthy", "reason": cause}
        assert server.process.wait(60) == 1
        deadline = time.monotonic() + 20
        while [pid for pid in everything if process_name(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in everything if process_name(pid)], "processes outlived the server"
    finally:
        server.stop()  # (it has stopped by itself unless the test failed)


# ---- the encoder pool ----------------------------------------------------------------------------------


def test_work_never_goes_to_a_rank_known_to_be_dead(tiny_moe_dir):
    """A rank whose process has exited gets no new work, even before the pool has taken its old work
    back, so no attempt is wasted on it."""
    pool = EncoderPool.start(ServerArgs(model=str(tiny_moe_dir), vit_dp=2), torch.device("cpu"))
    try:
        dead = pool.ranks[0]
        os.kill(dead.pid, signal.SIGKILL)
        select.select([dead.pidfd], [], [], 30)  # (readable once it has exited)
        gen = torch.Generator().manual_seed(0)
        tasks = [EncodeTask(i, (1, 8, 8), torch.randn(64, 1536, generator=gen)) for i in range(3)]
        pool.submit(tasks)
        assert not dead.jobs and sum(map(len, pool.ranks[1].jobs.values())) == 3
        results = []
        deadline = time.monotonic() + 60
        while len(results) < 3 and time.monotonic() < deadline:
            results += pool.poll(timeout=0.1)
        assert sorted(r.hash for r in results) == [0, 1, 2]
        assert all(r.error is None and r.rank == 1 for r in results)
        assert [t.attempts for t in tasks] == [0, 0, 0]
    finally:
        pool.shutdown()


# ---- through the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0) as engine:
        yield engine


def _settled(engine: Engine) -> None:
    """Nothing is left behind: no request, no text stream, no KV slot."""
    engine.step()
    while not engine.scheduler.is_idle():
        engine.step()
    assert not engine.scheduler.reqs and not engine.detokenizer.streams
    engine.scheduler.check_memory()


def test_a_request_the_scheduler_refuses_is_the_requests_fault(engine):
    before = engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text
    with pytest.raises(BadRequest, match="exceeds the context length") as raised:
        engine.chat(TEXT, max_tokens=10**6)
    assert isinstance(raised.value, ValueError) and raised.value.code == "invalid_request"
    _settled(engine)
    assert engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text == before


def test_an_image_the_vision_tower_raises_on_is_an_internal_error_streamed_or_not(engine, monkeypatch):
    parts = [{"type": "image", "image": make_image(96, 64, seed=7)}, {"type": "text", "text": "Hi"}]
    conversation = [{"role": "user", "content": parts}]
    visual = engine.scheduler.encoding.encoder.visual

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    with monkeypatch.context() as patch:
        patch.setattr(visual, "encode", broken)
        with pytest.raises(InternalError, match="image 0 of the request could not be encoded: .*illegal") as raised:
            engine.chat(conversation, max_tokens=MAX_TOKENS)
        assert raised.value.status == 500 and raised.value.code == "encoder_error"
        with pytest.raises(InternalError, match="illegal memory"):
            list(engine.stream(conversation, max_tokens=MAX_TOKENS))
        _settled(engine)
    assert engine.chat(conversation, max_tokens=MAX_TOKENS, temperature=0).finish_reason in ("stop", "length")


def test_grammar_failures_say_whose_fault_they_are(engine, monkeypatch):
    with pytest.raises(BadRequest, match="invalid regex") as raised:
        engine.chat(TEXT, regex="(", max_tokens=MAX_TOKENS)
    assert raised.value.code == "invalid_grammar"
    with monkeypatch.context() as patch:  # a compilation that never ends
        patch.setattr(engine.scheduler.grammar_backend, "compile", lambda key: Future())
        patch.setattr(engine.server_args, "grammar_compile_timeout", 0.05)
        with pytest.raises(ServiceUnavailable, match="did not compile within 0.05 s") as raised:
            engine.chat(TEXT, regex="a+", max_tokens=MAX_TOKENS)
    assert raised.value.status == 503 and raised.value.code == "grammar_timeout"
    _settled(engine)


def test_a_failed_idle_self_check_is_raised_not_passed_over(engine):
    before = engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text
    leaked = engine.scheduler.allocator.alloc(1)
    try:
        with pytest.raises(RuntimeError, match="idle self-check failed: 1 KV slots leaked"):
            engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0)
            engine.step()  # (if the call ended before the scheduler's first idle step)
    finally:
        engine.scheduler.allocator.free(leaked)
    _settled(engine)
    assert engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text == before
