"""Tool calls in Qwen3's (Hermes-style) format: parsing the model's output, and the grammar that forces it.

The model writes each call as `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n
</tool_call>`, several calls separated by "\\n", possibly after some text. Parsing follows vLLM's
`Hermes2ProToolParser` and SGLang's `Qwen25Detector`:

- the content is the text before the first `<tool_call>`, verbatim as vLLM keeps it (None if only
  whitespace); text between and after the calls is dropped, as both do;
- a block is a call when its JSON is an object with a string "name" of one of the request's tools and an
  object "arguments" (or a JSON string holding one); a last block left open (the generation stopped
  before `</tool_call>`) is read as if closed, as vLLM does;
- blocks that are not calls are dropped when another block is a call, as SGLang does (vLLM would give
  up on all of them); when no block is a call, the whole text is content, as both do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from vlm_serve.server.reasoning_parser import partial_tag_len

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One call the model made, as the OpenAI API reports it."""

    name: str
    arguments: str  # a JSON object, re-serialised by json.dumps(ensure_ascii=False)
    id: str = field(default_factory=new_call_id)


def _parse_call(body: str, tool_names: Collection[str]) -> ToolCall | None:
    """The call written in one block's body, or None if it is not a valid call."""
    try:
        # strict=False: control characters inside strings, which the JSON grammars of tool_choice let
        # through (re-serialised below, they are escaped)
        call = json.loads(body, strict=False)
        arguments = call["arguments"]
        if isinstance(arguments, str):
            arguments = json.loads(arguments, strict=False)
    except (ValueError, TypeError, KeyError):
        return None
    name = call.get("name")
    if not isinstance(name, str) or name not in tool_names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer."""
    stream = ToolCallStream(tool_names)
    content, calls = stream.feed(text)
    rest, last = stream.finish()
    return content + rest or None, calls + last


class ToolCallStream:
    """One request's streaming parser: gives back what `parse_tool_calls` gives for the whole text, in
    pieces. Text is released as it comes, except what may begin `<tool_call>` and a whitespace-only
    start; each call is released once its `</tool_call>` has arrived. From the first `<tool_call>` on,
    text is held until a call is found (then it is dropped) or the stream ends (then it is content)."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names = tool_names
        self._text = ""
        self._sent = 0  # content released so far: self._text[:self._sent]
        self._first = -1  # where the first <tool_call> begins, -1 until it has arrived
        self._scan = -1  # where to look for the next block: after the last closed one
        self._found = False  # a call has been released

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content piece, calls completed) after one more delta of the answer."""
        self._text += delta
        if self._first < 0:
            # a <tool_call> cannot begin in the released text: its beginning would have been held
            self._first = self._scan = self._text.find(CALL_START, self._sent)
            if self._first < 0:
                return self._release(len(self._text) - partial_tag_len(self._text, CALL_START)), []
        content = self._release(self._first)
        calls = []
        while (start := self._text.find(CALL_START, self._scan)) >= 0:
            body_start = start + len(CALL_START)
            end = self._text.find(CALL_END, body_start)
            if end < 0:
                break
            call = _parse_call(self._text[body_start:end], self.tool_names)
            calls += [call] if call is not None else []
            self._scan = end + len(CALL_END)
        self._found |= bool(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Flushes the end of the stream: a block left open is read as if closed; with no call at all,
        whatever was held is content."""
        calls = []
        if self._first >= 0 and (start := self._text.find(CALL_START, self._scan)) >= 0:
            call = _parse_call(self._text[start + len(CALL_START) :], self.tool_names)
            calls += [call] if call is not None else []
        self._found |= bool(calls)
        return ("" if self._found else self._release(len(self._text))), calls

    def _release(self, end: int) -> str:
        """The content up to `end` not released yet (nothing while all of it is whitespace)."""
        if end <= self._sent or (self._sent == 0 and not self._text[:end].strip()):
            return ""
        piece, self._sent = self._text[self._sent : end], end
        return piece


def tool_call_grammar(tools: list[dict], name: str | None = None, parallel: bool = True, text: bool = False) -> str:
    """EBNF that forces the output to be tool calls and nothing else: one or more calls to any of `tools`
    (`tool_choice: "required"`; exactly one without `parallel`), or exactly one call to the function `name`. Each call's arguments must
    match that function's `parameters` schema (any JSON object where it has none). A thinking model's reasoning is not part of it: the
    grammar must start applying after `</think>`. With `text`, the output is free text in which every
    `<tool_call>` begins such a call (none at all, or any number; at most one without `parallel`).

    Built from xgrammar structural tags, which keep the rules of each schema apart. (xgrammar's own
    "qwen_3" structural tag allows free text around the calls, so it does not force them.)"""
    import xgrammar as xgr  # (here, not above: it imports transformers, a second at server start)
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if name is not None and name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    chosen = [functions[name]] if name is not None else list(functions.values())
    if not chosen:
        raise ValueError('tool_choice "required" needs at least one tool')
    tags = [
        TagFormat(
            begin=f'{CALL_START}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ',
            # at most one whitespace character between JSON tokens: a weak model could pad forever
            content=JSONSchemaFormat(
                json_schema={"type": "object", **(fn.get("parameters") or {})}, max_whitespace_cnt=1
            ),
            end=f"}}\n{CALL_END}",
        )
        for fn in chosen
    ]
    single = name is not None or not parallel
    if text:
        calls = TriggeredTagsFormat(triggers=[CALL_START], tags=tags, at_least_one=False, stop_after_first=single)
    else:
        calls = TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True, stop_after_first=single)
    return str(xgr.Grammar.from_structural_tag(StructuralTag(format=calls)))
