"""Output parsers of the OpenAI API: reasoning (`<think>` ... `</think>`) and Qwen3 tool calls
(`<tool_call>` JSON blocks), whole and streamed in any split, and the grammar that forces tool calls."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from vlm_serve.config import CHOICES
from vlm_serve.server.chat_output import ChatOutput
from vlm_serve.server.reasoning_parser import REASONING_PARSERS, Qwen3ReasoningParser
from vlm_serve.server.tool_parser import ToolCallStream, parse_tool_calls, tool_call_grammar


def splits(text: str) -> list[list[str]]:
    """The ways a stream may cut `text` tested here: every two-piece split, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


# ---- reasoning ---------------------------------------------------------------------------------------

THINKING_CASES = [  # (output, reasoning, content) when the prompt opened <think> (the default)
    ("Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "\n\nIt is 4."),
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("cut short while thinking", "cut short while thinking", None),
    ("</think>It is 4.", None, "It is 4."),
    ("all thought</think>", "all thought", None),
    ("", None, None),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("x<think>y</think>z", "x<think>y", "z"),
    ("<think>a</think><think>b", "a", "<think>b"),
    ("<thi", "<thi", None),
    ("ends in a partial tag </thin", "ends in a partial tag </thin", None),
    ("<<think>>a</</think>>", "<<think>>a</", ">"),
]
NOT_THINKING_CASES = [  # the same with thinking=False (the prompt closed or skipped the think block)
    ("It is 4.", None, "It is 4."),
    ("<think>a</think>b", "a", "b"),
    ("a</think>b", None, "a</think>b"),
    ("<think>cut", "cut", None),
    ("<thi", None, "<thi"),
    ("", None, None),
]
REASONING_CASES = [(True, *case) for case in THINKING_CASES] + [(False, *case) for case in NOT_THINKING_CASES]


def test_registry_offers_qwen3_and_the_flag_offers_the_registry():
    assert REASONING_PARSERS["qwen3"] is Qwen3ReasoningParser
    assert CHOICES["reasoning_parser"] == tuple(REASONING_PARSERS)


@pytest.mark.parametrize("thinking, text, reasoning, content", REASONING_CASES)
def test_split_whole_answer(thinking, text, reasoning, content):
    assert Qwen3ReasoningParser(thinking).split(text) == (reasoning, content)


@pytest.mark.parametrize("thinking, text, reasoning, content", REASONING_CASES)
def test_stream_in_any_split_matches_split(thinking, text, reasoning, content):
    for deltas in splits(text):
        parser = Qwen3ReasoningParser(thinking)
        pieces = [parser.feed(delta) for delta in deltas] + [parser.finish()]
        assert "".join(r for r, _ in pieces) == (reasoning or ""), deltas
        assert "".join(c for _, c in pieces) == (content or ""), deltas


def test_stream_holds_back_partial_tags_only():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<th") == ("", "")  # may be <think>
    assert parser.feed("ink>a<b") == ("a<b", "")  # "<b" cannot begin </think>
    assert parser.feed(" </th") == (" ", "")
    assert parser.feed("ink>\n") == ("", "\n")
    assert parser.feed("<tool_call>") == ("", "<tool_call>")  # content is never held
    assert parser.finish() == ("", "")


def test_finish_releases_a_held_partial_tag_as_text():
    parser = Qwen3ReasoningParser()
    assert parser.feed("thinking </thi") == ("thinking ", "")
    assert parser.finish() == ("</thi", "")


# ---- tool calls: parsing -----------------------------------------------------------------------------

TOOL_NAMES = ["get_weather", "get_time"]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Zürich"}}\n</tool_call>'
WEATHER_CALL = ("get_weather", '{"city": "Paris"}')
TIME_CALL = ("get_time", '{"tz": "Zürich"}')

WHOLE = ...  # the content is the whole output
TOOL_CASES = [  # (output, content, [(name, arguments)])
    ("No tools needed: 4.", "No tools needed: 4.", []),
    ("", None, []),
    (WEATHER, None, [WEATHER_CALL]),
    ("Let me check.\n" + WEATHER, "Let me check.\n", [WEATHER_CALL]),
    ("\n\n" + WEATHER + "\n" + TIME, None, [WEATHER_CALL, TIME_CALL]),
    (WEATHER + "\n" + TIME + "\nDone, and this text is dropped.", None, [WEATHER_CALL, TIME_CALL]),
    # arguments written as a JSON string holding an object
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"Zürich\\"}"}\n</tool_call>', None, [TIME_CALL]),
    # not calls, so the whole text is content
    ('<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>', WHOLE, []),
    ('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', WHOLE, []),
    ('<tool_call>\n{"name": "get_weather"}\n</tool_call>', WHOLE, []),
    ('<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', WHOLE, []),
    ('<tool_call>\n{"name": "get_weather", "arguments": "[1]"}\n</tool_call>', WHOLE, []),
    ('<tool_call>\n{"name": ["get_weather"], "arguments": {}}\n</tool_call>', WHOLE, []),
    ('<tool_call>\n["get_weather", {}]\n</tool_call>', WHOLE, []),
    ("I write <tool_call> tags and <tool_", WHOLE, []),
    # invalid blocks among valid ones are dropped
    (
        'A\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n'
        + WEATHER
        + "\n<tool_call>\n{oops}\n</tool_call>",
        "A\n",
        [WEATHER_CALL],
    ),
    # a block left open at the end is read as if closed; if it does not parse it is dropped, or content
    (WEATHER + "\n" + TIME.removesuffix("\n</tool_call>"), None, [WEATHER_CALL, TIME_CALL]),
    ("Sure. " + WEATHER.removesuffix("</tool_call>"), "Sure. ", [WEATHER_CALL]),
    (WEATHER + '\n<tool_call>\n{"name": "get_ti', None, [WEATHER_CALL]),
    ('Sure. <tool_call>\n{"name": "get_weather", "argum', WHOLE, []),
]


