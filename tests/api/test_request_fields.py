"""The request fields clients of vLLM, SGLang and OpenAI send: each works or is refused by name.

Through the shared real server with the official `openai` client (`extra_body` for the extensions) and
raw HTTP for the refusals. The random tiny model writes noise: every answer that follows a constraint is
the grammar's doing.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.server  # every test here starts a real server

pytest.importorskip("transformers")

CHOICES = ["yes", 'no "way"', "back\\slash", "two\nlines"]  # quotes, backslashes, newlines: escaped right
REGEX = r"(red|blue) [0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "count"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Well?"}]


def _one_of_the_choices(text: str) -> bool:
    return text in CHOICES


def _matches_the_regex(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def _follows_the_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


# request fields -> what every answer must be
FORMS = {
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, _one_of_the_choices),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, _matches_the_regex),
    "structured_outputs.json": ({"structured_outputs": {"json": SCHEMA}}, _follows_the_schema),
    "structured_outputs.json as text": ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, _follows_the_schema),
    "structured_outputs.grammar": (
        {"structured_outputs": {"grammar": 'root ::= "A" [0-9]'}},
        re.compile("A[0-9]").fullmatch,
    ),
    "guided_choice": ({"guided_choice": CHOICES}, _one_of_the_choices),
    "guided_regex": ({"guided_regex": REGEX}, _matches_the_regex),
    "guided_json": ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, _follows_the_schema),
    "guided_grammar": ({"guided_grammar": 'root ::= "B" [0-9]'}, re.compile("B[0-9]").fullmatch),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_structured_output_form_constrains_chat_answers(client, model, form):
    extra, valid = FORMS[form]
    out = client.chat.completions.create(
        model=model, messages=ASK, n=3, temperature=1.0, seed=7, max_tokens=30, extra_body=extra
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop" and valid(choice.message.content), choice.message.content


@pytest.mark.parametrize("form", ["structured_outputs.choice", "guided_regex", "json_schema"])
def test_structured_output_forms_constrain_text_completions(client, model, form):
    extra, valid = FORMS[form] if form in FORMS else ({"json_schema": json.dumps(SCHEMA)}, _follows_the_schema)
    out = client.completions.create(
        model=model, prompt="Well?", n=3, temperature=1.0, seed=7, max_tokens=30, extra_body=extra
    )
    assert all(valid(choice.text) for choice in out.choices), [choice.text for choice in out.choices]


def test_json_object_gives_an_object(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        temperature=0,
        max_tokens=40,
        extra_body={"structured_outputs": {"json_object": True}},
    )
    text = out.choices[0].message.content
    # a random model may write one long string: what there is must be the start of an object
    assert isinstance(json.loads(text), dict) if out.choices[0].finish_reason == "stop" else text.startswith("{")


# ---- refused fields --------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


# body fields -> what the 400's message must name
REFUSED = [
    ({"use_beam_search": True}, ["use_beam_search", "beam search"]),
    ({"best_of": 3, "n": 2}, ["best_of"]),
    ({"length_penalty": 2.0}, ["length_penalty"]),
    ({"structural_tag": "{}"}, ["structural_tag"]),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, ["structured_outputs.structural_tag"]),
    ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, ["guided_whitespace_pattern"]),
    ({"include_stop_str_in_output": True}, ["include_stop_str_in_output"]),
    ({"skip_special_tokens": False}, ["skip_special_tokens"]),
    ({"allowed_token_ids": [1, 2]}, ["allowed_token_ids"]),
    ({"bad_words": ["cat"]}, ["bad_words"]),
    ({"truncate_prompt_tokens": 10}, ["truncate_prompt_tokens"]),
    ({"modalities": ["text", "audio"]}, ["modalities"]),
    ({"audio": {"voice": "alloy", "format": "wav"}}, ["audio"]),
    ({"functions": [WEATHER["function"]]}, ["functions", "tools"]),
    ({"verbosity": "low"}, ["verbosity"]),
    ({"tools": [{"type": "custom", "custom": {"name": "shell"}}]}, ["custom", "function tools"]),
    # one constraint per request: two are named together
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, ["guided_json", "response_format"]),
    ({"structured_outputs": {"choice": ["a"]}, "regex": "a"}, ["structured_outputs", "regex"]),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, ["structured_outputs", "regex", "choice"]),
    ({"structured_outputs": {}}, ["structured_outputs", "exactly one"]),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, ["tool_choice", "guided_choice"]),
    ({"tools": [WEATHER], "tool_choice": allowed("required", "get_weather"), "guided_regex": "a"},
     ["allowed_tools", "guided_regex"]),
    # allowed tools must be among the tools
    ({"tools": [WEATHER], "tool_choice": allowed("auto", "send_email")}, ["send_email", "not among the tools"]),
]  # fmt: skip


@pytest.mark.parametrize("body, names", REFUSED, ids=[next(iter(body)) for body, _ in REFUSED])
def test_a_field_this_server_does_not_implement_is_a_400_naming_it(server, model, body, names):
    payload = {"model": model, "messages": ASK, "max_tokens": 2, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(name in message for name in names), message


def test_the_openai_client_raises_a_refusal_as_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=model, prompt="Once", max_tokens=2, suffix="end.")


# ---- accepted fields ------------------------------------------------------------------------------------


def test_fields_that_change_nothing_in_the_answer_are_accepted(client, model):
    request = dict(model=model, messages=ASK, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**request).choices[0].message.content
    out = client.chat.completions.create(
        **request,
        metadata={"team": "a"},
        store=False,
        prompt_cache_key="k1",
        safety_identifier="user-1",
        service_tier="auto",
        prediction={"type": "content", "content": "Hello"},
        modalities=["text"],
        user="u",
        reasoning_effort="low",
        extra_body={
            "use_beam_search": False,
            "best_of": 1,
            "length_penalty": 1.0,
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "guided_decoding_backend": "xgrammar",
            "request_id": "r1",
        },
    )
    assert out.choices[0].message.content == plain
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage is not None


def test_a_refusal_part_is_rendered_as_its_text(server, model):
    def tokens(part: dict) -> list[int]:
        messages = [*ASK, {"role": "assistant", "content": [part]}, {"role": "user", "content": "Why?"}]
        response = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    assert tokens({"type": "refusal", "refusal": "I cannot."}) == tokens({"type": "text", "text": "I cannot."})
    messages = [*ASK, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, *ASK]
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 2}, timeout=60
    )
    assert response.status_code == 200, response.text


# ---- tool_choice allowed_tools ---------------------------------------------------------------------------


def _forced(name: str, arguments: dict) -> str:
    """An EBNF grammar that makes the model write exactly this call."""
    call = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    return "root ::= " + json.dumps(call)


def test_allowed_tools_required_calls_only_the_allowed_tools(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=allowed("required", "get_weather"),
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    for choice in out.choices:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and [call.function.name for call in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_allowed_tools_auto_parses_calls_of_the_allowed_tools_only(client, model):
    def answer(grammar: str | None = None):
        extra = {"ebnf": grammar} if grammar else {}
        out = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=allowed("auto", "get_weather"),
            temperature=1.0,
            seed=5,
            max_tokens=120,
            extra_body=extra,
        )
        return out.choices[0]

    called = answer(_forced("get_weather", {"city": "Rome"}))
    assert [call.function.name for call in called.message.tool_calls] == ["get_weather"]
    not_allowed = answer(_forced("get_time", {}))
    assert not_allowed.message.tool_calls is None and "get_time" in not_allowed.message.content
    # without another constraint, the answer is text or calls of the allowed tools (a grammar)
    free = answer()
    assert all(call.function.name == "get_weather" for call in free.message.tool_calls or [])
