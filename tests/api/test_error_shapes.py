"""Every error the server answers is in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`
(`type` one of OpenAI's error types, `code` a string naming the cause or null), with the status that says
whose fault it is — also for what FastAPI and Starlette refuse themselves
(bodies that are not JSON or not UTF-8, unknown routes, wrong methods) and for requests that would once
have crashed or been misread (a lone UTF-16 surrogate, `max_tokens: 0`, an out-of-range seed). Anything
unexpected is a 500 in the same shape whose message holds only a request id; the traceback goes to the log.
The API key can come from $VLM_SERVE_API_KEY or a file, and shows in no command line, log or error. Every
response carries an `x-request-id` header: the client's own, or a new one.

Through a real `vlm-serve serve` whose key comes from the environment, with raw HTTP (httpx) so that the
bodies are exactly what a client gets; after each bad request a valid greedy one gets the same answer as
before it."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from helpers import ServerProcess, descendants, openai_client, start_server
from vlm_serve.caption import caption_images, plan_captions
from vlm_serve.cli import main
from vlm_serve.config import API_KEY_ENV, ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.errors import ERROR_TYPES, ApiError
from vlm_serve.messages.frontend import StrOut
from vlm_serve.multimodal.video import write_video
from vlm_serve.server.http_server import ServerState, create_app  # (it loads every module defining errors)
from vlm_serve.server.openai_api import OpenAIServing
from vlm_serve.testing.media import jpeg_stating, make_image, png_stating

API_KEY = "sk-shapes-4f1c9b27e0d3"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "Hi"}]
SEED_MAX = 2**63 - 1
MAX_IMAGE_PIXELS = 100 * 100  # the server's --max-image-pixels


@pytest.fixture(scope="module")
def server(tiny_moe_dir: Path):
    with pytest.MonkeyPatch.context() as env:  # the server process takes its environment when it starts
        env.setenv(API_KEY_ENV, API_KEY)
        srv = start_server(tiny_moe_dir, "--context-length", "2048", "--max-image-pixels", str(MAX_IMAGE_PIXELS))
    try:
        yield srv
    finally:
        assert srv.stop() == 0, "".join(srv.output)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


def greedy_answer(client: openai.OpenAI) -> str:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def baseline(client: openai.OpenAI) -> str:
    return greedy_answer(client)


def chat(**fields) -> bytes:
    """A chat completion body; surrogates are written as JSON escapes (`json.dumps` keeps ASCII)."""
    return json.dumps({"messages": HI, "max_tokens": 4, **fields}).encode()


def media_url(data: bytes | Image.Image, media_type: str = "image/png") -> str:
    """A data URL of encoded media, or of a picture as a PNG."""
    if isinstance(data, Image.Image):
        buffer = io.BytesIO()
        data.save(buffer, "PNG")
        data = buffer.getvalue()
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def asking(*parts: dict, earlier: list[dict] = ()) -> list[dict]:
    """Messages: `earlier` ones, then a user message of `parts` and a question."""
    return [*earlier, {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video(width: int, height: int) -> dict:
    buffer = io.BytesIO()
    write_video(buffer, [make_image(width, height, seed=i) for i in range(4)], fps=2)
    return {"type": "video_url", "video_url": {"url": media_url(buffer.getvalue(), "video/mp4")}}


JUNK_IMAGE = image(media_url(b"hello"))
HUGE_PNG = image(media_url(png_stating(20000, 20000)))
TEXT_PART = {"type": "text", "text": "Look."}


def assert_openai_error(response: httpx.Response, status: int, kind: str, fragment: str, param=None, code=None):
    """The response is `status` with exactly OpenAI's error object: its message holds `fragment`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body  # never FastAPI's {"detail": ...}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == kind and error["type"] in ERROR_TYPES and fragment in error["message"], error
    assert error["param"] == param and error["code"] == code, error
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), response.headers
    return error


# ---- what a client can send wrong -----------------------------------------------------------------------