def expected_content(text: str, content):
    return text if content is WHOLE else content


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, TOOL_NAMES)
    assert got_content == expected_content(text, content)
    assert [(call.name, call.arguments) for call in got_calls] == calls


@pytest.mark.parametrize("text, content, calls", TOOL_CASES)
def test_tool_call_stream_in_any_split_matches_whole(text, content, calls):
    for deltas in splits(text):
        stream = ToolCallStream(TOOL_NAMES)
        pieces = [stream.feed(delta) for delta in deltas] + [stream.finish()]
        assert "".join(piece for piece, _ in pieces) == (expected_content(text, content) or ""), deltas
        assert [(call.name, call.arguments) for _, got in pieces for call in got] == calls, deltas


def test_call_ids_are_openai_like_and_unique():
    _, calls = parse_tool_calls(WEATHER + "\n" + WEATHER, TOOL_NAMES)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert calls[0].id != calls[1].id


def test_stream_releases_text_at_once_and_each_call_when_closed():
    stream = ToolCallStream(TOOL_NAMES)
    assert stream.feed("\n") == ("", [])  # a whitespace-only start waits
    assert stream.feed("Let me <b>check") == ("\nLet me <b>check", [])
    assert stream.feed(".\n<tool") == (".\n", [])  # may be <tool_call>
    content, calls = stream.feed(WEATHER.removeprefix("<tool")[:-1])
    assert (content, calls) == ("", [])  # the call is not closed yet
    content, calls = stream.feed(">\n" + TIME[:20])
    assert content == "" and [(call.name, call.arguments) for call in calls] == [WEATHER_CALL]
    content, calls = stream.feed(TIME[20:])
    assert [(call.name, call.arguments) for call in calls] == [TIME_CALL]
    assert stream.finish() == ("", [])


# ---- tool calls: grammar -----------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_flight",
            "parameters": {
                "type": "object",
                "properties": {
                    "route": {
                        "type": "object",
                        "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                        "required": ["from", "to"],
                    },
                    "passengers": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"],
                        },
                        "minItems": 1,
                    },
                },
                "required": ["route", "passengers"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},  # no parameters: any JSON object
]


def call(name: str, arguments) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


