"""What a valid request (`vlm_serve.testing.requests.Call`) must get back, checked from outside as a client
sees it: the oracles of the combined-feature test (tests/deployments/test_combined_features.py) and of
benchmarks/fuzz_soak.py. Needs the test extra (httpx, openai, jsonschema).

`send` posts a call and reads its answer whole (a stream to its end). `problems` lists what is wrong with
an answer: any status but 200; a body or event OpenAI's client types (or SGLang's shapes, for /generate)
do not take; choice counts, finish reasons, log-prob counts against the answer's tokens, usage against
`max_tokens` and `min_tokens`; a streamed answer's chunks against each other (one role, one finish reason
per choice, usage where `stream_options` asks for it, `[DONE]` last); an answer that stopped on its own
against its structured-output constraint; tool calls against the tools and `tool_choice`. `outcome` is
what two answers of a deterministic request must share (texts, tool calls, finish reasons, tokens),
whether streamed or not. `server_problems` tells whether a server is idle, healthy and failed no request.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from vlm_serve.testing.requests import CHAT, COMPLETIONS, GENERATE, GRAMMARS, RESPONSES, SCHEMA, Call, has_constraint

DONE = "[DONE]"
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
FINISH_REASONS = {"stop", "length", "tool_calls"}


@dataclass
class Answer:
    """A server's answer to a call: its status, and its JSON body or, streamed, its events (each event's
    JSON; `[DONE]` as the string; an event that is not JSON as its text, which `problems` reports)."""

    status: int
    body: Any = None
    events: list[Any] | None = None
    text: str = ""


def strict_json(text: str) -> Any:
    """JSON as every client reads it: NaN and Infinity are not JSON (ValueError)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def send(client: httpx.Client, url: str, call: Call) -> Answer:
    """Posts `call` to the server at `url` and reads the whole answer."""
    if not call.stream:
        response = client.post(url + call.endpoint, json=call.body)
        try:
            return Answer(response.status_code, body=strict_json(response.text), text=response.text)
        except ValueError:
            return Answer(response.status_code, text=response.text)
    with client.stream("POST", url + call.endpoint, json=call.body) as response:
        if response.status_code != 200:
            response.read()
            return Answer(response.status_code, text=response.text)
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                try:
                    events.append(DONE if data == DONE else strict_json(data))
                except ValueError:
                    events.append(data)
    return Answer(200, events=events)


@dataclass
class Choice:
    """One choice of an answer, as every endpoint's shape comes down to it."""

    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    tokens: list[Any] | None = None  # its tokens as its log-probs (or /generate's ids) list them; None: not given
    top_counts: list[int] = field(default_factory=list)  # alternatives listed per token


@dataclass
class Reading:
    """An answer read: its choices, the usage it reports (prompt, completion tokens; None if none) and
    what is wrong with its shape."""

    choices: list[Choice] = field(default_factory=list)
    usage: tuple[int, int] | None = None
    problems: list[str] = field(default_factory=list)


def problems(call: Call, answer: Answer) -> list[str]:
    """What is wrong with `answer` to the valid request `call` (nothing: [])."""
    if answer.status != 200:
        return [f"HTTP {answer.status}: {answer.text[:1000]}"]
    reading = read(call, answer)
    return reading.problems + _count_problems(call, reading) + _choice_problems(call, reading)


def outcome(call: Call, answer: Answer) -> list[tuple]:
    """What every answer of a deterministic `call` must share, streamed or not: each choice's text, tool
    calls, finish reason and tokens."""
    return [(c.text, c.tool_calls, c.finish_reason, c.tokens) for c in read(call, answer).choices]


def read(call: Call, answer: Answer) -> Reading:
    reading = Reading()
    try:
        if answer.events is None:
            readers = {
                CHAT: _whole(ChatCompletion, _chat_choice),
                COMPLETIONS: _whole(Completion, _completion_choice),
                RESPONSES: _response,
                GENERATE: _generated,
            }
            readers[call.endpoint](call, answer.body, reading)
        else:
            _stream(call, answer.events, reading)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # a shape no client expects
        reading.problems.append(f"malformed answer ({type(exc).__name__}: {exc})")
    return reading


# ---- what every endpoint must hold ----------------------------------------------------------------------


