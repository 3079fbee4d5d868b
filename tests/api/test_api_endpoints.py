"""The server's API around completions, as a client sees it: clients that give up on a non-streaming
request free it, /tokenize and /detokenize (vLLM's shapes), /v1/models/{id}, /version, and which model
names a request may use. One real `vlm-serve serve` subprocess, driven by the official `openai` client
where it can send the request and by httpx otherwise."""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata
import io
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ServerProcess, openai_client, running_server
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server  # every test here starts a real server

API_KEY = "sk-endpoints"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED = "test-org/tiny-vl"  # a served name with a '/', as hub ids have
CONTEXT = 4096
UNKNOWN = "gpt-17"
NOT_FOUND = {
    "message": f"The model `{UNKNOWN}` does not exist.", "type": "not_found_error", "param": "model",
    "code": "model_not_found",
}  # fmt: skip
ABORTED = 'vlm_serve:requests_finished_total{reason="abort"}'


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(text: str, image=None) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}] if image is not None else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def server(tiny_moe_dir: Path):
    with running_server(
        tiny_moe_dir, "--api-key", API_KEY, "--served-model-name", SERVED, "--context-length", str(CONTEXT)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for name, value in [line.rsplit(" ", 1)]
    }


def wait_until_idle(server: ServerProcess, timeout: float = 120) -> dict[str, float]:
    """The metrics once nothing runs, waits or encodes and the KV cache is free (generous deadline)."""
    gauges = ("num_requests_running", "num_requests_waiting", "num_requests_encoding", "kv_cache_usage")
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        busy = {g: m[f"vlm_serve:{g}"] for g in gauges if m[f"vlm_serve:{g}"] != 0}
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
        time.sleep(0.2)


# ---- clients that go away ------------------------------------------------------------------------------


def test_non_streaming_requests_whose_clients_give_up_are_aborted(server, client):
    before = wait_until_idle(server)
    images = [make_image(64 + 16 * i, 64, seed=i) for i in range(4)]

    async def give_up(http: openai.AsyncOpenAI, i: int) -> None:
        long = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
        if i % 4 == 3:
            await http.completions.create(model=SERVED, prompt=f"Request {i} goes on", **long)
        else:
            image = images[i % 4] if i % 2 == 0 else None
            await http.chat.completions.create(model=SERVED, messages=ask(f"Request {i}.", image), **long)

    async def run() -> list[BaseException | None]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=0.5) as http:
            return await asyncio.gather(*(give_up(http, i) for i in range(200)), return_exceptions=True)

    outcomes = asyncio.run(run())
    assert all(isinstance(o, openai.APITimeoutError) for o in outcomes), {type(o).__name__ for o in outcomes}

    # the aborted requests no longer hold the batch: a short one answers at once
    reply = client.with_options(timeout=5).chat.completions.create(
        model=SERVED, messages=ask("Still there?"), max_tokens=10, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 10

    after = wait_until_idle(server)
    started = after["vlm_serve:requests_total"] - before["vlm_serve:requests_total"] - 1  # less the short one
    assert started > 0  # some reached the scheduler before their clients left...
    assert after[ABORTED] - before[ABORTED] == started  # ...and every one of them was aborted


def test_answers_that_finish_normally_are_not_aborted(server, client):
    before = wait_until_idle(server)
    messages = ask("Describe it.", make_image(80, 60, seed=9))
    whole = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    text = client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens > 0
    after = wait_until_idle(server)
    assert after["vlm_serve:requests_total"] - before["vlm_serve:requests_total"] == 3
    assert after[ABORTED] == before[ABORTED]


# ---- /tokenize and /detokenize -------------------------------------------------------------------------


def test_tokenize_a_prompt_as_text_completions_count_it(server, client):
    prompt = "The quick brown fox jumps over the lazy dog."
    out = post(server, "/tokenize", {"model": SERVED, "prompt": prompt})
    assert out.status_code == 200, out.text
    body = out.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == CONTEXT
    reply = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1)
    assert body["count"] == reply.usage.prompt_tokens
    assert post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json() == body  # no BOS/EOS
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": prompt}


