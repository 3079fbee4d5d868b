"""Features combined as users combine them: hypothesis draws valid requests to every generating endpoint
(`vlm_serve.testing.requests.calls`: images, a video, streaming, n, seeds, sampling filters, penalties,
logit bias, stops, min_tokens, log-probs, structured output, tools) and sends them to each set-up of the
built-in model (`vlm_serve.testing.deployments.SETUPS`: the default with EAGLE-3 drafts in the overlap loop,
the same in the normal loop, n-gram drafts, the overlap and normal loops (the latter with an encoder
process, as on a GPU), small prefill chunks on pages of 4 and TP 2 / EP 2 with an encoder pool of 2 (these two
with a KV pool of 2,048 tokens over a host-memory tier, the latter also over a storage tier; the former
also serving a LoRA adapter, through which some of its requests go), a PD pair behind sglang-router, its
prefill server with a host tier), and the built-in model in 4 bits (W4A16: its float EAGLE-3 head, small
chunks, the adapter over the 4-bit base) and in int8 (W8A8: n-gram drafts in the normal loop, pages of 16
over a host tier, the adapter). Every request is answered with a 200 and a well-formed answer
(`vlm_serve.testing.answers.problems`); a deterministic one answers the same a second time (streamed or
not), and a greedy one as the overlap loop without drafts does (a quantized model's as itself); no process dies; afterwards every server
is idle and healthy, failed no request, and stops cleanly.

The draws are derandomized (the same examples every run); a failing one is shrunk by hypothesis (a set-up
that a request took down is started again) and saved whole, as JSON, next to the set-up's logs. benchmarks/fuzz_soak.py runs the same draws for as long as asked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings

from vlm_serve.testing.answers import DONE, Answer, judge, problems, server_problems, strict_json
from vlm_serve.testing.deployments import CLIENT_TIMEOUT, REFERENCE, SETUPS, Deployment, deployed
from vlm_serve.testing.requests import CHAT, COMPLETIONS, Call, calls, pictures

EXAMPLES = {"default": 200}  # per set-up; the default is what most users run, so it gets the most
OTHER_EXAMPLES = 50
# Valid requests the draws found that took the scheduler down (or gave NaN log-probs); each runs first, on
# every set-up: values that float32, the sampler's dtype, rounds to 0 or whose quotients overflow it. (The
# smallest float32, 2**-149, passes sglang-router, which reads floats in 32 bits: a smaller top_p is 0 to it,
# which it refuses.)
TINY = 2**-149
FOUND = [
    {"temperature": TINY},  # probabilities inf/nan
    {"temperature": 1, "repetition_penalty": TINY},  # probabilities inf/nan
    {"repetition_penalty": TINY, "logprobs": 1},  # a log-prob of NaN, which the answer gave as null
]
FOUND_UNROUTED = [
    {"temperature": 1, "top_p": 5e-324},  # the sum of probabilities was 0
    {"temperature": 0.5, "repetition_penalty": 1e-105},  # 0 as a float32: penalized logits inf over the temperature
]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("combined-features")


@pytest.fixture(scope="module")
def reference(logs: Path) -> Iterator[Deployment]:
    """The overlap loop without drafts: greedy answers elsewhere must equal its answers."""
    with deployed(REFERENCE, logs) as deployment:
        yield deployment


@pytest.fixture(scope="module", params=list(SETUPS))
def deployment(request: pytest.FixtureRequest, reference: Deployment, logs: Path) -> Iterator[Deployment]:
    if request.param == REFERENCE:
        yield reference
        return
    with deployed(request.param, logs) as deployment:
        yield deployment


@pytest.mark.server
def test_valid_requests_combining_features_are_answered_well_and_alike(deployment, reference, logs):
    client = httpx.Client(timeout=CLIENT_TIMEOUT)

    @settings(
        max_examples=EXAMPLES.get(deployment.name, OTHER_EXAMPLES),
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(call=calls(router=deployment.routed, adapter=deployment.adapter))
    def answered_well(call: Call) -> None:
        found = judge(client, deployment.url, call, reference.url if deployment.builtin else None)
        for setup in (deployment, reference):
            if failure := setup.failure():
                found.append(failure)
                setup.restart()  # (the next example, and the next test, find it serving)
        if found:
            saved = logs / f"failed-{deployment.name}.json"
            saved.write_text(json.dumps({**call.as_json(), "setup": deployment.name, "problems": found}, indent=1))
            pytest.fail(f"{call}\n" + "\n".join(found) + f"\n(the request in full: {saved})", pytrace=False)

    for settings_found in FOUND + (FOUND_UNROUTED if not deployment.routed else []):
        body = {"model": "default", "prompt": "Hi!", "max_tokens": 1, **settings_found}
        answered_well = example(call=Call(COMPLETIONS, body))(answered_well)
    answered_well()


@pytest.mark.server
def test_a_seeded_answer_is_the_same_alone_and_among_other_requests(deployment):
    """What the soak found (benchmarks/fuzz_soak.py): a seeded request's tokens must not depend on the other
    requests in its batch; here ones without top_k, which change how the batch's probabilities are drawn."""
    client = httpx.Client(timeout=CLIENT_TIMEOUT)
    seeded = {
        "model": "default",
        "prompt": "Tell me a story",
        "max_tokens": 24,
        "temperature": 1,
        "top_k": 20,
        "seed": 1,
    }
    other = {**seeded, "prompt": "Describe this image.", "top_k": -1, "seed": None, "ignore_eos": True}

    def text(body: dict) -> str:
        response = client.post(deployment.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    alone = text(seeded)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(text, other) for _ in range(3)]
        among_others = pool.submit(text, seeded).result()
        for answer in others:
            answer.result()
    assert among_others == alone


