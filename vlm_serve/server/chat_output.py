"""What a chat answer's text becomes in the API: reasoning, content and tool calls.

With `--reasoning-parser`, the text up to `</think>` is `reasoning_content`; when the request has tools
(and a tool_choice other than "none"), Qwen's `<tool_call>` blocks in the rest become `tool_calls`.
`ChatOutput` does this for a whole answer (`parse`) or piece by piece as it streams (`feed`, `finish`),
with the same results.

`tool_choice` "required" or a named function is enforced with a grammar (`tool_call_grammar`), so the
answer is calls and nothing else, and their arguments match the functions' schemas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlm_serve.server.protocol import ChatCompletionRequest, NamedToolChoice
from vlm_serve.server.reasoning_parser import REASONING_PARSERS
from vlm_serve.server.tool_parser import ToolCall, ToolCallStream, parse_tool_calls, tool_call_grammar


@dataclass
class ChatDelta:
    """What a piece of an answer adds to each part of the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChatOutput:
    """One choice's answer, split into reasoning, content and tool calls as its text arrives."""

    def __init__(self, reasoning_parser: str | None, tool_names: list[str], thinking: bool = True) -> None:
        self.reasoning = REASONING_PARSERS[reasoning_parser](thinking) if reasoning_parser else None
        self.tool_names = tool_names
        self.tools = ToolCallStream(tool_names) if tool_names else None
        self.num_tool_calls = 0

    def parse(self, text: str) -> ChatDelta:
        """A whole answer's parts."""
        reasoning, content = self.reasoning.split(text) if self.reasoning is not None else (None, text)
        calls = []
        if self.tool_names and content:
            content, calls = parse_tool_calls(content, self.tool_names)
        return ChatDelta(reasoning or "", content or "", calls)

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            return self._content("", text)
        return self._content(*self.reasoning.feed(text))

    def finish(self) -> ChatDelta:
        """The rest, once the answer is complete."""
        delta = self._content(*self.reasoning.finish()) if self.reasoning is not None else ChatDelta()
        if self.tools is not None:
            content, calls = self.tools.finish()
            delta += ChatDelta(content=content, tool_calls=calls)
            self.num_tool_calls += len(calls)
        return delta

    def _content(self, reasoning: str, content: str) -> ChatDelta:
        if self.tools is None or not content:
            return ChatDelta(reasoning, content)
        content, calls = self.tools.feed(content)
        self.num_tool_calls += len(calls)
        return ChatDelta(reasoning, content, calls)


@dataclass
class ToolUse:
    """What a request's `tools` and `tool_choice` mean for rendering, sampling and parsing."""

    tools: list[dict[str, Any]] | None  # for the chat template
    parse: list[str]  # names of the functions whose calls are parsed out of the answer
    grammar: str | None  # EBNF the answer must follow ("required" or a named function)


def tool_use(request: ChatCompletionRequest) -> ToolUse:
    """Checks `tools` / `tool_choice` against each other (ValueError names the problem). Without
    tool_choice, tools mean "auto"; "none" renders the tools but parses no calls, as in vLLM."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise ValueError(f"tool_choice {_describe(choice)} needs `tools`")
        return ToolUse(None, [], None)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    names = [tool.function.name for tool in request.tools]
    if len(set(names)) != len(names):
        raise ValueError("tools must have distinct function names")
    if choice == "none":
        return ToolUse(tools, [], None)
    grammar = None
    if choice == "required" or isinstance(choice, NamedToolChoice):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if name is not None and name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})")
        given = [field for field in ("response_format", "regex", "ebnf") if getattr(request, field) is not None]
        if given and not (given == ["response_format"] and request.response_format.type == "text"):
            raise ValueError(f"tool_choice {_describe(choice)} cannot be combined with {given[0]}")
        grammar = tool_call_grammar(tools, name, parallel=request.parallel_tool_calls is not False)
    return ToolUse(tools, names, grammar)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
