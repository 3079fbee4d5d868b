"""What a chat answer's text becomes in the API: reasoning, content and tool calls.

With `--reasoning-parser`, the text up to `</think>` is `reasoning_content`; when the request has tools
(and a tool_choice other than "none"), Qwen's `<tool_call>` blocks in the rest become `tool_calls`.
`ChatOutput` does this for a whole answer (`parse`) or piece by piece as it streams (`feed`, `finish`),
with the same results.

`tool_choice` "required" or a named function is enforced with a grammar (`tool_call_grammar`), so the
answer is calls and nothing else, and their arguments match the functions' schemas. OpenAI's
`{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}` renders every tool but lets
only the allowed ones be called: "required" is the grammar of their calls; "auto" parses only their
calls, and its grammar lets the answer be text in which every `<tool_call>` is a call of one of them
(without a grammar when the request has another constraint: then only the parsing restricts it).
`tool_use` is the one place that interprets `tool_choice`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlm_serve.server.protocol import AllowedToolsChoice, ChatCompletionRequest, NamedToolChoice
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
    grammar: str | None  # EBNF the answer must follow ("required", a named function, allowed_tools)


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
    callable_tools, mode = tools, choice  # the tools the answer may call; "auto", "required" or one function
    if isinstance(choice, AllowedToolsChoice):
        unknown = [name for name in choice.names if name not in names]
        if unknown:
            raise ValueError(
                f"tool_choice allows the function {unknown[0]!r}, which is not among the tools ({', '.join(names)})"
            )
        callable_tools = [tool for tool in tools if tool["function"]["name"] in choice.names]
        mode = choice.allowed_tools.mode
    parallel = request.parallel_tool_calls is not False
    constraint = request.constraint()
    grammar = None
    if mode == "required" or isinstance(mode, NamedToolChoice):
        name = mode.function.name if isinstance(mode, NamedToolChoice) else None
        if name is not None and name not in names:
            raise ValueError(
                f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(names)})"
            )
        if constraint is not None:
            raise ValueError(
                f"tool_choice {_describe(choice)} cannot be combined with {constraint.field}: an answer follows at most "
                "one constraint"
            )
        grammar = tool_call_grammar(callable_tools, name, parallel=parallel)
    elif callable_tools is not tools and constraint is None:  # allowed_tools, "auto"
        grammar = tool_call_grammar(callable_tools, parallel=parallel, text=True)
    return ToolUse(tools, [tool["function"]["name"] for tool in callable_tools], grammar)


def _describe(choice: Any) -> str:
    if isinstance(choice, AllowedToolsChoice):
        return f"allowed_tools {choice.allowed_tools.mode!r}"
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"
