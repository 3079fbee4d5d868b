"""The HTTP server, as a client sees it: a real `vlm-serve serve` subprocess driven by the official
`openai` client (and raw HTTP for what the client would refuse to send)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ServerProcess, openai_client, running_server
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image, make_video

pytestmark = pytest.mark.server  # every test here starts a real server

API_KEY = "sk-test"
LIMIT_MM = 3
MAX_MEDIA_MB = 1
KV_TOKENS = 3072  # smaller than the context (4096): some prompts fit the context but never the KV pool


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str, **options) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **options}


def ask(*parts: dict, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    make_image(96, 64, seed=1).save(folder / "cat.png")
    make_video(folder / "clip.mp4", num_frames=8, fps=4, size=(64, 48), seed=2)
    return folder


@pytest.fixture(scope="module")
def server(tiny_moe_dir: Path, media_dir: Path):
    with running_server(
        tiny_moe_dir,
        "--api-key",
        API_KEY,
        "--allowed-local-media-path",
        str(media_dir),
        "--limit-mm-per-prompt",
        str(LIMIT_MM),
        "--max-media-mb",
        str(MAX_MEDIA_MB),
        "--max-total-tokens",
        str(KV_TOKENS),
        "--context-length",
        "4096",
        "--mm-max-frames",
        "32",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


@pytest.fixture(scope="module")
def engine(tiny_moe_dir: Path):
    with Engine(tiny_moe_dir, vit_dp=0) as e:
        yield e


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def assert_idle(server: ServerProcess) -> None:
    m = metrics(server)
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_encoding", "kv_cache_usage"):
        assert m[f"vlm_serve:{gauge}"] == 0, gauge
    assert httpx.get(server.url + "/health").status_code == 200


def wait_until_idle(server: ServerProcess, timeout: float = 10) -> None:
    """The scheduler applies aborts within a step or two of a client leaving."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["vlm_serve:num_requests_running"] == 0 and m["vlm_serve:kv_cache_usage"] == 0:
            break
        time.sleep(0.1)
    assert_idle(server)


# ---- answers ------------------------------------------------------------------------------------------