@pytest.mark.server
def test_a_picture_arriving_while_others_decode_is_answered_as_when_it_comes_alone(deployment):
    """On CPU a picture that arrives while requests decode is encoded beside them on part of the cores (in
    an encoder process where the set-up has one): its greedy answer is the one it gets alone, and the
    requests it joined are answered."""
    client = httpx.Client(timeout=CLIENT_TIMEOUT)
    picture = {
        "model": "default",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": pictures()[1]}},
                    {"type": "text", "text": "What is in it?"},
                ],
            }
        ],
    }
    running = {
        "model": "default",
        "prompt": "Tell me a long story",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }

    def answer() -> str:
        response = client.post(deployment.url + "/v1/chat/completions", json=picture)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    def flush() -> None:  # (else the picture comes from the caches, not the encoder)
        for url in deployment.servers:
            assert client.post(url + "/flush_cache").status_code == 200

    alone = answer()
    flush()
    with client.stream("POST", deployment.url + "/v1/completions", json=running) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it decodes now
        assert answer() == alone
        assert "data: [DONE]" in list(lines)


@pytest.mark.server
def test_afterwards_every_server_is_idle_healthy_and_whole(deployment):
    failure = deployment.failure()
    assert not failure, failure
    client = httpx.Client(timeout=60)
    found = [problem for url in deployment.servers for problem in server_problems(client, url)]
    assert not found, "\n".join(found)


# ---- the checks themselves (no server) ---------------------------------------------------------------


def chat_answer(*contents: str, finish: str = "length", tokens: int = 2, logprobs: bool = False) -> dict:
    """A chat completion body as a server answers: one choice per content, `tokens` each."""
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": {"content": [entry] * tokens} if logprobs else None,
        }
        for i, text in enumerate(contents)
    ]
    completion = tokens * len(contents)
    usage = {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}
    return {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": choices, "usage": usage}


ASK = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "body, answer, problem",
    [
        (ASK, chat_answer("ab"), None),
        ({**ASK, "n": 2}, chat_answer("ab"), "1 choices, not 2"),
        ({**ASK, "max_tokens": 3}, chat_answer("ab"), "finished for its length after 2 tokens, not 3"),
        ({**ASK, "logprobs": True}, chat_answer("ab", tokens=2), "choice 0 has no log-probs"),
        ({**ASK, "logprobs": True, "top_logprobs": 1}, chat_answer("ab", logprobs=True), "alternatives per token"),
        ({**ASK, "min_tokens": 2}, chat_answer("a", finish="stop", tokens=1), "fewer than min_tokens=2"),
        ({**ASK, "regex": "(yes|no)"}, chat_answer("maybe", finish="stop"), "does not follow its constraint"),
        ({**ASK, "response_format": {"type": "json_object"}}, chat_answer("{", finish="stop"), "not JSON"),
    ],
    ids=["well-formed", "choices", "length", "no-logprobs", "alternatives", "min-tokens", "regex", "json"],
)
def test_the_checks_find_what_a_client_would_trip_on(body, answer, problem):
    found = problems(Call(CHAT, body), Answer(200, body=answer))
    assert any(problem in p for p in found) if problem else not found, found


def test_a_stream_must_end_with_done_and_carry_usage_where_asked():
    choice = {"index": 0, "delta": {"role": "assistant", "content": "ab"}, "finish_reason": "length"}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    stream = {**ASK, "stream": True, "stream_options": {"include_usage": True}}
    assert "the stream does not end with one [DONE]" in problems(Call(CHAT, stream), Answer(200, events=[chunk]))
    assert any("include_usage" in p for p in problems(Call(CHAT, stream), Answer(200, events=[chunk, DONE])))
    with pytest.raises(ValueError, match="-Infinity is not JSON"):
        strict_json('{"logprob": -Infinity}')