def expected_choices(call: Call) -> int:
    """Each prompt gets `n` choices; a response is one."""
    if call.endpoint == RESPONSES:
        return 1
    body = call.body
    prompt = body.get("prompt", body.get("text", body.get("input_ids")))
    prompts = len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
    return prompts * call.sampling.get("n", 1)


def limits(call: Call) -> tuple[int, int]:
    """(max_tokens, min_tokens) of the call, in any endpoint's names."""
    s = call.sampling
    most = s.get("max_tokens", s.get("max_completion_tokens", s.get("max_output_tokens", s.get("max_new_tokens"))))
    return most, s.get("min_tokens", s.get("min_new_tokens", 0))


def top_logprobs(call: Call) -> int | None:
    """Alternatives asked per token (None: no log-probs asked)."""
    body = call.body
    if call.endpoint == CHAT:
        return body.get("top_logprobs", 0) if body.get("logprobs") else None
    if call.endpoint == COMPLETIONS:
        return body.get("logprobs")
    if call.endpoint == RESPONSES:
        return body.get("top_logprobs", 0) if body.get("include") else None
    return body.get("top_logprobs_num", 0) if body.get("return_logprob") else None


def tool_grammar(call: Call) -> bool:
    """Whether the call's tools constrain its answer (a forced call, or allowed_tools)."""
    choice = call.body.get("tool_choice")
    return bool(call.body.get("tools")) and choice not in (None, "none", "auto")


def _count_problems(call: Call, reading: Reading) -> list[str]:
    """Choice counts, finish reasons, token counts against log-probs, usage and the length bounds."""
    found = []
    choices, expected = reading.choices, expected_choices(call)
    if len(choices) != expected:
        found.append(f"{len(choices)} choices, not {expected}")
    most, least = limits(call)
    top = top_logprobs(call)
    free = not (_constraint(call) or tool_grammar(call))  # (a grammar ends an answer before min_tokens)
    for i, c in enumerate(choices):
        if c.finish_reason not in FINISH_REASONS:
            found.append(f"choice {i} finished with {c.finish_reason!r}")
        if top is not None and c.tokens is None:
            found.append(f"choice {i} has no log-probs")
        if top is not None and c.top_counts and call.endpoint != COMPLETIONS and set(c.top_counts) != {top}:
            found.append(f"choice {i} lists {sorted(set(c.top_counts))} alternatives per token, not {top}")
        if top is not None and call.endpoint == COMPLETIONS and not all(1 <= k <= top + 1 for k in c.top_counts):
            found.append(f"choice {i} lists {c.top_counts} entries per token, not 1 to {top + 1}")
        if c.tokens is not None:
            if not 1 <= len(c.tokens) <= most:
                found.append(f"choice {i} has {len(c.tokens)} tokens, not 1 to max_tokens={most}")
            if c.finish_reason == "length" and len(c.tokens) != most:
                found.append(f"choice {i} finished for its length after {len(c.tokens)} tokens, not {most}")
            if free and len(c.tokens) < least:
                found.append(f"choice {i} has {len(c.tokens)} tokens, fewer than min_tokens={least}")
    if reading.usage is not None:
        prompt, completion = reading.usage
        counted = [len(c.tokens) for c in choices if c.tokens is not None]
        if len(counted) == len(choices) and sum(counted) != completion:
            found.append(f"usage counts {completion} completion tokens, the choices {sum(counted)}")
        if not len(choices) <= completion <= len(choices) * most:
            found.append(f"usage counts {completion} completion tokens for {len(choices)} choices of max_tokens={most}")
        if free and completion < len(choices) * least:
            found.append(f"usage counts {completion} completion tokens, fewer than min_tokens={least} per choice")
        if len(choices) == 1 and choices[0].finish_reason == "length" and completion != most:
            found.append(f"the answer finished for its length after {completion} tokens, not {most}")
        if prompt < 1:
            found.append(f"usage counts {prompt} prompt tokens")
    return found


