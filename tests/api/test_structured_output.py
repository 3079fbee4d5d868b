"""Structured output: JSON schemas, regexes and EBNF grammars compiled by xgrammar, in the engine (requests
waiting in `grammar_queue` while they compile; logit_bias) and through the real server with the official
`openai` client (response formats, tool calling, reasoning). The random tiny model writes noise: every answer
that parses, and every tool call, is the grammar's doing — or, for `auto`, a call the test forces with an EBNF
grammar. Every engine test ends with the idle self-check."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import httpx
import jsonschema
import pytest

import vlm_serve
from helpers import openai_client, running_server
from vlm_serve.errors import ServiceUnavailable
from vlm_serve.server.protocol import ChatCompletionRequest
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

# ---- in the engine ------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 3},
        "position": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "visible": {"type": "boolean"}},
            "required": ["x", "visible"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "position"],
    "additionalProperties": False,
}
LOOPS = {"normal": {"disable_overlap_schedule": True}, "overlap": {"disable_overlap_schedule": False}}


@pytest.fixture(scope="module", params=list(LOOPS))
def engine(request, tiny_moe_dir):
    # small chunks: prompts with an image are prefilled over several forwards
    engine = vlm_serve.Engine(model=tiny_moe_dir, dtype="float32", chunked_prefill_size=32, **LOOPS[request.param])
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def idle_after_each_test(request):
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert not engine.scheduler.grammar_queue
        engine.scheduler.check_memory()


def _ask(text: str, image=None) -> list[dict]:
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


def test_sampled_answers_follow_a_json_schema_with_an_image_in_the_prompt(engine):
    out = engine.chat(
        _ask("Describe the picture as JSON.", make_image(64, 48, seed=3)),
        json_schema=json.dumps(PERSON),
        temperature=1.0,
        n=8,
        seed=11,
        max_tokens=120,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)
    # the same request again: the compiled grammar is reused and the seeded answers repeat
    again = engine.chat(
        _ask("Describe the picture as JSON.", make_image(64, 48, seed=3)),
        json_schema=json.dumps(PERSON),
        temperature=1.0,
        n=8,
        seed=11,
        max_tokens=120,
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert list(engine.scheduler.grammar_queue.backend.cache) == [("json_schema", json.dumps(PERSON))]


def test_greedy_and_penalised_answers_follow_a_regex(engine):
    pattern = r"(cat|dog|bird) [0-9]{3}"
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3}):
        out = engine.chat(_ask("Name an animal and a number."), regex=pattern, max_tokens=20, n=3, **sampling)
        for choice in out.choices:
            assert re.fullmatch(pattern, choice.text), choice.text
            assert choice.finish_reason == "stop"


def test_an_ebnf_grammar_and_a_stop_string_inside_it(engine):
    grammar = 'root ::= "The answer is " ("yes" | "no") "." " Because " [a-z]+ "."'
    out = engine.chat(_ask("Yes or no?"), ebnf=grammar, max_tokens=40, temperature=1.0, seed=1, n=2)
    for choice in out.choices:
        assert (
            re.fullmatch(r"The answer is (yes|no)\. Because [a-z]+\.", choice.text) or choice.finish_reason == "length"
        )
    # a stop string still ends the answer, wherever the grammar is
    stopped = engine.chat(_ask("Yes or no?"), ebnf=grammar, max_tokens=40, temperature=0, stop=[" is "])
    assert stopped.text == "The answer" and stopped.finish_reason == "stop"


def test_a_grammar_ends_the_answer_even_with_ignore_eos(engine):
    out = engine.chat(_ask("Pick one."), regex="(left|right)", ignore_eos=True, max_tokens=30, temperature=0)
    assert out.text in ("left", "right") and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": "a(b"}, "invalid regex: Regex parsing error"),
        ({"ebnf": "root ::= missing"}, 'invalid ebnf: .*Rule "missing" is not defined'),
        ({"json_schema": json.dumps({"type": "nope"})}, 'invalid json_schema: Unsupported type "nope"'),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex and ebnf"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_with_the_reason(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.chat(_ask("Hello"), max_tokens=5, n=2, **kwargs)
    assert not engine.scheduler.reqs
    assert engine.chat(_ask("Hello"), max_tokens=3, regex="ok").text == "ok"  # the engine goes on


def _never_compiling(engine, monkeypatch) -> Future:
    """Makes the grammar backend hand out a compilation that never finishes."""
    pending: Future = Future()
    monkeypatch.setattr(engine.scheduler.grammar_queue.backend, "compile", lambda key: pending)
    return pending


def test_a_request_waiting_for_its_grammar_can_be_aborted(engine, monkeypatch):
    _never_compiling(engine, monkeypatch)
    x = engine.processor.process_messages(_ask("Hello"))
    submission = engine.submit(x, regex="a+", max_tokens=5)
    for _ in range(3):
        engine.step()
    assert [p.req.rid for p in engine.scheduler.grammar_queue] == submission.rids
    engine.abort(submission, "client went away")
    engine.step()
    assert engine.result(submission).choices[0].finish_reason == "abort"


def test_a_grammar_that_does_not_compile_in_time_fails_as_the_servers_fault(engine, monkeypatch):
    """A 503: the deadline includes waiting behind other grammars, and a retry finds it compiled."""
    _never_compiling(engine, monkeypatch)
    monkeypatch.setattr(engine.scheduler.grammar_queue, "timeout", 0.05)  # (--grammar-compile-timeout)
    with pytest.raises(ServiceUnavailable, match="did not compile within 0.05 s"):
        engine.chat(_ask("Hello"), regex="a+", max_tokens=5)


def test_logit_bias_steers_the_answer_and_bad_ids_are_refused(engine):
    token = engine.tokenizer.encode(" cat")[0]
    out = engine.chat(_ask("Hello"), logit_bias={str(token): 100}, max_tokens=4, temperature=0, ignore_eos=True)
    assert out.token_ids == [token] * 4
    with pytest.raises(ValueError, match="logit_bias token id 999999 is outside the vocabulary"):
        engine.chat(_ask("Hello"), logit_bias={"999999": 1}, max_tokens=4)
    with pytest.raises(ValueError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        engine.chat(_ask("Hello"), logit_bias={str(token): 101}, max_tokens=4)


def test_with_reasoning_the_grammar_starts_after_the_end_of_thinking(engine):
    think_end = engine.tokenizer.token_to_id("</think>")
    # still thinking: the grammar does not apply yet (a random model never closes its thoughts by itself)
    free = engine.chat(_ask("Pick one."), regex="(left|right)", reasoning=True, max_tokens=8, temperature=0)
    assert think_end not in free.token_ids and free.finish_reason == "length"
    assert not re.fullmatch("(left|right)", free.text)
    # pushed to close them at once: then the answer follows the grammar
    out = engine.chat(
        _ask("Pick one."),
        regex="(left|right)",
        reasoning=True,
        max_tokens=8,
        temperature=0,
        logit_bias={str(think_end): 100},
    )
    assert out.token_ids[0] == think_end and out.finish_reason == "stop"
    assert engine.tokenizer.decode(out.token_ids[1:]) in ("left", "right")


def test_a_grammar_after_reasoning_rolls_back_across_the_end_of_thinking(engine):
    """What verifying speculative drafts needs of a grammar: accept them, then forget them again."""
    import xgrammar as xgr

    backend = engine.scheduler.grammar_queue.backend
    grammar = backend.matcher(backend.compile(("regex", "(left|right)")).result(), after_reasoning=True)
    think_end = engine.tokenizer.token_to_id("</think>")
    vocab = engine.scheduler.vocab_size
    left = engine.tokenizer.encode("left")

    def allowed() -> int:
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        grammar.fill_next_token_bitmask(bitmask, 0)
        return int(xgr.testing.bitmask_to_bool_mask(bitmask, vocab).sum())

    assert all(grammar.accept_token(t) for t in [7, 8, think_end, *left[:1]])
    constrained = allowed()
    grammar.rollback(2)  # back before `</think>`: thinking, every token allowed
    assert allowed() == vocab and not grammar.is_terminated()
    assert grammar.accept_token(think_end) and allowed() < vocab
    assert grammar.accept_token(left[0]) and allowed() == constrained
    grammar.rollback(1)
    assert not grammar.accept_token(engine.tokenizer.encode("up")[0])  # the grammar holds after rollback


# ---- through the server (each test here starts a real server or uses one) ----------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
        "shapes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["circle", "square"]},
                    "size": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["kind"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "box": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "count", "colour", "shapes", "box"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "maxItems": 3},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def _literal(text: str) -> str:
    """An EBNF grammar that allows exactly `text`."""
    return "root ::= " + json.dumps(text)


def _validate_call(call, tools=TOOLS) -> dict:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


# ---- structured output ------------------------------------------------------------------------------


@pytest.mark.server
def test_fifty_sampled_answers_follow_a_nested_json_schema(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}
    answers = []
    for seed in (1, 2):
        out = client.chat.completions.create(
            model="default",
            messages=ASK,
            response_format=response_format,
            temperature=1.0,
            n=25,
            seed=seed,
            max_tokens=150,
        )
        answers += [choice.message.content for choice in out.choices]
        assert all(choice.finish_reason == "stop" for choice in out.choices)
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert len(set(answers)) > 10  # sampled, not one answer repeated


@pytest.mark.server
def test_a_streamed_answer_with_an_image_follows_the_schema(client):
    image = make_image(64, 48, seed=4)
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "JSON?"}],
        }
    ]
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        temperature=0.9,
        seed=3,
        max_tokens=150,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.server
def test_json_object_regex_and_ebnf(client):
    out = client.chat.completions.create(
        model="default",
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
        extra_body={"logit_bias": {}},
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a random model may write one long string: what there is must be the start of an object
        assert out.choices[0].message.content.startswith("{")
    regex = r"(yes|no), [0-9]{2} times"
    out = client.chat.completions.create(
        model="default", messages=ASK, temperature=1.0, n=4, max_tokens=20, extra_body={"regex": regex}
    )
    assert all(__import__("re").fullmatch(regex, c.message.content) for c in out.choices)
    completion = client.completions.create(
        model="default", prompt="Say it:", max_tokens=10, temperature=0, extra_body={"ebnf": _literal("it.")}
    )
    assert completion.choices[0].text == "it."


@pytest.mark.server
@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            'invalid json_schema: Unsupported type \\"nope\\"',
        ),
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"ebnf": "root ::= undefined_rule"}, 'Rule \\"undefined_rule\\" is not defined'),
        ({"regex": "a", "ebnf": _literal("a")}, "`regex` and `ebnf` cannot both be given"),
        ({"response_format": {"type": "json_schema"}}, "response_format of type json_schema needs a json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 200}}, r"logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias token id 99999999 is outside the vocabulary"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
            "tool_choice names the function 'send_email', which is not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice 'required' needs `tools`"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "cannot be combined with regex"),
        ({"tools": [WEATHER, WEATHER]}, "tools must have distinct function names"),
    ],
)
def test_bad_structured_output_requests_are_400s_naming_the_problem(server, body, message):
    payload = {"model": "default", "messages": ASK, "max_tokens": 5, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.server
def test_logit_bias_steers_the_answer(client, tiny_moe_dir):
    token = Tokenizer.from_pretrained(tiny_moe_dir).encode(" cat")[0]
    out = client.chat.completions.create(
        model="default",
        messages=ASK,
        max_tokens=3,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == " cat cat cat"


# ---- tool calling -----------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_choices_always_give_valid_calls(client, stream):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        calls_per_choice = _tool_calls(client, stream, tools=TOOLS, tool_choice=choice, n=4, temperature=1.0, seed=5)
        for calls, finish in calls_per_choice:
            assert calls and finish == "tool_calls"
            for call in calls:
                _validate_call(call)
            if choice != "required":
                assert [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.server
def test_auto_parses_a_call_the_model_writes_and_keeps_the_text_before_it(client):
    ebnf = _literal("Let me check.\n" + FORCED_CALL)
    out = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=150, temperature=0, extra_body={"ebnf": ebnf}
    )
    message = out.choices[0].message
    assert message.content == "Let me check.\n" and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    # streamed: the same call in one tool-call delta, the text as content
    [(calls, finish)] = _tool_calls(client, True, tools=TOOLS, extra_body={"ebnf": ebnf}, temperature=0)
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    assert finish == "tool_calls"
    # tool_choice "none": the same text stays text
    out = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=150,
        temperature=0,
        extra_body={"ebnf": ebnf},
    )
    assert (
        out.choices[0].message.tool_calls is None and out.choices[0].message.content == "Let me check.\n" + FORCED_CALL
    )
    assert out.choices[0].finish_reason == "stop"


def _tool_calls(client, stream: bool, **kwargs) -> list[tuple[list, str]]:
    """(tool calls, finish reason) of each choice, from a whole answer or put together from a stream."""
    kwargs = {"model": "default", "messages": ASK, "max_tokens": 120, **kwargs}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        return [(c.message.tool_calls or [], c.finish_reason) for c in out.choices]
    calls: dict[int, dict[int, object]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.delta.content or choice.delta.tool_calls or choice.finish_reason or choice.delta.role
            for delta in choice.delta.tool_calls or []:
                assert delta.index not in calls.setdefault(choice.index, {})  # one complete call per delta
                calls[choice.index][delta.index] = delta
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return [([calls.get(i, {})[k] for k in sorted(calls.get(i, {}))], finish[i]) for i in sorted(finish)]


@pytest.mark.server
def test_a_multi_turn_tool_conversation_is_rendered_as_transformers_renders_it(client, tiny_moe_dir):
    transformers = pytest.importorskip("transformers")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_moe_dir)
    expected = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # what the server hands the template: the messages and tools as its request models keep them
    request = ChatCompletionRequest(messages=messages, tools=TOOLS)
    ours = Tokenizer.from_pretrained(tiny_moe_dir).apply_chat_template(
        [m.model_dump(exclude_none=True) for m in request.messages],
        tools=[t.model_dump(exclude_none=True) for t in request.tools],
    )
    assert ours == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in expected
    out = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=1)
    assert out.usage.prompt_tokens == len(theirs(expected)["input_ids"])


# ---- reasoning ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_client(tiny_moe_dir: Path):
    with running_server(tiny_moe_dir, "--reasoning-parser", "qwen3") as srv:
        yield openai_client(srv)


# With thinking on, a grammar applies only after `</think>`, which the random model never writes: these
# tests force the whole answer with thinking off, where an answer that opens with <think> still reasons.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.server
def test_reasoning_is_split_from_the_answer_whole_and_streamed(reasoning_client):
    extra_body = {"ebnf": _literal("<think>The user asks about rain.\n</think>\n\nIt is sunny."), **NO_THINKING}
    out = reasoning_client.chat.completions.create(
        model="default", messages=ASK, max_tokens=40, temperature=0, extra_body=extra_body
    )
    message = out.choices[0].message
    assert message.reasoning_content == "The user asks about rain.\n" and message.content == "\n\nIt is sunny."
    reasoning, content = "", ""
    for chunk in reasoning_client.chat.completions.create(
        model="default", messages=ASK, max_tokens=40, temperature=0, extra_body=extra_body, stream=True
    ):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        assert "</think>" not in (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
    assert (reasoning, content) == ("The user asks about rain.\n", "\n\nIt is sunny.")


@pytest.mark.server
def test_a_response_carries_the_reasoning_as_a_reasoning_item_whole_and_streamed(reasoning_client):
    chat = reasoning_client.chat.completions.create(model="default", messages=ASK, max_tokens=8, temperature=0)
    expected = chat.choices[0].message
    response = reasoning_client.responses.create(model="default", input=ASK, max_output_tokens=8, temperature=0)
    [reasoning] = [item for item in response.output if item.type == "reasoning"]
    assert reasoning.content[0].text == expected.reasoning_content and response.output[0] == reasoning
    assert response.output_text == (expected.content or "")
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        reasoning_client.responses.create(model="default", input=ASK, max_output_tokens=8, temperature=0, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == expected.reasoning_content == events[-1].response.output[0].content[0].text


@pytest.mark.server
def test_reasoning_then_a_tool_call(reasoning_client):
    extra_body = {"ebnf": _literal("<think>Need the time.</think>\n\n" + FORCED_CALL), **NO_THINKING}
    out = reasoning_client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=150, temperature=0, extra_body=extra_body
    )
    message = out.choices[0].message
    assert message.reasoning_content == "Need the time."
    assert [c.function.name for c in message.tool_calls] == ["get_time"] and out.choices[
        0
    ].finish_reason == "tool_calls"


@pytest.mark.server
def test_a_forced_tool_call_comes_after_the_reasoning(reasoning_client, tiny_moe_dir):
    think_end = Tokenizer.from_pretrained(tiny_moe_dir).token_to_id("</think>")
    out = reasoning_client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        logit_bias={str(think_end): 100},  # the random model closes its (empty) reasoning at once
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _validate_call(call)


@pytest.mark.server
def test_log_probs_of_tokens_a_grammar_rules_out_are_a_finite_floor_whole_and_streamed(server):
    """A grammar leaves fewer tokens than the 20 alternatives asked for: the others' log-prob, -inf, is
    reported as -9999.0, since JSON has no -Infinity (nor may it become null)."""
    greedy = {"temperature": 0, "regex": "(yes|no)"}
    bodies = {
        "/v1/chat/completions": {"messages": ASK, "max_tokens": 2, "logprobs": True, "top_logprobs": 20, **greedy},
        "/v1/completions": {"prompt": "Say it:", "max_tokens": 2, "logprobs": 20, **greedy},
        "/generate": {
            "text": "Say it:",
            "sampling_params": {"max_new_tokens": 2, **greedy},
            "return_logprob": True,
            "top_logprobs_num": 20,
        },
    }
    for path, body in bodies.items():
        for stream in (False, True):
            with httpx.stream("POST", server.url + path, json={**body, "stream": stream}, timeout=60) as response:
                lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
            texts = [text for text in lines if text != "[DONE]"] if stream else ["".join(lines)]
            for text in texts:
                json.loads(text, parse_constant=lambda constant: pytest.fail(f"{path}: {constant} in {text}"))
            assert "-9999.0" in "".join(texts), (path, stream)  # (not null either)
