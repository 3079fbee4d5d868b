"""Fault injection through real servers: what clients see when many of them leave at once, and when a
process of the server is SIGKILLed under load. A client can always tell an answer from a failure.

A disconnect storm (200 clients at once, half streaming, a quarter leaving early) gives every client
that stays the greedy answer it gets alone, and leaves the server idle: nothing running, waiting or
encoding, no KV slot held, the scheduler's idle self-check passed and the server healthy.

With an encoder pool of two (`--vit-dp 2`): both ranks SIGKILLed at once under load are replaced, and
every request still gets its answer; killed again with their replacements failing to start, every image
request gets a 503 naming the cause, /health says why, and text is still served.

A killed detokenizer or scheduler TP rank ends every request in flight either correctly answered or
visibly failed (a 503 or a stream error event naming the dead process, an error the official client
raises, or a broken connection once the server is gone), never as a 200 with a cut answer; then the
server stops and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

import request_faults
from helpers import ServerProcess, descendants, openai_client, process_name, running_server, start_server
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # every test here starts a real server

MAX_TOKENS = 8
LONG = 1000  # tokens: an answer still in flight when its client leaves or its server fails
STORM = 200  # clients in the disconnect storm
CLIENTS = 6  # clients sending request after request while a process is killed


def _image_chat(seed: int, width: int = 64) -> list[dict]:
    buffer = io.BytesIO()
    make_image(width, 48, seed=seed).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]


TEXT = [{"role": "user", "content": "Tell me about the sea."}]
POEM = [{"role": "user", "content": "Write a poem about a small robot."}]
CONVERSATIONS = [TEXT, _image_chat(5)]


@dataclass
class Outcome:
    """How a chat request ended, as its client saw it."""

    status: int  # 0: the connection broke (or could not be made)
    text: str = ""  # the answer (a stream's deltas joined)
    finish_reason: str | None = None
    error: dict | None = None  # OpenAI's error object: the body's, or a stream's error event
    done: bool = False  # a stream's `[DONE]` arrived
    left: bool = False  # the client left early on purpose


async def _chat(
    http: httpx.AsyncClient,
    messages: list[dict],
    stream: bool,
    max_tokens: int = MAX_TOKENS,
    leave: bool = False,
    words: asyncio.Event | None = None,
) -> Outcome:
    """One greedy chat request; a stream sets `words` at its first words, and leaves then if `leave`."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if max_tokens == LONG:
        body["ignore_eos"] = True  # (it must not end early)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200 or not stream:
                await response.aread()
                assert response.headers["content-type"] == "application/json", (response.status_code, response.text)
                answer = response.json()
                if response.status_code != 200:
                    return Outcome(response.status_code, error=answer["error"])
                choice = answer["choices"][0]
                return Outcome(200, choice["message"]["content"], choice["finish_reason"])
            outcome = Outcome(200)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.done = True
                    continue
                assert not outcome.error, "an error event is the stream's last"
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome.error = event["error"]
                    continue
                for choice in event["choices"]:
                    outcome.text += choice["delta"].get("content") or ""
                    outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                if outcome.text and words is not None:
                    words.set()
                if outcome.text and leave:
                    outcome.left = True
                    return outcome
            return outcome
    except httpx.TransportError:
        return Outcome(0)


def _correct(outcome: Outcome, expected: Outcome, stream: bool) -> bool:
    """The request's whole greedy answer, as a lone request gets it."""
    answer = (outcome.status, outcome.error, outcome.text, outcome.finish_reason, outcome.done)
    return answer == (200, None, expected.text, expected.finish_reason, stream)


def _metrics(server: ServerProcess) -> dict[str, float]:
    return _parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)


def _parse_metrics(text: str) -> dict[str, float]:
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    return {name.removeprefix("vlm_serve:"): float(value) for name, value in samples}