def _choice_problems(call: Call, reading: Reading) -> list[str]:
    """An answer that ended on its own follows its constraint; tool calls are of callable tools."""
    found = []
    body = call.body
    sampling = call.sampling
    # (stops may end it mid-grammar; an echo puts the last message's text before it)
    stopped_early = sampling.get("stop") or sampling.get("stop_token_ids") or sampling.get("stop_regex")
    check = None if body.get("echo") else _constraint(call)
    names = _callable(call)
    for i, c in enumerate(reading.choices):
        if check is not None and c.finish_reason == "stop" and not stopped_early and not body.get("tools"):
            problem = check(c.text)
            if problem:
                found.append(f"choice {i} does not follow its constraint ({problem}): {c.text!r}")
        for name, arguments in c.tool_calls:
            if name not in names:
                found.append(f"choice {i} calls {name!r}, which tool_choice does not allow ({sorted(names)})")
                continue
            try:
                parsed = json.loads(arguments)
            except ValueError:
                found.append(f"choice {i} calls {name} with arguments that are not JSON: {arguments!r}")
                continue
            if tool_grammar(call) and (problem := _schema_problem(parsed, _parameters(call, name))):
                found.append(f"choice {i} calls {name} with arguments its schema refuses ({problem})")
        if c.finish_reason == "tool_calls" and not c.tool_calls:
            found.append(f"choice {i} finished with tool_calls but made none")
        if call.endpoint == CHAT and c.tool_calls and c.finish_reason == "stop":
            found.append(f"choice {i} made tool calls but finished with 'stop'")
    return found


def _schema_problem(value: Any, schema: dict[str, Any] | None) -> str:
    try:
        jsonschema.validate(value, schema or {"type": "object"})
    except jsonschema.ValidationError as exc:
        return exc.message
    return ""


def _json_check(schema: dict[str, Any]) -> Any:
    def check(text: str) -> str:
        try:
            return _schema_problem(json.loads(text), schema)
        except ValueError as exc:
            return f"not JSON: {exc}"

    return check


def _regex_check(pattern: str) -> Any:
    return lambda text: "" if re.fullmatch(pattern, text) else f"not a match of {pattern!r}"


def _constraint(call: Call) -> Any:
    """A check of an answer against the call's constraint: text -> what is wrong ('' if nothing); None if
    the call has none."""
    body = call.sampling
    if call.endpoint == RESPONSES:
        fmt = (body.get("text") or {}).get("format", {})
        body = {"response_format": {"type": fmt.get("type", "text"), "json_schema": {"schema": fmt.get("schema")}}}
    if call.endpoint in (CHAT, COMPLETIONS, RESPONSES) and not has_constraint(body):
        return None
    response_format = body.get("response_format") or {}
    outputs = body.get("structured_outputs") or {}
    if response_format.get("type") == "json_object" or outputs.get("json_object"):
        return _json_check({"type": "object"})
    if response_format.get("type") == "json_schema" or "json" in outputs or "json_schema" in body:
        return _json_check(SCHEMA)
    if "regex" in body or "regex" in outputs:
        return _regex_check(body.get("regex", outputs.get("regex")))
    if "choice" in outputs:
        return lambda text: "" if text in outputs["choice"] else f"not one of {outputs['choice']}"
    if "ebnf" in body or "grammar" in outputs:
        return _regex_check(GRAMMARS[body.get("ebnf", outputs.get("grammar"))])
    return None


def _callable(call: Call) -> set[str]:
    """The names of the functions the answer may call."""
    body = call.body
    tools = body.get("tools") or []
    names = {t["function"]["name"] if call.endpoint == CHAT else t["name"] for t in tools}
    choice = body.get("tool_choice")
    if choice == "none":
        return set()
    if isinstance(choice, dict) and choice["type"] == "function":
        return {choice["function"]["name"] if call.endpoint == CHAT else choice["name"]}
    if isinstance(choice, dict):
        allowed = choice["allowed_tools"]["tools"] if call.endpoint == CHAT else choice["tools"]
        return {t["function"]["name"] if call.endpoint == CHAT else t["name"] for t in allowed}
    return names


def _parameters(call: Call, name: str) -> dict[str, Any] | None:
    for tool in call.body.get("tools") or []:
        function = tool["function"] if call.endpoint == CHAT else tool
        if function["name"] == name:
            return function.get("parameters")
    return None


# ---- whole answers -------------------------------------------------------------------------------------


def _validated(model: Any, value: Any, reading: Reading, what: str) -> bool:
    try:
        model.model_validate(value) if hasattr(model, "model_validate") else model.validate_python(value)
        return True
    except ValidationError as exc:
        reading.problems.append(f"{what} is not what OpenAI's client reads: {exc.errors()[0]}")
        return False