def test_tokenize_chat_messages_as_chat_completions_render_them(server, client):
    messages = ask("What is in the picture?", make_image(96, 64, seed=3))
    body = post(server, "/tokenize", {"model": "default", "messages": messages}).json()
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == reply.usage.prompt_tokens  # the image's tokens included
    [media] = reply.usage.prompt_tokens_details.media
    text = post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert text.count("<|image_pad|>") == media["tokens"] > 0
    assert text.endswith("<|im_start|>assistant\n")

    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json()["prompt"] == text.removesuffix(
        "<|im_start|>assistant\n"
    )

    started = [*ask("Name a colour."), {"role": "assistant", "content": "My favourite colour is"}]
    cont = post(server, "/tokenize", {"messages": started, "continue_final_message": True})
    assert cont.status_code == 200, cont.text
    continued = post(server, "/detokenize", {"tokens": cont.json()["tokens"]}).json()["prompt"]
    assert continued.endswith("assistant\nMy favourite colour is")


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/tokenize", {"model": SERVED}, "send `prompt` or `messages`"),
        ("/tokenize", {"prompt": 7}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": ask("Hi"), "continue_final_message": True, "add_generation_prompt": True},
            "cannot set both `continue_final_message` and `add_generation_prompt`",
        ),
        (
            "/tokenize",
            {"messages": [*ask("Hi"), {"role": "assistant", "content": ""}], "continue_final_message": True},
            "final message",
        ),
        ("/detokenize", {"tokens": [1, 2, 10**6]}, "token id 1000000 is outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "token id -1 is outside the vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ],
    ids=[
        "neither prompt nor messages",
        "prompt not text",
        "no messages",
        "continue and generation prompt",
        "nothing to continue",
        "id beyond the vocabulary",
        "negative id",
        "id not an integer",
    ],
)
def test_bad_tokenizer_requests_are_400s_naming_the_problem(server, path, body, fragment):
    out = post(server, path, body)
    assert out.status_code == 400, out.text
    assert fragment in out.json()["error"]["message"]


# ---- models and version --------------------------------------------------------------------------------


def test_one_model_card_by_its_id_or_default(server, client):
    [listed] = client.models.list().data
    card = client.models.retrieve(SERVED)  # the client sends the '/' as %2F
    assert card.id == listed.id == SERVED and card.object == "model"
    assert card.model_dump()["max_model_len"] == CONTEXT
    assert client.models.retrieve("default").id == SERVED
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(UNKNOWN)
    assert caught.value.status_code == 404 and caught.value.body == NOT_FOUND


def test_version_is_the_packages(server):
    out = httpx.get(server.url + "/version", headers=AUTH)
    assert out.status_code == 200 and out.json() == {"version": importlib.metadata.version("vlm_serve")}


def test_default_names_the_served_model_and_others_are_404(server, client):
    chat = client.chat.completions.create(model="default", messages=ask("Hi"), max_tokens=2)
    text = client.completions.create(model="default", prompt="Hi", max_tokens=2)
    assert chat.model == text.model == SERVED
    assert post(server, "/detokenize", {"model": "default", "tokens": [1]}).status_code == 200
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=UNKNOWN, messages=ask("Hi"), max_tokens=2)
    assert caught.value.body == NOT_FOUND
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=UNKNOWN, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=UNKNOWN, messages=ask("Hi"), max_tokens=2, stream=True)
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        out = post(server, path, {"model": UNKNOWN, **body})
        assert out.status_code == 404 and out.json() == {"error": NOT_FOUND}, path
    out = httpx.get(f"{server.url}/v1/models/{UNKNOWN}", headers=AUTH)
    assert out.status_code == 404 and out.json() == {"error": NOT_FOUND}