FLIGHT_ARGS = {"route": {"from": "CDG", "to": "NRT"}, "passengers": [{"name": "Ann", "age": 31}]}
VALID_CALLS = [
    call("get_weather", {"city": "Paris"}),
    call("get_weather", {"city": "Paris", "unit": "celsius"}),
    call("book_flight", FLIGHT_ARGS),
    call("ping", {}),
    call("ping", {"anything": [1, {"goes": None}]}),
]
INVALID_OUTPUTS = [
    "",
    call("get_time", {"city": "Paris"}),  # not a tool
    call("get_weather", {"unit": "celsius"}),  # a required argument missing
    call("get_weather", {"city": 7}),  # wrong type
    call("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
    call("book_flight", {"route": {"from": "CDG"}, "passengers": [{"name": "Ann", "age": 31}]}),  # nested required
    call("book_flight", {**FLIGHT_ARGS, "passengers": [{"name": "Ann", "age": "31"}]}),  # nested wrong type
    call("book_flight", {**FLIGHT_ARGS, "passengers": []}),  # minItems
    call("ping", [1]),  # arguments must be an object
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no <tool_call> wrapper
    "Sure. " + call("get_weather", {"city": "Paris"}),  # text before the call
    call("get_weather", {"city": "Paris"}) + "\nDone.",  # text after it
]

VOCAB = [chr(i) for i in range(32, 127)] + ["\n", "</s>"]  # one character per token, and a stop token
STOP = len(VOCAB) - 1


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP]))


def accepts(compiler: xgr.GrammarCompiler, ebnf: str, text: str) -> bool:
    """Whether `text` followed by the stop token is a complete output of the grammar."""
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf)))
    return matcher.accept_string(text) and matcher.accept_token(STOP) and matcher.is_terminated()


def test_required_grammar_accepts_one_or_more_valid_calls(compiler):
    grammar = tool_call_grammar(TOOLS, None)
    for text in [*VALID_CALLS, "\n".join(VALID_CALLS)]:
        assert accepts(compiler, grammar, text), text
        assert len(parse_tool_calls(text, ["get_weather", "book_flight", "ping"])[1]) == text.count("<tool_call>")


def test_required_grammar_without_parallel_calls_takes_exactly_one(compiler):
    grammar = tool_call_grammar(TOOLS, None, parallel=False)
    assert all(accepts(compiler, grammar, text) for text in VALID_CALLS)
    assert not accepts(compiler, grammar, "\n".join(VALID_CALLS[:2]))


@pytest.mark.parametrize("text", INVALID_OUTPUTS)
def test_required_grammar_rejects(compiler, text):
    assert not accepts(compiler, tool_call_grammar(TOOLS, None), text)


def test_named_grammar_forces_exactly_one_call_to_that_function(compiler):
    grammar = tool_call_grammar(TOOLS, "book_flight")
    assert accepts(compiler, grammar, call("book_flight", FLIGHT_ARGS))
    assert not accepts(compiler, grammar, call("get_weather", {"city": "Paris"}))
    assert not accepts(compiler, grammar, call("book_flight", FLIGHT_ARGS) + "\n" + call("book_flight", FLIGHT_ARGS))
    assert not accepts(compiler, grammar, call("book_flight", {"route": FLIGHT_ARGS["route"]}))
    assert not accepts(compiler, grammar, json.dumps({"name": "book_flight", "arguments": FLIGHT_ARGS}))


def test_text_grammar_allows_text_and_valid_calls_of_its_tools_only(compiler):
    """`allowed_tools` "auto": text, in which every `<tool_call>` is a valid call of the given tools."""
    weather = [tool for tool in TOOLS if tool["function"]["name"] == "get_weather"]
    grammar = tool_call_grammar(weather, text=True)
    paris = call("get_weather", {"city": "Paris"})
    for text in ["", "Just text.", paris, "Sure. " + paris + "\nDone.", paris + "\n" + paris]:
        assert accepts(compiler, grammar, text), text
    for text in [call("book_flight", FLIGHT_ARGS), "Sure. " + call("ping", {}), call("get_weather", {"city": 7})]:
        assert not accepts(compiler, grammar, text), text
    assert not accepts(compiler, tool_call_grammar(weather, parallel=False, text=True), paris + "\n" + paris)


def test_named_grammar_for_an_unknown_function_raises():
    with pytest.raises(ValueError, match="send_mail"):
        tool_call_grammar(TOOLS, "send_mail")


@pytest.mark.parametrize("thinking", [True, False])
def test_a_streamed_chat_answer_has_the_same_parts_as_the_whole_answer(thinking):
    text = (
        "Let me see.</think>\n\nI will call it.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    whole = ChatOutput("qwen3", ["get_weather"], thinking).parse(text)
    assert [c.name for c in whole.tool_calls] == ["get_weather"]
    for cut in range(len(text) + 1):
        stream = ChatOutput("qwen3", ["get_weather"], thinking)
        parts = stream.feed(text[:cut])
        parts += stream.feed(text[cut:])
        parts += stream.finish()
        assert (parts.reasoning, parts.content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in parts.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