C, B = "/v1/chat/completions", "invalid_request_error"
BAD = {  # name: (method, path, body, status, type, fragment in the message, param)
    "unknown route": ("GET", "/v1/nothing", None, 404, "not_found_error", "no such route: GET /v1/nothing", None),
    "unknown route, posted": ("POST", "/v2/chat/completions", chat(), 404, "not_found_error", "no such route", None),
    "wrong method": (
        "GET", "/v1/chat/completions", None, 405, "invalid_request_error",
        "/v1/chat/completions does not take GET (only POST)", None,
    ),
    "wrong method on a GET route": ("POST", "/v1/models", b"{}", 405, "invalid_request_error", "only GET", None),
    "malformed JSON": (
        "POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error", "not valid JSON", None
    ),
    "not UTF-8": (
        "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', 400,
        "invalid_request_error", "not valid UTF-8", None,
    ),
    "nested too deep": ("POST", "/v1/completions", b"[" * 100_000, 400, "invalid_request_error", "parsing the body", None),
    "not an object": ("POST", "/v1/completions", b"[1, 2]", 400, "invalid_request_error", "invalid request", None),
    "template data of the wrong type": (
        "POST", "/v1/chat/completions", chat(chat_template_kwargs={"tools": 5}), 400, "invalid_request_error",
        "the chat template cannot render these messages", None,
    ),
    "lone surrogate in a text part": (
        "POST", "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi \ud800 there"}]}]),
        400, "invalid_request_error", "lone UTF-16 surrogate \\ud800", "messages.0.content.0.text",
    ),
    "lone surrogate in a message": (
        "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "\udfff"}]),
        400, "invalid_request_error", "lone UTF-16 surrogate \\udfff", "messages.0.content",
    ),
    "lone surrogate as UTF-8 bytes": (  # Python's JSON decoder lets these through as a surrogate too
        "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi \xed\xa0\x80"}]}',
        400, "invalid_request_error", "lone UTF-16 surrogate \\ud800", "messages.0.content",
    ),
    "lone surrogate in a stop string": (
        "POST", "/v1/chat/completions", chat(stop=["END", "x\udc00"]), 400, "invalid_request_error", "surrogate", "stop.1"
    ),
    "lone surrogate in a prompt": (
        "POST", "/v1/completions", json.dumps({"prompt": "Once \ud83d upon", "max_tokens": 4}).encode(),
        400, "invalid_request_error", "surrogate \\ud83d", "prompt",
    ),
    "lone surrogate in a prompt to tokenize": (
        "POST", "/tokenize", json.dumps({"prompt": "\ud800"}).encode(), 400, "invalid_request_error", "surrogate", "prompt"
    ),
    "lone surrogate in a key": (
        "POST", "/v1/chat/completions", chat(chat_template_kwargs={"x\udc00": 1}),
        400, "invalid_request_error", "surrogate", "chat_template_kwargs.x\\udc00",
    ),
    "max_tokens 0": (
        "POST", "/v1/chat/completions", chat(max_tokens=0), 400, "invalid_request_error",
        "max_tokens: Input should be greater than or equal to 1", "max_tokens",
    ),
    "max_completion_tokens 0": (
        "POST", "/v1/chat/completions", json.dumps({"messages": HI, "max_completion_tokens": 0}).encode(),
        400, "invalid_request_error", "max_completion_tokens", "max_completion_tokens",
    ),
    "max_tokens 0 for a completion": (
        "POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 0}).encode(),
        400, "invalid_request_error", "max_tokens", "max_tokens",
    ),
    "negative max_tokens, streamed": (
        "POST", "/v1/chat/completions", chat(max_tokens=-1, stream=True), 400, "invalid_request_error", "max_tokens",
        "max_tokens",
    ),
    "seed above int64": (
        "POST", "/v1/chat/completions", chat(seed=SEED_MAX + 1), 400, "invalid_request_error",
        f"seed: Input should be less than or equal to {SEED_MAX}", "seed",
    ),
    "seed below int64": (
        "POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "seed": -SEED_MAX - 2}).encode(),
        400, "invalid_request_error", "seed: Input should be greater than or equal to", "seed",
    ),
    "seed not an integer": ("POST", "/v1/chat/completions", chat(seed=1.5), 400, "invalid_request_error", "seed", "seed"),
    "unknown model": (
        "POST", "/v1/chat/completions", chat(model="gpt-17"), 404, "not_found_error",
        "The model `gpt-17` does not exist.", "model",
    ),
    # sampling settings, checked by the request models or by SamplingParams
    "temperature above 2": ("POST", C, chat(temperature=2.5), 400, B, "temperature: Input should be less than or equal to 2", "temperature"),
    "top_p 0": ("POST", C, chat(top_p=0), 400, B, "top_p: Input should be greater than 0", "top_p"),
    "top_k 0": ("POST", C, chat(top_k=0), 400, B, "top_k must be -1 (off) or >= 1, not 0", None),
    "n 0": ("POST", C, chat(n=0), 400, B, "n: Input should be greater than or equal to 1", "n"),
    "n too big": ("POST", C, chat(n=1000), 400, B, "n: Input should be less than or equal to 128", "n"),
    "empty stop string": ("POST", C, chat(stop=[""]), 400, B, "stop strings must be non-empty", None),
    "top_logprobs 21": ("POST", C, chat(logprobs=True, top_logprobs=21), 400, B, "less than or equal to 20", "top_logprobs"),
    "top_logprobs without logprobs": ("POST", C, chat(top_logprobs=3), 400, B, "top_logprobs=3 needs logprobs=True", None),
    "frequency_penalty 3": ("POST", C, chat(frequency_penalty=3), 400, B, "frequency_penalty", "frequency_penalty"),
    "repetition_penalty 0": ("POST", C, chat(repetition_penalty=0), 400, B, "repetition_penalty", "repetition_penalty"),
    "min_tokens above max_tokens": ("POST", C, chat(min_tokens=10), 400, B, "min_new_tokens must be in [0, max_new_tokens=4]", None),
    "stream_options without stream": ("POST", C, chat(stream_options={"include_usage": True}), 400, B, "`stream_options` can only be set", None),
    "prompt_logprobs streamed": ("POST", C, chat(prompt_logprobs=2, stream=True), 400, B, "prompt_logprobs are not available", None),
    # structured output and tools
    "unknown response_format": ("POST", C, chat(response_format={"type": "yaml"}), 400, B, "response_format.type", "response_format.type"),
    "invalid regex": ("POST", C, chat(regex="(a"), 400, B, "invalid regex: Regex parsing error", None),
    "invalid json schema": (
        "POST", C, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        400, B, 'invalid json_schema: Unsupported type "nope"', None,
    ),
    "logit_bias key": ("POST", C, chat(logit_bias={"abc": 1}), 400, B, "logit_bias keys must be token ids", None),
    "logit_bias outside the vocabulary": ("POST", C, chat(logit_bias={"99999999": 1}), 400, B, "logit_bias token id 99999999", None),
    "stop_token_ids outside the vocabulary": ("POST", C, chat(stop_token_ids=[99999999]), 400, B, "stop_token_ids token id 99999999", None),
    "tool_choice naming an unknown function": (
        "POST", C, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
        400, B, "tool_choice names the function 'g'", None,
    ),
    "tool_choice without tools": ("POST", C, chat(tool_choice="required"), 400, B, "tool_choice 'required' needs `tools`", None),
    # messages and media
    "continuing a user message": ("POST", C, chat(continue_final_message=True), 400, B, "must be an assistant", None),
    "no messages": ("POST", C, json.dumps({"messages": [], "max_tokens": 4}).encode(), 400, B, "at least 1 item", "messages"),
    "message without a role": ("POST", C, chat(messages=[{"content": "Hi"}]), 400, B, "Field required", "messages.0.role"),
    "unknown part type": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]), 400, B,
        "Input tag 'audio'", "messages.0.content.parts.0",
    ),
    "image_url a bare string": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,xx"}]}]),
        400, B, "image_url must be an object", "messages.0.content.parts.0.image_url.image_url",
    ),
    "image that does not decode": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]),
        400, B, "cannot decode image", "messages[0].content[0]",
    ),
    "local file without an allowed folder": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]),
        400, B, "local image files are not allowed", "messages[0].content[0]",
    ),
    "remote URL without allowed domains": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]),
        400, B, "remote image URLs are disabled", "messages[0].content[0]",
    ),
    "bad image in the second message's third part": (
        "POST", C, chat(messages=asking(TEXT_PART, image(media_url(make_image(32, 32))), JUNK_IMAGE, earlier=HI)),
        400, B, "cannot decode image", "messages[1].content[2]",
    ),
    "data URL not in base64, after a video": (
        "POST", C, chat(messages=asking(video(64, 48), image("data:image/png,raw"))),
        400, B, "only base64-encoded data URLs are supported", "messages[0].content[1]",
    ),
    "video that does not decode": (
        "POST", C, chat(messages=asking({"type": "video_url", "video_url": {"url": media_url(b"hi", "video/mp4")}})),
        400, B, "cannot decode video", "messages[0].content[0]",
    ),
    "PNG over --max-image-pixels": (
        "POST", C, chat(messages=asking(TEXT_PART, image(media_url(make_image(101, 100))))), 400, B,
        "image is 101 x 100 = 10100 pixels, more than the limit of 10000 (--max-image-pixels)",
        "messages[0].content[1]",
    ),
    "20000 x 20000 JPEG": (
        "POST", C, chat(messages=asking(image(media_url(jpeg_stating(20000, 20000), "image/jpeg")))), 400, B,
        "image is 20000 x 20000 = 400000000 pixels, more than the limit of 10000 (--max-image-pixels)",
        "messages[0].content[0]",
    ),
    "20000 x 20000 PNG, streamed": (
        "POST", C, chat(messages=asking(TEXT_PART, TEXT_PART, HUGE_PNG), stream=True),
        400, B, "image is 20000 x 20000 = 400000000 pixels, more than the limit of 10000", "messages[0].content[2]",
    ),
    "video frames over --max-image-pixels": (
        "POST", C, chat(messages=asking(TEXT_PART, video(128, 96))), 400, B,
        "each video frame is 128 x 96 = 12288 pixels, more than the limit of 10000 (--max-image-pixels)",
        "messages[0].content[1]",
    ),
    "bad image to tokenize": (
        "POST", "/tokenize", json.dumps({"messages": asking(TEXT_PART, JUNK_IMAGE)}).encode(), 400, B,
        "cannot decode image", "messages[0].content[1]",
    ),
    "max_pixels above the server's cap": (
        "POST", C, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}, "max_pixels": 10**12}]}]),
        400, B, "exceeds this server's limit", None,
    ),
    # prompts the scheduler refuses
    "prompt longer than the context": (
        "POST", "/v1/completions", json.dumps({"prompt": [100] * 3000, "max_tokens": 4}).encode(), 400, B,
        "This model's maximum context length is 2048 tokens. However, you requested 3004 tokens (3000 in the "
        "messages, 4 in the completion): the prompt is too long. Please reduce the length of the messages or completion.", "messages",
    ),
    "empty prompt list": ("POST", "/v1/completions", json.dumps({"prompt": [], "max_tokens": 4}).encode(), 400, B, "empty list", "prompt"),
    "token id outside the vocabulary": (
        "POST", "/v1/completions", json.dumps({"prompt": [99999999], "max_tokens": 4}).encode(), 400, B,
        "token id 99999999 is outside the vocabulary", None,
    ),
}  # fmt: skip