def test_chat_with_an_image_gives_the_engines_greedy_answer(client, engine, model):
    messages = ask(image_part(data_url(make_image(80, 60, seed=3))))
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    expected = engine.chat(messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.object == "chat.completion" and reply.model == model


def test_streamed_video_answer_equals_the_whole_answer_and_the_engines(client, engine, model, media_dir):
    video = {"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}, "fps": 2}
    messages = ask(video, text="What happens?")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert streamed == whole.choices[0].message.content == engine.chat(messages, max_tokens=10, temperature=0).text
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    [media] = usage.prompt_tokens_details.media
    assert media["type"] == "video" and media["tokens"] > 0


def test_n_choices_with_a_seed_are_the_engines_choices(client, engine, model):
    messages = ask(image_part(data_url(make_image(64, 64, seed=4))))
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    expected = engine.chat(messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [c.text for c in expected.choices]
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in expected.choices)


def test_a_stop_string_ends_the_answer_before_it(client, model):
    messages = ask(text="Tell me a story.")
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text[: text.index(stop)]


def test_logprobs_of_greedy_tokens_are_the_best_alternatives(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ask(text="Hi"), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    assert "".join(t.token for t in content) == reply.choices[0].message.content


def test_usage_counts_cached_and_image_tokens(client, engine, model):
    messages = ask(image_part(data_url(make_image(120, 90, seed=5))), text="Describe it twice.")
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    [item] = engine.processor.process_messages(messages).mm_items
    merge = engine.processor.image_processor.config.merge_size
    assert second.usage.prompt_tokens_details.media == [{"type": "image", "tokens": item.num_tokens(merge)}]


def test_local_image_files_under_the_allowed_folder(client, engine, model, media_dir):
    messages = ask(image_part(str(media_dir / "cat.png"), max_pixels=64 * 64))
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == engine.chat(messages, max_tokens=6, temperature=0).text


def test_text_completions(client, engine, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.choices[0].text == engine.generate("The capital of France is", max_tokens=8, temperature=0).text
    streamed = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


def test_models_health_metrics_and_the_api_key(server, model, tiny_moe_dir):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert model == tiny_moe_dir.name  # the checkpoint folder's name
    denied = httpx.get(server.url + "/v1/models")
    assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
    assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    m = metrics(server)
    for name in (
        "vlm_serve:embedding_cache_hit_rate",
        "vlm_serve:processor_cache_hit_rate",
        "vlm_serve:prefix_cache_hit_rate",
        'vlm_serve:media_stage_seconds_count{stage="vit"}',
        "vlm_serve:time_to_first_token_seconds_count",
        "vlm_serve:inter_token_latency_seconds_count",
        "vlm_serve:e2e_request_latency_seconds_count",
        "vlm_serve:max_total_tokens",
    ):
        assert name in m, name
    assert m["vlm_serve:max_total_tokens"] == KV_TOKENS
    assert not any(name.startswith("vlm_serve:encoder_load_patches") for name in m)  # on CPU: no encoder processes


def test_flush_cache_empties_the_caches(client, server, model):
    client.chat.completions.create(model=model, messages=ask(image_part(data_url(make_image(50, 50)))), max_tokens=2)
    flushed = httpx.post(server.url + "/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert flushed.status_code == 200
    m = metrics(server)
    assert m["vlm_serve:embedding_cache_usage_bytes"] == 0 and m["vlm_serve:processor_cache_usage_bytes"] == 0


# ---- bad input ----------------------------------------------------------------------------------------

JUNK = "data:image/png;base64," + base64.b64encode(b"this is not a picture").decode()
BIG = "data:image/png;base64," + base64.b64encode(bytes(MAX_MEDIA_MB * 2**20 + 10)).decode()
LONG_TEXT = " ".join(["word"] * 1700)  # 3400 tokens: within the context, beyond the KV pool


def _chat(**overrides) -> dict:
    return {"model": None, "messages": ask(text="Hi"), "max_tokens": 4, **overrides}


BAD_INPUTS = {
    "malformed JSON": (b'{"messages": [', "JSON"),
    "wrong type": (_chat(temperature="hot"), "temperature"),
    "out of range": (_chat(top_p=1.5), "top_p"),
    "n of 0": (_chat(n=0), "n"),
    "no messages": (_chat(messages=[]), "messages"),
    "unknown content part": (_chat(messages=[{"role": "user", "content": [{"type": "audio", "x": 1}]}]), "content"),
    "undecodable image": (_chat(messages=ask(image_part(JUNK))), "cannot decode image"),
    "oversized image": (_chat(messages=ask(image_part(BIG))), "too large"),
    "path outside the allowed folder": (_chat(messages=ask(image_part("/etc/hostname"))), "outside the allowed"),
    "unsupported scheme": (_chat(messages=ask(image_part("ftp://example.com/a.png"))), "scheme"),
    "remote fetching off": (_chat(messages=ask(image_part("http://example.com/a.png"))), "--allowed-media-domains"),
    "too many images": (_chat(messages=ask(*[image_part(JUNK)] * (LIMIT_MM + 1))), "--limit-mm-per-prompt"),
    "pixels above the cap": (_chat(messages=ask(image_part(JUNK, max_pixels=10**9))), "max_pixels"),
    "frames above the cap": (
        _chat(messages=ask({"type": "video_url", "video_url": {"url": "x.mp4"}, "max_frames": 1000})),
        "max_frames",
    ),
    "longer than the context": (_chat(max_tokens=5000), "context length"),
    "never fits the KV pool": (_chat(messages=ask(text=LONG_TEXT), max_tokens=8), "KV cache"),
}


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client, model):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    failures = []
    for case, (body, fragment) in BAD_INPUTS.items():
        if isinstance(body, dict):
            body = {**body, "model": body["model"] or model}
            response = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        else:
            response = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
        error = response.json().get("error", {})
        if response.status_code != 400 or fragment.lower() not in error.get("message", "").lower():
            failures.append(f"{case}: {response.status_code} {response.text[:300]}")
        assert set(error) >= {"message", "type", "code"}, case
    assert not failures, "\n".join(failures)
    reply = client.chat.completions.create(model=model, messages=ask(text="Still there?"), max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert_idle(server)


def test_a_client_that_disconnects_mid_stream_frees_its_request(server, model):
    async def run() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            body = {
                "model": model,
                "messages": ask(text="Go on."),
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                async for event in events(response):
                    if event["choices"][0]["delta"].get("content"):
                        break  # leave after the first words

    aborted = 'vlm_serve:requests_finished_total{reason="abort"}'
    before = metrics(server)[aborted]
    asyncio.run(run())
    wait_until_idle(server)  # the server notices the closed connection at its next write
    assert metrics(server)[aborted] == before + 1


async def events(response: httpx.Response):
    """The JSON events of an SSE response, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


# ---- load ---------------------------------------------------------------------------------------------


def test_200_concurrent_streams_with_a_quarter_of_clients_leaving(server, model):
    images = [data_url(make_image(64 + 8 * i, 64, seed=10 + i)) for i in range(8)]

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": model,
            "messages": ask(image_part(images[i % len(images)]), text=f"Request {i}."),
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
        }
        leaves = i % 4 == 0
        finish = None
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for event in events(response):
                choice = event["choices"][0]
                if leaves and choice["delta"].get("content"):
                    return "left"
                finish = choice.get("finish_reason") or finish
        return finish

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(limits=limits, headers=headers, timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(run())
    assert results.count("left") == 50
    assert results.count("length") == 150
    wait_until_idle(server)