def _idle(metrics: dict[str, float]) -> bool:
    gauges = ("num_requests_running", "num_requests_waiting", "num_requests_encoding", "kv_cache_usage")
    return all(metrics[gauge] == 0 for gauge in gauges)


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _http(server: ServerProcess, connections: int) -> httpx.AsyncClient:
    """A client of the server opening a connection per request (a leaving client closes its own)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60)


def _control(server: ServerProcess, conversations: list[list[dict]] = CONVERSATIONS) -> list[Outcome]:
    """Each conversation's greedy answer to a lone request, through the official client."""
    client = openai_client(server)
    answers = []
    for messages in conversations:
        reply = client.chat.completions.create(model=None, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        answers.append(Outcome(200, reply.choices[0].message.content, reply.choices[0].finish_reason))
    assert all(a.text and a.finish_reason in ("stop", "length") for a in answers)
    return answers


@pytest.fixture(scope="module")
def expected(server: ServerProcess) -> list[Outcome]:
    """Answers of the shared server (the storm leaves it as it found it)."""
    return _control(server)


# ---- a disconnect storm --------------------------------------------------------------------------------


async def _storm(server: ServerProcess) -> list[Outcome]:
    """`STORM` clients at once, the first half streaming; every fourth leaves early: a streaming one at
    its first words, a non-streaming one (whose answer would take long) once every request of the storm
    has reached the scheduler, as a client that gives up waiting."""
    requests_before = _metrics(server)["requests_total"]
    async with _http(server, STORM + 1) as http:
        everyone_in = asyncio.Event()

        async def watch() -> None:
            while _parse_metrics((await http.get("/metrics")).text)["requests_total"] < requests_before + STORM:
                await asyncio.sleep(0.05)
            everyone_in.set()

        async def client(i: int) -> Outcome:
            messages, stream, leaves = CONVERSATIONS[i // 4 % len(CONVERSATIONS)], i < STORM // 2, i % 4 == 0
            if not leaves:
                return await _chat(http, messages, stream)
            if stream:
                return await _chat(http, messages, True, LONG, leave=True)
            request = asyncio.ensure_future(_chat(http, messages, False, LONG))
            await everyone_in.wait()
            assert not request.done(), request.result()
            request.cancel()
            return Outcome(0, left=True)

        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(client(i) for i in range(STORM)))
        finally:
            watcher.cancel()


def test_a_disconnect_storm_gives_staying_clients_their_answers_and_leaves_the_server_idle(server, expected):
    assert httpx.post(server.url + "/flush_cache").status_code == 200  # the image is encoded during the storm
    before = _metrics(server)
    outcomes = asyncio.run(_storm(server))
    for i, outcome in enumerate(outcomes):
        if i % 4 == 0:
            assert outcome.left, (i, outcome)
        else:
            assert _correct(outcome, expected[i // 4 % len(CONVERSATIONS)], stream=i < STORM // 2), (i, outcome)

    _wait_until(lambda: _idle(_metrics(server)), "the server is idle")  # aborts land within a step or two
    # an idle scheduler runs its self-check before it answers stats: answering again means the check
    # passed (a failed one raises in the scheduler, whose death makes /health 503 and stops the server)
    after = _metrics(server)
    assert _idle(after)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finished = lambda m, reason: m[f'requests_finished_total{{reason="{reason}"}}']  # noqa: E731
    assert finished(after, "abort") - finished(before, "abort") == STORM // 4
    assert sum(finished(after, r) - finished(before, r) for r in ("stop", "length")) == STORM - STORM // 4
    assert not any(name.startswith("request_failure_total") for name in after), "leaving is not a failure"
    assert after["vit_items_total"] - before["vit_items_total"] == 1  # encoded once, however many waited
    assert _control(server) == expected


# ---- killed processes --------------------------------------------------------------------------------


def _encoder_pids(server: ServerProcess) -> list[int]:
    return [pid for pid in descendants(server.process.pid) if process_name(pid).startswith("vlm-encoder-")]


async def _under_fire(server: ServerProcess, conversations: list[list[dict]]) -> list[Outcome]:
    """Sends the conversations at once (every other one streamed) while both encoder ranks hold their
    images, and SIGKILLs both ranks together: stopped first, they take work but never answer it."""
    victims = _encoder_pids(server)
    assert len(victims) == 2
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    async with _http(server, len(conversations) + 1) as http:
        requests = [asyncio.ensure_future(_chat(http, c, i % 2 == 1)) for i, c in enumerate(conversations)]
        deadline = time.monotonic() + 60
        while True:
            metrics = _parse_metrics((await http.get("/metrics")).text)
            if all(metrics[f'encoder_load_patches{{rank="{rank}"}}'] > 0 for rank in (0, 1)):
                break
            assert time.monotonic() < deadline, "the encoder ranks never got their work"
            await asyncio.sleep(0.05)
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*requests)


def _one(server: ServerProcess, messages: list[dict], max_tokens: int = MAX_TOKENS) -> Outcome:
    async def send() -> Outcome:
        async with _http(server, 1) as http:
            return await _chat(http, messages, False, max_tokens)

    return asyncio.run(send())


def _stream_a_completion(server: ServerProcess, words: threading.Event) -> openai.APIError | None:
    """A long completion streamed through the official client; returns the error it raises."""
    stream = openai_client(server).completions.create(
        model=None, prompt="Once upon a time", max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                words.set()
    except openai.APIError as exc:
        return exc
    return None


async def _kill_under_load(
    server: ServerProcess, victim: int, conversations: list[list[dict]], expected: list[Outcome]
) -> tuple[list[Outcome], list[Outcome], openai.APIError | None, httpx.Response]:
    """`CLIENTS` clients send short requests one after another (every other one streaming) while two long
    chat streams and a long completion stream run; `victim` is SIGKILLed once each client has its first
    answer and the long streams their first words, and /metrics is asked right after. A client stops at
    its first request not answered correctly: returns that request's outcome for each client, the long
    chat streams', the completion stream's error and /metrics' answer."""
    async with _http(server, CLIENTS + 3) as http:
        answered = [asyncio.Event() for _ in range(CLIENTS)]

        async def client(i: int) -> Outcome:
            stream = i % 2 == 1
            for k in itertools.cycle(range(len(conversations))):
                outcome = await _chat(http, conversations[k], stream)
                if not _correct(outcome, expected[k], stream):
                    return outcome
                answered[i].set()

        streaming = [asyncio.Event() for _ in range(2)]
        long = [asyncio.ensure_future(_chat(http, TEXT, True, LONG, words=words)) for words in streaming]
        completing = threading.Event()
        completion = asyncio.ensure_future(asyncio.to_thread(_stream_a_completion, server, completing))
        clients = [asyncio.ensure_future(client(i)) for i in range(CLIENTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in answered + streaming)), 60)
        assert await asyncio.to_thread(completing.wait, 60)
        os.kill(victim, signal.SIGKILL)
        metrics = await http.get("/metrics")
        failed = await asyncio.wait_for(asyncio.gather(*clients), 60)
        return failed, await asyncio.gather(*long), await completion, metrics


def _every_request_answered_or_visibly_failed(
    server: ServerProcess, victim_name: str, cause: str, conversations: list[list[dict]] = CONVERSATIONS
) -> None:
    """Kills `victim_name` while `conversations` are sent and checks how every request ends, that the
    server stops, and that no process outlives it."""
    expected = _control(server, conversations)
    everything = descendants(server.process.pid)
    victim = next(pid for pid in everything if process_name(pid) == victim_name)
    failed, long, completion, metrics = asyncio.run(_kill_under_load(server, victim, conversations, expected))
    for outcome in failed:  # every request before it was answered correctly
        if outcome.status == 0:
            continue  # the server was gone already: the connection was refused or broke
        assert outcome.status in (200, 503), outcome  # 200: a stream that had started
        assert (outcome.error["message"], outcome.error["type"]) == (cause, "service_unavailable_error"), outcome
        assert outcome.finish_reason is None and outcome.done == (outcome.status == 200), outcome
    for outcome in long:  # streaming when the process died: the stream says why it ends
        assert outcome.status == 200 and outcome.text and outcome.finish_reason is None, outcome
        assert outcome.error["message"] == cause and outcome.done, outcome
    assert isinstance(completion, openai.APIError) and cause in str(completion)  # the official client raises
    assert (metrics.status_code, metrics.json()["error"]["message"]) == (503, cause)  # its answer never comes
    assert server.process.wait(60) == 1
    assert f"stopped because {cause}" in "".join(server.output)
    _wait_until(lambda: not [pid for pid in everything if process_name(pid)], "no process outlives the server", 30)


def test_killed_encoder_ranks_are_replaced_then_fail_visibly_and_a_killed_detokenizer_stops_the_server(
    tiny_moe_dir, tmp_path
):
    model = Path(shutil.copytree(tiny_moe_dir, tmp_path / "model"))  # its config is taken away later
    server = start_server(model, "--vit-dp", "2")
    try:
        conversations = [_image_chat(seed, 64 + 16 * (seed % 4)) for seed in range(100, 104)]
        expected = _control(server, conversations)
        assert _one(server, TEXT, max_tokens=10**6).status == 400  # the request's fault: not a server failure
        assert httpx.post(server.url + "/flush_cache").status_code == 200  # the images must be encoded again

        # both ranks killed at once: they are restarted, and every request still gets its answer (neither
        # had begun its work, so no attempt is lost even where it went to the other, dying, rank)
        outcomes = asyncio.run(_under_fire(server, conversations))
        for i, (outcome, answer) in enumerate(zip(outcomes, expected)):
            assert _correct(outcome, answer, stream=i % 2 == 1), outcome
        _wait_until(lambda: _metrics(server)["encoder_restarts_total"] >= 2, "both ranks are back")

        # killed again, and the replacements cannot start (their model is gone): each image request fails
        # visibly, streamed or not
        (model / "config.json").rename(model / "config.json.gone")
        httpx.post(server.url + "/flush_cache")
        for outcome in asyncio.run(_under_fire(server, conversations)):
            assert outcome.status == 503, outcome  # (a stream that had not started yet is answered with the status)
            assert outcome.error["type"] == "service_unavailable_error"
            assert outcome.error["message"] == (
                "image 0 of the request could not be encoded: no encoder rank is running (they fail to start)"
            )
        health = lambda: httpx.get(server.url + "/health")  # noqa: E731
        _wait_until(lambda: health().status_code == 503, "/health reports the encoders")
        reason = "no encoder rank is running (each failed to start 3 times in a row)"
        assert health().json() == {"status": "unhealthy", "reason": reason}
        assert _one(server, conversations[0]).status == 503  # fails at once now
        assert _one(server, TEXT).finish_reason in ("stop", "length")  # text is still served
        metrics = _metrics(server)
        assert metrics['request_failure_total{reason="encoder_unavailable"}'] == len(conversations) + 1
        assert metrics["requests_rejected_total"] == 1
        assert metrics['requests_finished_total{reason="abort"}'] == 0  # failures are not client aborts

        # then the detokenizer is killed under a load of text requests
        cause = "the detokenizer process exited (code -9)"
        _every_request_answered_or_visibly_failed(server, "vlm-detokenizer", cause, [TEXT, POEM])
    finally:
        server.stop()


def test_a_killed_scheduler_rank_fails_every_request_in_flight_visibly_and_stops_the_server(tiny_moe_dir):
    server = start_server(tiny_moe_dir, "--tp-size", "2", "--vit-dp", "0")
    try:
        cause = "the scheduler TP1 process exited (code -9)"
        _every_request_answered_or_visibly_failed(server, "vlm-scheduler-1", cause)
    finally:
        server.stop()


# ---- a request's own failure -----------------------------------------------------------------------------


def _error_message(server: ServerProcess, path: str, body: dict) -> tuple[int, str]:
    """A request expected to fail: its status (200 for a stream whose error came as an event) and the
    error's message."""
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, response.json()["error"]["message"]
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    errors = [json.loads(event)["error"] for event in events[:-1] if "error" in json.loads(event)]
    assert len(errors) == 1, events
    return 200, errors[0]["message"]


def test_a_request_whose_own_path_raises_fails_alone_on_the_default_server():
    """On the default server (the built-in model, drafting with EAGLE-3) with faults injected into each of
    its processes (request_faults): a request whose sampling, output processing or text raises ends with a
    500 (or, streamed, an error event) naming it and the cause, streamed or not and on /generate; the
    requests sent with it get the answers they get alone, and the server goes on serving, idle after."""
    with running_server(BUILTIN_MODEL, env=request_faults.server_env()) as server:
        client = openai_client(server)
        greedy = dict(model=None, messages=TEXT, max_tokens=MAX_TOKENS, temperature=0)
        want = client.chat.completions.create(**greedy).choices[0].message.content
        chat = dict(messages=TEXT, max_tokens=12, temperature=0.5, ignore_eos=True)
        forced = str(Tokenizer.from_pretrained(BUILTIN_MODEL).token_to_id(request_faults.DETOKENIZE))
        faulty = [
            ("/v1/chat/completions", {**chat, "stop": [request_faults.SAMPLE]}, "while sampling"),
            ("/v1/chat/completions", {**chat, "stop": [request_faults.OUTPUT]}, "while its output was processed"),
            ("/v1/chat/completions", {**chat, "stop": [request_faults.OUTPUT], "stream": True}, "while its output"),
            (
                "/generate",
                {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "logit_bias": {forced: 100}}},
                "while its text was decoded",
            ),
        ]
        with ThreadPoolExecutor(8) as pool:
            failures = [pool.submit(_error_message, server, path, body) for path, body, _ in faulty]
            answers = [pool.submit(client.chat.completions.create, **greedy) for _ in range(4)]
            for (path, _, where), failure in zip(faulty, failures):
                status, message = failure.result()
                assert status in (500, 200) and f"failed {where}" in message and "RuntimeError: injected" in message
                assert re.match(r"request \S+ failed", message), message
            assert [a.result().choices[0].message.content for a in answers] == [want] * 4
        _wait_until(lambda: _idle(_metrics(server)), "the server is idle")
        assert server.process.poll() is None and httpx.get(server.url + "/health").status_code == 200
        assert client.chat.completions.create(**greedy).choices[0].message.content == want