# refusals whose cause has a name of its own (the others' `code` is null)
CODES = {
    "invalid regex": "invalid_grammar",
    "invalid json schema": "invalid_grammar",
    "prompt longer than the context": "context_length_exceeded",
    "wrong method": "method_not_allowed",
    "wrong method on a GET route": "method_not_allowed",
}


@pytest.mark.server
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_gets_an_openai_error_and_the_next_answer_is_unchanged(server, client, baseline, case):
    method, path, body, status, kind, fragment, param = BAD[case]
    response = httpx.request(method, server.url + path, content=body, headers={**AUTH, **JSON}, timeout=60)
    code = CODES.get(case, "model_not_found" if param == "model" else None)
    error = assert_openai_error(response, status, kind, fragment, param, code)
    if status == 405:
        assert response.headers["Allow"] in error["message"]
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_the_openai_client_raises_these_errors_with_their_param(client, baseline):
    cases = [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2, "seed": SEED_MAX + 1}, "seed")]
    for options, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="default", messages=HI, **options)
        assert caught.value.status_code == 400 and caught.value.body["param"] == param
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_a_prompt_over_the_context_raises_context_length_exceeded_in_the_openai_client(client, baseline):
    long_text = "the sea " * 1500
    for stream in (False, True):  # a refused stream is an error status too, not a stream
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": long_text}], max_tokens=8, stream=stream
            )
        assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
        assert caught.value.body["message"].startswith(
            "This model's maximum context length is 2048 tokens. However, you requested"
        )
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_every_response_has_a_request_id_the_clients_own_when_it_sends_one(server, client):
    answer = client.chat.completions.create(model="default", messages=HI, max_tokens=2)
    assert re.fullmatch(r"[0-9a-f]{32}", answer._request_id)  # the openai client reads the header
    mine = client.chat.completions.with_raw_response.create(
        model="default", messages=HI, max_tokens=2, extra_headers={"x-request-id": "trace-42"}
    )
    assert mine.request_id == "trace-42"
    refused = httpx.post(
        server.url + "/v1/chat/completions",
        content=chat(max_tokens=0),
        headers={**AUTH, **JSON, "x-request-id": "trace-43"},
    )
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "trace-43"
    unauthorized = httpx.get(server.url + "/v1/models", headers={"x-request-id": "trace-44"})
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "trace-44"
    streamed = httpx.post(
        server.url + "/v1/chat/completions",
        content=chat(stream=True),
        headers={**AUTH, **JSON, "x-request-id": "trace-45"},
    )
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "trace-45"


