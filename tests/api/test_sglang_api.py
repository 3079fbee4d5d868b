"""SGLang's native API, as SGLang's users and sglang-router see it: `POST /generate` answers as a chat or
text completion of the same prompt does (greedy), in SGLang's shapes; `/model_info` and `/server_info`
report what the router reads; the bootstrap fields of prefill/decode disaggregation are accepted on
every generation endpoint and ignored by a colocated server, and refused by name when malformed. One
real `vlm-serve serve` of the tiny MoE checkpoint (the session's shared server)."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import httpx
import pytest

from helpers import ServerProcess
from vlm_serve.testing.media import make_image, make_video, png_stating
from vlm_serve.tokenizer import Tokenizer

pytestmark = pytest.mark.server  # every test here starts a real server

GREEDY = {"temperature": 0, "max_new_tokens": 12}
BOOTSTRAP = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": 2**63 + 5}
QUESTION = "What is in the picture?"


def image_url(seed: int = 1) -> str:
    buffer = io.BytesIO()
    make_image(64, 48, seed=seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def video_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=4, fps=2, size=(64, 48), seed=3)
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def chat_messages(*media: tuple[str, str]) -> list[dict]:
    """One user message with media parts (("image_url" | "video_url", url)) and the question."""
    parts = [{"type": kind, kind: {"url": url}} for kind, url in media]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def templated(tokenizer: Tokenizer, *kinds: str) -> str:
    """The chat-templated text of `chat_messages` with media of `kinds` ("image", "video"): the prompt an
    SGLang user sends to /generate, with the model's placeholders."""
    parts = [{"type": kind, kind: "unused"} for kind in kinds]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def generate(server: ServerProcess, **body) -> dict | list:
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(server: ServerProcess, messages: list[dict], **body) -> dict:
    response = post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 12, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(server: ServerProcess, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [line.removeprefix("data: ") for line in response.iter_lines() if line]


# ---- /model_info and /server_info ------------------------------------------------------------------


def test_model_info_names_the_model_and_its_local_folder(server: ServerProcess, tiny_moe_dir: Path) -> None:
    """sglang-router names the model by `served_model_name` and loads its tokenizer from `tokenizer_path`,
    which must be a local folder it can open from anywhere."""
    info = httpx.get(server.url + "/model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == str(tiny_moe_dir.resolve())
    assert info["served_model_name"] == tiny_moe_dir.name
    assert info["is_generation"] is True and info["has_image_understanding"] is True
    assert info["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert httpx.get(server.url + "/get_model_info").json() == info  # SGLang's older name


def test_model_info_says_how_large_a_media_file_may_be(server: ServerProcess) -> None:
    """(Ours: the demo's page in front of the server takes uploads up to it.)"""
    info = httpx.get(server.url + "/model_info").json()
    assert info["max_media_mb"] == httpx.get(server.url + "/server_info").json()["max_media_mb"] == 64  # (the default)


def test_server_info_reports_settings_and_limits_in_sglang_names(server: ServerProcess, tiny_moe_dir: Path) -> None:
    info = httpx.get(server.url + "/server_info").json()
    assert info["model_path"] == str(tiny_moe_dir.resolve())
    assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
    assert info["max_total_num_tokens"] > 0 and 0 < info["max_req_input_len"] < info["context_length"]
    assert "version" in info and "api_key" not in info
    assert httpx.get(server.url + "/get_server_info").json().keys() == info.keys()


# ---- /generate ---------------------------------------------------------------------------------------


def test_generate_answers_text_as_a_completion_does(server: ServerProcess) -> None:
    completion = post(server, "/v1/completions", {"prompt": "A red circle", "temperature": 0, "max_tokens": 12}).json()
    out = generate(server, text="A red circle", sampling_params=GREEDY, rid="mine")
    assert out["text"] == completion["choices"][0]["text"]
    meta = out["meta_info"]
    assert meta["id"] == "mine"
    assert meta["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == completion["usage"]["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert {"cached_tokens", "e2e_latency"} <= meta.keys()


def test_generate_stops_at_a_stop_regex_and_reports_the_pattern(server: ServerProcess, ours: Tokenizer) -> None:
    """As SGLang answers: the text keeps the match, and `finish_reason.matched` is the pattern."""
    whole = generate(server, text="A red circle", sampling_params=GREEDY)["output_ids"]
    pieces = [ours.decode([token]) for token in whole]
    j = next(j for j in range(2, len(pieces)) if pieces[j].strip() and pieces[j] not in "".join(pieces[:j]))
    pattern = rf"^\d|{re.escape(pieces[j])}"
    out = generate(server, text="A red circle", sampling_params={**GREEDY, "stop_regex": [pattern]})
    assert out["output_ids"] == whole[: j + 1] and out["text"] == "".join(pieces[: j + 1])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_generate_takes_token_ids(server: ServerProcess, ours: Tokenizer) -> None:
    by_text = generate(server, text="A red circle", sampling_params=GREEDY)
    by_ids = generate(server, input_ids=ours.encode("A red circle"), sampling_params=GREEDY)
    assert by_ids["output_ids"] == by_text["output_ids"]


def test_generate_expands_each_placeholder_for_its_media_as_chat_does(
    server: ServerProcess, ours: Tokenizer, video_url: str
) -> None:
    """A text holding the chat template's placeholders, with `image_data` and `video_data`, is the
    same model input as the chat request (so the same greedy answer and prompt length)."""
    answer = chat(server, chat_messages(("image_url", image_url()), ("video_url", video_url)))
    out = generate(
        server,
        text=templated(ours, "image", "video"),
        image_data=[image_url()],
        video_data=video_url,
        sampling_params=GREEDY,
    )
    assert out["text"] == answer["choices"][0]["message"]["content"]
    assert out["meta_info"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]


def test_generate_batch_with_n_answers_prompt_by_prompt(server: ServerProcess, ours: Tokenizer) -> None:
    """Two prompts (one with an image, one without) and n=2: four results, each prompt's choices in turn."""
    prompts = [templated(ours, "image"), "A blue square"]
    outs = generate(
        server, text=prompts, image_data=[image_url(), None], rid=["a", "b"], sampling_params={**GREEDY, "n": 2}
    )
    assert [out["meta_info"]["id"] for out in outs] == ["a-0", "a-1", "b-0", "b-1"]
    one_by_one = [generate(server, text=prompts[0], image_data=image_url(), sampling_params=GREEDY)]
    one_by_one.append(generate(server, text=prompts[1], sampling_params=GREEDY))
    assert [out["text"] for out in outs] == [one_by_one[0]["text"]] * 2 + [one_by_one[1]["text"]] * 2


def test_generate_streams_sglang_chunks(server: ServerProcess, ours: Tokenizer) -> None:
    """Each chunk holds the text and ids so far; the last has the finish reason; then [DONE]."""
    body = {"text": templated(ours, "image"), "image_data": image_url(), "sampling_params": GREEDY}
    whole = generate(server, **body)
    events = stream_events(server, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    texts = [chunk["text"] for chunk in chunks]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert [chunk["meta_info"]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (whole["text"], whole["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_generate_streams_several_choices_by_index(server: ServerProcess) -> None:
    events = stream_events(server, "/generate", {"text": ["A", "B"], "stream": True, "sampling_params": GREEDY})
    last = {}
    for chunk in map(json.loads, events[:-1]):
        last[chunk["index"]] = chunk
    assert sorted(last) == [0, 1]
    whole = generate(server, text=["A", "B"], sampling_params=GREEDY)
    assert [last[i]["text"] for i in (0, 1)] == [out["text"] for out in whole]


def test_generate_returns_sglang_logprobs(server: ServerProcess, ours: Tokenizer) -> None:
    """Entries are [logprob, token id, text]: the output's, and the prompt's from logprob_start_len (the
    first prompt token has no logprob); top_logprobs_num alternatives each."""
    prompt_ids = ours.encode("A red circle on the left")
    out = generate(
        server,
        input_ids=prompt_ids,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(entry[0] <= 0 and isinstance(entry[2], str) for entry in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * 4
    assert [entry[1] for entry in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    from_third = generate(
        server,
        input_ids=prompt_ids,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=2,
    )["meta_info"]
    assert [entry[:2] for entry in from_third["input_token_logprobs"]] == [
        pytest.approx(entry[:2]) for entry in meta["input_token_logprobs"][2:]
    ]
    assert from_third["output_token_logprobs"][0][2] is None  # no text unless asked


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": "x", "sampling_params": {"seed": 1}}, "sampling_params", "'seed' is not a sampling parameter"),
        ({"text": "x", "sampling_params": {"skip_special_tokens": False}}, "sampling_params", "skip_special_tokens"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "valid number"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens", "greater than"),
        ({"text": "x", "sampling_params": {"stop_regex": "a[b"}}, "sampling_params.stop_regex", "'a[b' is not a valid"),
        ({"text": "x", "image_data": image_url()}, "image_data", "<|vision_start|><|image_pad|><|vision_end|>"),
        ({"text": ["x", "y"], "image_data": image_url()}, "image_data", "one entry per prompt"),
        ({"input_ids": [1, 2], "image_data": image_url()}, None, "image_data and video_data go with `text`"),
        ({"text": "x", "input_ids": [1]}, None, "either `text` or `input_ids`"),
        ({"text": []}, "text", "empty"),
        ({"text": "x", "return_hidden_states": True}, None, "return_hidden_states is not supported"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path", "no LoRA adapter named 'adapter' is loaded"),
        ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len", "less than"),
        ({"text": ["x", "y"], "rid": ["a"]}, "rid", "one id per prompt"),
        ({"text": "x", "image_data": [image_url()] * 17}, None, "at most 16 per prompt"),
    ],
)
def test_generate_refuses_what_it_cannot_do_by_name(
    server: ServerProcess, body: dict, param: str | None, words: str
) -> None:
    response = post(server, "/generate", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param


JUNK = "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
HUGE = "data:image/png;base64," + base64.b64encode(png_stating(20000, 20000)).decode()


def test_a_media_error_names_the_item_of_image_data_or_video_data_that_failed(
    server: ServerProcess, ours: Tokenizer
) -> None:
    one, two, video = templated(ours, "image"), templated(ours, "image", "image"), templated(ours, "image", "video")
    cases = [
        ({"text": two, "image_data": [image_url(), JUNK]}, "image_data[1]", "cannot decode image"),
        ({"text": one, "image_data": JUNK}, "image_data", "cannot decode image"),
        ({"text": video, "image_data": image_url(), "video_data": [JUNK]}, "video_data[0]", "is not video/*"),
        ({"text": [one, two], "image_data": [image_url(), [image_url(), JUNK]]}, "image_data[1][1]", "cannot decode"),
        ({"text": [two, one], "image_data": [[image_url(), image_url()], JUNK]}, "image_data[1]", "cannot decode"),
        (
            {"text": one, "image_data": [HUGE], "stream": True},
            "image_data[0]",
            "image is 20000 x 20000 = 400000000 pixels, more than the limit of 89478485 (--max-image-pixels)",
        ),
    ]
    for body, param, words in cases:
        response = post(server, "/generate", {**body, "sampling_params": GREEDY})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    assert generate(server, text=one, image_data=image_url(), sampling_params=GREEDY)["text"]


def test_generate_without_sampling_params_writes_at_most_128_tokens_as_sglang_does(server: ServerProcess) -> None:
    out = generate(server, text="A red circle", sampling_params=None)
    finish = out["meta_info"]["finish_reason"]
    assert finish == {"type": "length", "length": 128} or finish["type"] == "stop"
    assert out["meta_info"]["completion_tokens"] <= 128


def test_generate_names_the_model_as_the_openai_endpoints_do(server: ServerProcess) -> None:
    """sglang-router sends `"model": null` on /generate; another model's name is a 404."""
    assert post(server, "/generate", {"text": "x", "model": None, "sampling_params": GREEDY}).status_code == 200
    assert post(server, "/generate", {"text": "x", "model": "gpt-17"}).json()["error"]["code"] == "model_not_found"


# ---- bootstrap fields (prefill/decode disaggregation) ---------------------------------------------------


def test_chat_without_a_model_through_sglang_router_is_served(server: ServerProcess) -> None:
    """sglang-router fills in "unknown" for a chat request that names no model."""
    answer = chat(server, chat_messages(), model="unknown")["choices"][0]["message"]
    assert answer == chat(server, chat_messages())["choices"][0]["message"]


def test_bootstrap_fields_are_accepted_and_ignored_by_a_colocated_server(
    server: ServerProcess, ours: Tokenizer
) -> None:
    """As sglang-router's PD mode sends them: one room; one per choice of a chat request with n > 1; one
    per prompt of a batch (whatever its n)."""
    per_choice = {"bootstrap_host": ["h", "h"], "bootstrap_port": [8998, 8998], "bootstrap_room": [1, 2]}
    messages = chat_messages(("image_url", image_url()))
    plain = chat(server, messages, n=2)["choices"]
    assert chat(server, messages, n=2, **per_choice)["choices"] == plain
    assert chat(server, messages, n=2, **BOOTSTRAP)["choices"] == plain
    completion = {"prompt": ["A", "B"], "n": 2, "temperature": 0, "max_tokens": 8}
    texts = [c["text"] for c in post(server, "/v1/completions", completion).json()["choices"]]
    for rooms in (BOOTSTRAP, {**per_choice, "bootstrap_room": [3, 4]}, {**BOOTSTRAP, "bootstrap_room": [5, 6, 7, 8]}):
        with_rooms = post(server, "/v1/completions", {**completion, **rooms}).json()["choices"]
        assert [c["text"] for c in with_rooms] == texts
    body = {"text": templated(ours, "image"), "image_data": image_url(), "sampling_params": GREEDY}
    assert generate(server, **body, **BOOTSTRAP)["text"] == generate(server, **body)["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({**BOOTSTRAP, "bootstrap_room": "5"}, "bootstrap_room", "must be an integer"),
        ({**BOOTSTRAP, "bootstrap_room": -1}, "bootstrap_room", "must be an integer"),
        ({**BOOTSTRAP, "bootstrap_room": 2**64}, "bootstrap_room", "must be an integer"),
        ({**BOOTSTRAP, "bootstrap_port": 70000}, "bootstrap_port", "integer port"),
        ({**BOOTSTRAP, "bootstrap_port": True}, "bootstrap_port", "integer port"),
        ({**BOOTSTRAP, "bootstrap_host": 7}, "bootstrap_host", "non-empty string"),
        ({"bootstrap_room": 5}, None, "bootstrap_host and bootstrap_port must be given with bootstrap_room"),
        ({**BOOTSTRAP, "bootstrap_room": [1, 2]}, "bootstrap_room", "2 entries for 1 prompt(s) of 1 choice(s)"),
        ({**BOOTSTRAP, "bootstrap_room": [1, 2], "bootstrap_port": [1]}, None, "the same length"),
    ],
)
def test_malformed_bootstrap_fields_are_refused_by_name(
    server: ServerProcess, path: str, fields: dict, param: str | None, words: str
) -> None:
    prompt = {
        "/v1/chat/completions": {"messages": chat_messages(), "max_tokens": 2},
        "/v1/completions": {"prompt": "A", "max_tokens": 2},
        "/generate": {"text": "A", "sampling_params": {"max_new_tokens": 2}},
    }[path]
    response = post(server, path, {**prompt, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param