def _indexed(items: list[dict[str, Any]], reading: Reading) -> list[dict[str, Any]]:
    """Choices in index order; their indices must be 0, 1, ..."""
    indices = [item["index"] for item in items]
    if sorted(indices) != list(range(len(items))):
        reading.problems.append(f"choice indices {indices}")
    return sorted(items, key=lambda item: item["index"])


def _usage(usage: dict[str, Any] | None, reading: Reading) -> None:
    if usage is None:
        reading.problems.append("no usage")
        return
    reading.usage = (usage["prompt_tokens"], usage["completion_tokens"])
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        reading.problems.append(f"usage's total is not prompt + completion: {usage}")


def _whole(model: Any, read_choice: Any) -> Any:
    """A reader of a whole chat or text completion: OpenAI's `model` of it, then each choice's
    `read_choice(call, choice, reading)` in index order, then its usage."""

    def read_whole(call: Call, body: Any, reading: Reading) -> None:
        if not _validated(model, body, reading, f"the {model.__name__}"):
            return
        reading.choices = [read_choice(call, choice, reading) for choice in _indexed(body["choices"], reading)]
        _usage(body.get("usage"), reading)

    return read_whole


def _chat_choice(call: Call, choice: dict[str, Any], reading: Reading) -> Choice:
    message = choice["message"]
    c = Choice(message.get("content") or "", choice["finish_reason"])
    c.tool_calls = [(t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls") or []]
    _chat_logprobs(call, c, choice.get("logprobs"), reading)
    return c


def _completion_choice(call: Call, choice: dict[str, Any], reading: Reading) -> Choice:
    c = Choice(choice["text"], choice["finish_reason"])
    _completion_logprobs(call, c, choice.get("logprobs"), reading)
    return c


def _logprobs_given(call: Call, logprobs: dict[str, Any] | None, reading: Reading) -> bool:
    """Whether a choice (or chunk) has log-probs; they must have been asked for."""
    if logprobs is not None and top_logprobs(call) is None:
        reading.problems.append("log-probs that were not asked for")
    return logprobs is not None


def _chat_logprobs(call: Call, c: Choice, logprobs: dict[str, Any] | None, reading: Reading) -> None:
    if _logprobs_given(call, logprobs, reading):
        entries = logprobs["content"]
        c.tokens = (c.tokens or []) + [entry["token"] for entry in entries]
        c.top_counts += [len(entry["top_logprobs"]) for entry in entries]


def _completion_logprobs(call: Call, c: Choice, logprobs: dict[str, Any] | None, reading: Reading) -> None:
    if _logprobs_given(call, logprobs, reading):
        columns = [logprobs[name] for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
        if len({len(column) for column in columns}) != 1:
            reading.problems.append(f"log-prob lists of lengths {[len(column) for column in columns]}")
        c.tokens = (c.tokens or []) + logprobs["tokens"]
        c.top_counts += [len(top) for top in logprobs["top_logprobs"]]


def _response(call: Call, body: Any, reading: Reading) -> None:
    if not _validated(Response, body, reading, "the response"):
        return
    status = body["status"]
    c = Choice(finish_reason={"completed": "stop", "incomplete": "length"}.get(status, status))
    if status == "incomplete" and body["incomplete_details"] != {"reason": "max_output_tokens"}:
        reading.problems.append(f"incomplete for {body['incomplete_details']}")
    for item in body["output"]:
        if item["type"] == "message":
            for part in item["content"]:
                c.text += part["text"]
                if part.get("logprobs") is not None and top_logprobs(call) is not None:
                    c.tokens = (c.tokens or []) + [entry["token"] for entry in part["logprobs"]]
                    c.top_counts += [len(entry["top_logprobs"]) for entry in part["logprobs"]]
        elif item["type"] == "function_call":
            c.tool_calls.append((item["name"], item["arguments"]))
    if c.tokens is None and top_logprobs(call) is not None:
        c.tokens = []  # (an answer of tool calls only has no message)
    reading.choices.append(c)
    usage = body["usage"]
    reading.usage = (usage["input_tokens"], usage["output_tokens"])
    if usage["total_tokens"] != usage["input_tokens"] + usage["output_tokens"]:
        reading.problems.append(f"usage's total is not input + output: {usage}")


def _generated(call: Call, body: Any, reading: Reading) -> None:
    results = body if isinstance(body, list) else [body]
    if isinstance(body, list) != (expected_choices(call) > 1):
        shape = "list" if isinstance(body, list) else "single result"
        reading.problems.append(f"a {shape} for {expected_choices(call)} choices")
    for result in results:
        reading.choices.append(_generated_choice(call, result, reading))
    reading.usage = (sum(r["meta_info"]["prompt_tokens"] for r in results), sum(len(r["output_ids"]) for r in results))


def _generated_choice(call: Call, result: dict[str, Any], reading: Reading) -> Choice:
    """One /generate result: SGLang's text, output_ids and meta_info."""
    meta, ids = result["meta_info"], result["output_ids"]
    finish = meta["finish_reason"]
    c = Choice(result["text"], finish["type"] if finish else None, tokens=ids)
    if meta["completion_tokens"] != len(ids) or not all(isinstance(i, int) for i in ids):
        reading.problems.append(f"meta_info counts {meta['completion_tokens']} tokens of output_ids {ids}")
    if c.finish_reason == "length" and finish.get("length") != limits(call)[0]:
        reading.problems.append(f"finish_reason {finish}")
    top = top_logprobs(call)
    if top is not None:
        entries = meta["output_token_logprobs"]
        if [entry[1] for entry in entries] != ids:
            reading.problems.append(f"output_token_logprobs name tokens {[e[1] for e in entries]}, not {ids}")
        with_text = call.body.get("return_text_in_logprobs", False)
        if not all(isinstance(entry[2], str) == with_text for entry in entries):
            reading.problems.append(f"output_token_logprobs texts {[e[2] for e in entries]}")
        if top:
            c.top_counts = [len(alternatives) for alternatives in meta["output_top_logprobs"]]
            if len(c.top_counts) != len(ids):
                reading.problems.append(f"{len(c.top_counts)} output_top_logprobs for {len(ids)} tokens")
    return c


# ---- streams --------------------------------------------------------------------------------------------


def _stream(call: Call, events: list[Any], reading: Reading) -> None:
    """A stream's events, checked as events, then read as the whole answer they add up to."""
    if not events:
        reading.problems.append("an empty stream")
        return
    bad = [
        event
        for event in events
        if not isinstance(event, dict) and event != DONE or isinstance(event, dict) and _is_error(event)
    ]
    if bad:
        reading.problems.append(f"stream events {bad[:2]}")
        return
    if call.endpoint == RESPONSES:
        _response_stream(call, events, reading)
        return
    if events[-1] != DONE or events.count(DONE) != 1:
        reading.problems.append("the stream does not end with one [DONE]")
    chunks = [event for event in events if event != DONE]
    read_chunks = {CHAT: _chat_stream, COMPLETIONS: _completion_stream, GENERATE: _generated_stream}[call.endpoint]
    read_chunks(call, chunks, reading)


def _is_error(event: dict[str, Any]) -> bool:
    """An error event: `{"error": {...}}` (chat, completions, /generate), or a response's `error` event."""
    return "error" in event or event.get("type") == "error"


def _stream_usage(call: Call, chunks: list[dict[str, Any]], reading: Reading) -> None:
    """Usage in a last chunk without choices when `stream_options.include_usage` asks for it, in every
    chunk with `continuous_usage_stats` too, and nowhere else."""
    options = call.body.get("stream_options") or {}
    wanted, continuous = options.get("include_usage", False), options.get("continuous_usage_stats", False)
    last = chunks[-1] if chunks else {}
    if wanted:
        if last.get("choices") != [] or last.get("usage") is None:
            reading.problems.append(f"include_usage, but the last chunk is {last}")
        else:
            _usage(last["usage"], reading)
        if continuous and any(chunk.get("usage") is None for chunk in chunks):
            reading.problems.append("continuous_usage_stats, but a chunk without usage")
    before_last = chunks[: -1 if wanted else None]
    if any(chunk.get("usage") is not None for chunk in before_last) and not (wanted and continuous):
        reading.problems.append("usage in a chunk, not asked for")
    if any(chunk.get("choices") == [] for chunk in before_last):
        reading.problems.append("a chunk without choices before the end")


def _finish(c: Choice, reason: str | None, i: int, reading: Reading) -> None:
    if reason is not None:
        if c.finish_reason is not None:
            reading.problems.append(f"choice {i} finished twice")
        c.finish_reason = reason
    elif c.finish_reason is not None:
        reading.problems.append(f"choice {i} has a chunk after its finish reason")


def _chat_stream(call: Call, chunks: list[dict[str, Any]], reading: Reading) -> None:
    choices: dict[int, Choice] = {}
    roles: dict[int, int] = {}
    for chunk in chunks:
        if not _validated(ChatCompletionChunk, chunk, reading, "a chunk"):
            return
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            c = choices.setdefault(i, Choice())
            if delta.get("role") is not None:
                roles[i] = roles.get(i, 0) + 1
            elif i not in roles:
                reading.problems.append(f"choice {i} starts without its role")
            c.text += delta.get("content") or ""
            for call_delta in delta.get("tool_calls") or []:
                function = call_delta["function"]
                if call_delta["index"] != len(c.tool_calls) or not call_delta.get("id"):
                    reading.problems.append(f"choice {i}'s tool call delta {call_delta}")
                c.tool_calls.append((function["name"], function["arguments"]))
            _chat_logprobs(call, c, choice.get("logprobs"), reading)
            _finish(c, choice.get("finish_reason"), i, reading)
    if any(count != 1 for count in roles.values()):
        reading.problems.append(f"roles per choice {roles}")
    _streamed(call, chunks, choices, reading)


def _completion_stream(call: Call, chunks: list[dict[str, Any]], reading: Reading) -> None:
    choices: dict[int, Choice] = {}
    for chunk in chunks:
        if chunk.get("object") != "text_completion" or not isinstance(chunk.get("choices"), list):
            reading.problems.append(f"a chunk {chunk}")
            return
        for choice in chunk["choices"]:
            i = choice["index"]
            c = choices.setdefault(i, Choice())
            c.text += choice["text"]
            _completion_logprobs(call, c, choice.get("logprobs"), reading)
            _finish(c, choice.get("finish_reason"), i, reading)
    _streamed(call, chunks, choices, reading)


def _streamed(call: Call, chunks: list[dict[str, Any]], choices: dict[int, Choice], reading: Reading) -> None:
    """The choices a chat or text completion's chunks added up to, by index (0, 1, ...), and its usage."""
    if top_logprobs(call) is not None:
        for c in choices.values():
            c.tokens = c.tokens or []
    reading.choices = [choices[i] for i in sorted(choices)]
    if sorted(choices) != list(range(len(choices))):
        reading.problems.append(f"choice indices {sorted(choices)}")
    _stream_usage(call, chunks, reading)


def _generated_stream(call: Call, chunks: list[dict[str, Any]], reading: Reading) -> None:
    """SGLang's chunks hold each choice's text and ids so far; the last one of a choice finishes it."""
    several = expected_choices(call) > 1
    latest: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if ("index" in chunk) != several:
            reading.problems.append(f"a chunk {'without' if several else 'with'} an index")
            return
        i = chunk.get("index", 0)
        before = latest.get(i)
        if before is not None:
            if before["meta_info"]["finish_reason"] is not None:
                reading.problems.append(f"choice {i} has a chunk after its finish reason")
            if chunk["output_ids"][: len(before["output_ids"])] != before["output_ids"]:
                went = f"{before['output_ids']} to {chunk['output_ids']}"
                reading.problems.append(f"choice {i}'s output_ids went from {went}")
        latest[i] = chunk
    _generated(call, [latest[i] for i in sorted(latest)] if several else latest.get(0), reading)


def _response_stream(call: Call, events: list[dict[str, Any]], reading: Reading) -> None:
    """Typed events numbered from 0, `response.created` first and `response.completed` (or `incomplete`)
    last, whose response is the answer; its text is the text deltas'."""
    for event in events:
        if not _validated(STREAM_EVENT, event, reading, f"a {event.get('type')} event"):
            return
    numbers = [event["sequence_number"] for event in events]
    if numbers != list(range(len(events))):
        reading.problems.append(f"sequence numbers {numbers}")
    kinds = [event["type"] for event in events]
    if kinds[0] != "response.created" or kinds[-1] not in ("response.completed", "response.incomplete"):
        reading.problems.append(f"events {kinds[0]} ... {kinds[-1]}")
        return
    _response(call, events[-1]["response"], reading)
    deltas = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    if reading.choices and deltas != reading.choices[0].text:
        text = reading.choices[0].text
        reading.problems.append(f"the text deltas add up to {deltas!r}, the response's text is {text!r}")


# ---- the server -----------------------------------------------------------------------------------------


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    """The server's /metrics samples by name (labelled samples of one name added up)."""
    values: dict[str, float] = {}
    response = client.get(url + "/metrics")
    response.raise_for_status()
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0].removeprefix("vlm_serve:")
            values[name] = values.get(name, 0.0) + float(value)
    return values


def server_problems(client: httpx.Client, url: str, timeout: float = 60) -> list[str]:
    """What is wrong with a server after its requests have all been answered: requests still running,
    waiting or encoding after `timeout` seconds; requests it could not serve (5xx); encoder ranks that
    died; caches it cannot flush (its scheduler is not idle); /health not ok. (A scheduler whose idle
    self-check fails raises, and the server stops: the caller's check of its processes sees that.)"""
    deadline = time.monotonic() + timeout
    names = ("num_requests_running", "num_requests_waiting", "num_requests_encoding")
    while busy := {name: value for name, value in metrics(client, url).items() if name in names and value}:
        if time.monotonic() > deadline:
            return [f"{url} is still busy: {busy}"]
        time.sleep(0.2)
    found = []
    counters = metrics(client, url)
    if counters.get("request_failure_total", 0):
        found.append(f"{url} failed {counters['request_failure_total']:g} request(s) (5xx)")
    if counters.get("encoder_restarts_total", 0):
        found.append(f"{url} restarted {counters['encoder_restarts_total']:g} encoder rank(s) that died")
    flushed = client.post(url + "/flush_cache")
    if flushed.status_code != 200:
        found.append(f"{url} cannot flush its caches: {flushed.text}")
    health = client.get(url + "/health")
    if health.status_code != 200:
        found.append(f"{url}/health: {health.status_code} {health.text}")
    return found


def judge(client: httpx.Client, url: str, call: Call, reference: str | None = None) -> list[str]:
    """Sends `call` to the server at `url` and lists what is wrong: with its answer (`problems`); for a
    deterministic call, with a second answer, whole, that must have the same `outcome`; for a greedy one,
    with the answer of the `reference` server (the same model without drafts), which must be the same. A
    request without an answer (the connection failed, or timed out) is a problem too."""
    try:
        answer = send(client, url, call)
        found = problems(call, answer)
        if found or not call.deterministic:
            return found
        whole = call.unstreamed()
        servers = [("the second time", url)]
        if call.greedy and reference not in (None, url):  # (it serves the set-ups' adapter too)
            servers.append(("from the reference server", reference))
        for where, server in servers:
            again = send(client, server, whole)
            found += [f"{where}: {problem}" for problem in problems(whole, again)]
            if not found and outcome(call, answer) != outcome(whole, again):
                found.append(f"answered differently {where}: {outcome(call, answer)} then {outcome(whole, again)}")
        return found
    except httpx.HTTPError as exc:
        return [f"no answer: {type(exc).__name__}: {exc}"]


KINDS = (  # (what a problem says, its kind), the first match wins
    ("HTTP 5", "5xx"),
    ("HTTP 4", "a valid request refused (4xx)"),
    ("no answer", "no answer (connection failed or timed out)"),
    ("exited with code", "a process died"),
    ("is not ok", "a server unhealthy"),
    ("answered differently the second time", "not deterministic"),
    ("answered differently from the reference server", "not as the reference (no drafts)"),
    ("not what OpenAI's client reads", "malformed answer"),
    ("does not follow its constraint", "constraint not followed"),
    ("calls ", "tool calls"),
)


def kind(problems: list[str]) -> str:
    """What kind of failure a request's problems are, for a soak's tally (the first problem decides)."""
    first = problems[0]
    return next(
        (name for text, name in KINDS if text in first),
        "malformed answer" if "malformed" in first or "stream" in first else "counts (choices, tokens, usage)",
    )