def _subclasses(cls: type) -> list[type]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


def test_every_error_the_server_can_raise_has_an_openai_type_and_a_string_or_null_code():
    for kind in _subclasses(ApiError):
        assert kind.kind in ERROR_TYPES and (kind.code is None or isinstance(kind.code, str)), kind
    # failures reported by the processes behind the HTTP one (their status decides the class)
    for status in (400, 500, 503):
        error = StrOut.failed("r", status, "encoder_error", "why").failure()
        assert error.kind in ERROR_TYPES and error.code == "encoder_error" and error.status == status
    assert StrOut.failed("r", 400, "", "why").failure().code is None


@pytest.mark.server
def test_pictures_and_video_frames_up_to_the_pixel_limit_are_served(client, baseline):
    at_limit = [image(media_url(make_image(100, 100))), image(media_url(make_image(125, 80))), video(96, 96)]
    jpeg = io.BytesIO()
    make_image(100, 100, seed=1).save(jpeg, "JPEG")
    for part in [*at_limit, image(media_url(jpeg.getvalue(), "image/jpeg"))]:
        reply = client.chat.completions.create(model="default", messages=asking(part), max_tokens=2, temperature=0)
        assert reply.model_dump()["usage"]["prompt_tokens_details"]["media"][0]["tokens"] > 0
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_the_openai_client_sees_the_failing_part_streamed_or_not(client, baseline):
    messages = asking(TEXT_PART, HUGE_PNG, earlier=HI)
    for stream in (False, True):  # a refused stream is an error status, not a stream
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="default", messages=messages, max_tokens=2, stream=stream)
        assert caught.value.param == "messages[1].content[1]" and "(--max-image-pixels)" in caught.value.message
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_a_paired_surrogate_escape_is_a_character_not_an_error(server, client, baseline):
    body = json.dumps({"messages": [{"role": "user", "content": "Hi \U0001f600"}], "max_tokens": 2}).encode()
    assert b"\\ud83d\\ude00" in body  # the emoji as JSON spells it: a valid surrogate pair
    response = httpx.post(server.url + "/v1/chat/completions", content=body, headers={**AUTH, **JSON}, timeout=60)
    assert response.status_code == 200, response.text
    assert greedy_answer(client) == baseline


# ---- the API key ----------------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", API_KEY, f"Basic {API_KEY}"],
    ids=["missing", "wrong", "longer", "a prefix", "without Bearer", "another scheme"],
)
def test_a_request_without_the_key_is_a_401_that_does_not_show_it(server, client, baseline, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = httpx.post(server.url + "/v1/chat/completions", content=chat(), headers={**headers, **JSON})
    assert_openai_error(response, 401, "authentication_error", "missing or invalid API key", code="invalid_api_key")
    assert API_KEY not in response.text
    assert greedy_answer(client) == baseline


@pytest.mark.server
def test_the_key_from_the_environment_is_in_no_command_line_environment_or_log(server, client):
    assert client.models.list().data  # the key from $VLM_SERVE_API_KEY is the one required
    assert httpx.get(server.url + "/health").status_code == 200  # the one path without it
    children = descendants(server.process.pid)
    assert len(children) >= 2  # scheduler and detokenizer (spawned ones: multiprocessing's resource tracker too)
    for pid in [server.process.pid, *children]:
        assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        # the launcher reads the variable, then blanks it: neither it nor its children show it
        assert API_KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
    assert API_KEY not in "".join(server.output)


def test_the_key_comes_from_the_flag_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    environ = {API_KEY_ENV: "sk-from-env"}
    assert ServerArgs(api_key="sk-flag").with_api_key(environ).api_key == "sk-flag"
    from_file = ServerArgs(api_key_file=str(key_file)).with_api_key(environ)
    assert (from_file.api_key, from_file.api_key_file) == ("sk-from-file", None)
    assert ServerArgs().with_api_key(environ).api_key == "sk-from-env"
    assert ServerArgs().with_api_key({}).api_key is None
    assert "sk-flag" not in repr(ServerArgs(api_key="sk-flag"))  # nor in a log of the settings


def test_conflicting_empty_or_unreadable_keys_stop_the_server_before_it_starts(tmp_path, monkeypatch, capsys):
    secret = "sk-never-shown"
    key_file = tmp_path / "key"
    key_file.write_text(f"{secret}\n")
    empty, two_lines = tmp_path / "empty", tmp_path / "two"
    empty.write_text("\n")
    two_lines.write_text(f"{secret}\n{secret}\n")
    cases = [
        (["--api-key", secret, "--api-key-file", str(key_file)], {}, "not both"),
        (["--api-key", ""], {}, "api_key must not be empty"),
        (["--api-key-file", str(empty)], {}, f"the API key file {empty} must hold the key"),
        (["--api-key-file", str(two_lines)], {}, "on one line"),
        (["--api-key-file", str(tmp_path / "missing")], {}, "cannot read the API key file"),
        ([], {API_KEY_ENV: ""}, f"{API_KEY_ENV} is set but empty"),
    ]
    for flags, env, fragment in cases:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # the settings are refused before a model loads or a process starts, so this returns at once
        assert main(["serve", "--model", str(tmp_path), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert fragment in err and secret not in err, err


# ---- what the server itself gets wrong ------------------------------------------------------------------


def test_an_unexpected_exception_is_a_500_with_a_request_id_and_its_traceback_only_in_the_log(caplog):
    """No request makes the real server fail unexpectedly (that would be a bug to fix), so a route that
    raises is added to the app the server runs."""
    app = create_app(None, OpenAIServing(None, ServerArgs(), "m"), ServerState(ready=True), API_KEY)  # type: ignore[arg-type]

    @app.post("/v1/fails")
    async def fails() -> None:
        raise KeyError("an internal detail")

    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.post("/v1/fails", headers=AUTH)
    error = assert_openai_error(response, 500, "server_error", "internal error (request id ")
    request_id = re.fullmatch(r"internal error \(request id ([0-9a-f]{32})\)", error["message"]).group(1)
    assert "an internal detail" not in response.text
    [record] = [r for r in caplog.records if request_id in r.getMessage()]
    assert record.levelname == "ERROR" and "POST /v1/fails" in record.getMessage()
    assert isinstance(record.exc_info[1], KeyError)  # the traceback is logged


# ---- max_tokens 0 outside the server --------------------------------------------------------------------


def test_the_engine_and_captioning_refuse_max_tokens_0_as_the_server_does(tiny_moe_dir, tmp_path):
    image = tmp_path / "a.png"
    make_image(64, 64, seed=3).save(image)
    with Engine(tiny_moe_dir, vit_dp=0) as engine:
        with pytest.raises(ValueError, match=r"max_tokens\) must be >= 1, not 0"):
            engine.chat(HI, max_tokens=0)
        with pytest.raises(ValueError, match="max_tokens"):
            caption_images(engine, plan_captions([image], tmp_path / "captions.jsonl"), progress=False, max_tokens=0)
        assert len(engine.chat(HI, max_tokens=1, temperature=0).token_ids) == 1
