"""The Responses API (`/v1/responses`) on top of chat completions.

A request's input items (after those of its `previous_response_id`) become chat messages, and its
`instructions`, `tools`, `tool_choice` and `text.format` the chat request's system message, tools,
tool_choice and response_format: what is generated then goes through `OpenAIServing.start_chat`, as a
chat completion does. The answer's reasoning, text and tool calls become output items (`OutputBuilder`,
which also writes the typed events of a stream). Responses with `store` (the default) are kept in memory,
the most recent `--responses-store-size` of them, for `previous_response_id`, GET, DELETE and, for
`background` ones, cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from vlm_serve.errors import ApiError, BadRequest, InternalError, NotFound
from vlm_serve.messages.frontend import StrOut
from vlm_serve.multimodal.processor import PartParam
from vlm_serve.server.chat_output import ChatDelta
from vlm_serve.server.openai_api import ChatRun, OpenAIServing
from vlm_serve.server.output_protocol import now
from vlm_serve.server.protocol import ChatCompletionRequest, SamplingSettings
from vlm_serve.server.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputFile,
    InputImage,
    InputItemList,
    InputText,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningInputItem,
    ReasoningOut,
    ReasoningText,
    Refusal,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)

logger = logging.getLogger(__name__)

LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the answer's logprobs


# ---- input items -> chat messages -----------------------------------------------------------------------


def input_messages(items: str | list[Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """Chat messages of a request's input, and the index of the input item each one starts with: a
    string is one user message; a function call joins the assistant message before it (or starts one),
    a call's output is a tool message, and replayed reasoning goes with the assistant message after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [0]
    messages: list[dict[str, Any]] = []
    origins: list[int] = []
    reasoning = None
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = item.content
            if not isinstance(content, str):
                content = [_chat_part(part, f"input[{i}].content[{j}]") for j, part in enumerate(content)]
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif isinstance(item, ReasoningInputItem):
            texts = [part.get("text", "") for part in (item.content or item.summary)]
            reasoning = "\n".join(texts)
        origins += [i] * (len(messages) - len(origins))
    return [{k: v for k, v in m.items() if v is not None} for m in messages], origins


def part_param(first: int, origins: list[int]) -> PartParam:
    """Where a part of the chat request's messages is in the Responses request: `input[i].content[j]`
    for part j of input item i, whose message is the chat request's `first` + k (`origins[k]` is i);
    `previous_response_id` for one of the messages before (the conversation that response continues)."""

    def param(message: int, part: int) -> str:
        if message < first:
            return "previous_response_id"
        return f"input[{origins[message - first]}].content[{part}]"

    return param


def _chat_part(part: Any, where: str) -> dict[str, Any]:
    """A content part as chat completions has it."""
    if isinstance(part, InputText):
        return {"type": "text", "text": part.text}
    if isinstance(part, Refusal):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, InputFile) or (isinstance(part, InputImage) and part.file_id is not None):
        raise BadRequest(f"{where}: files by file_id are not supported (this server has no Files API)", param=where)
    if isinstance(part, InputImage):
        chat: dict[str, Any] = {"type": "image_url", "image_url": {"url": part.image_url} if part.image_url else None}
        if part.detail is not None and chat["image_url"] is not None:
            chat["image_url"]["detail"] = part.detail
        if part.uuid is not None:
            chat["uuid"] = part.uuid
        return chat
    return part.model_dump(exclude_none=True)  # a chat completions part (text, image_url, video_url)


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that generates a response to `messages`."""
    logprobs = LOGPROBS in (request.include or [])
    body: dict[str, Any] = {
        **{name: getattr(request, name) for name in SamplingSettings.model_fields},
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "priority": request.priority,
        "logprobs": logprobs,
        "top_logprobs": request.top_logprobs if logprobs else None,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
    body["messages"] = system + messages
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in request.tools
        ]
        body["tool_choice"] = _chat_tool_choice(request.tool_choice)
    elif request.tool_choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice {request.tool_choice!r} needs `tools`", param="tool_choice")
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.json_schema is None:
            raise BadRequest("text.format of type json_schema needs a schema", param="text.format.schema")
        schema = {"name": text_format.name, "schema": text_format.json_schema, "strict": text_format.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if request.reasoning is not None and request.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}  # Qwen3's way to answer without thinking
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise BadRequest(f"invalid request: {where} (as a chat message): {problem['msg']}") from None


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    tools = [{"type": "function", "function": {"name": tool.get("name")}} for tool in choice.tools]
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": tools}}


# ---- output items ----------------------------------------------------------------------------------------


class OutputBuilder:
    """A response's output items, built from its answer's pieces (reasoning, text, tool calls) as they
    come, with the stream events that announce them (`response.output_item.added`, `...delta`,
    `...done`). A whole answer is one piece."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.open: OutputMessage | ReasoningOut | None = None  # the item text is being added to
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def add(self, delta: ChatDelta, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._open(ReasoningOut)
            self.open.content[0].text += delta.reasoning
            events.append(self._part_event("response.reasoning_text.delta", delta=delta.reasoning))
        if delta.content or logprobs:
            events += self._open(OutputMessage)
            text = self.open.content[0]
            text.text += delta.content
            if logprobs is not None:
                text.logprobs = (text.logprobs or []) + logprobs
            events.append(self._part_event("response.output_text.delta", delta=delta.content, logprobs=logprobs or []))
        for call in delta.tool_calls:
            events += self._close()
            item = FunctionCallOut(
                id=_new_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress"
            )
            self.items.append(item)
            index = len(self.items) - 1
            events.append(self.event("response.output_item.added", output_index=index, item=_dump(item)))
            item.arguments = call.arguments
            where = {"item_id": item.id, "output_index": index}
            events.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
            events.append(
                self.event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments)
            )
            item.status = "completed"
            events.append(self.event("response.output_item.done", output_index=index, item=_dump(item)))
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The last events of the output: the open item is done (an answer of nothing at all is an empty
        message); every item gets the response's status."""
        events = []
        if not any(isinstance(item, (OutputMessage, FunctionCallOut)) for item in self.items):
            events += self._open(OutputMessage)
        if isinstance(self.open, OutputMessage) and status == "incomplete":
            self.open.status = "incomplete"
        events += self._close()
        return events

    def _open(self, kind: type) -> list[dict[str, Any]]:
        if isinstance(self.open, kind):
            return []
        events = self._close()
        if kind is ReasoningOut:
            item, part = ReasoningOut(id=_new_id("rs"), status="in_progress"), ReasoningText(text="")
        else:
            item, part = OutputMessage(id=_new_id("msg"), status="in_progress"), OutputText(text="")
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=_dump(item)))
        item.content.append(part)
        events.append(self._part_event("response.content_part.added", part=_dump(part)))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        self.open = item  # (for the events' ids)
        part = item.content[0]
        if isinstance(item, ReasoningOut):
            events = [self._part_event("response.reasoning_text.done", text=part.text)]
        else:
            events = [self._part_event("response.output_text.done", text=part.text, logprobs=part.logprobs or [])]
        events.append(self._part_event("response.content_part.done", part=_dump(part)))
        self.open = None
        if item.status == "in_progress":
            item.status = "completed"
        events.append(self.event("response.output_item.done", output_index=self.items.index(item), item=_dump(item)))
        return events

    def _part_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        where = {"item_id": self.open.id, "output_index": self.items.index(self.open), "content_index": 0}
        return self.event(kind, **where, **fields)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # (OpenAI's ids: resp_..., msg_..., fc_...)


def _dump(item: Any) -> dict[str, Any]:
    return item.model_dump(exclude_none=True)


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """A response's output as the chat message it is in the conversation that continues it."""
    message: dict[str, Any] = {"role": "assistant"}
    texts = [part.text for item in items if isinstance(item, OutputMessage) for part in item.content]
    reasoning = [part.text for item in items if isinstance(item, ReasoningOut) for part in item.content]
    calls = [
        {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        for item in items
        if isinstance(item, FunctionCallOut)
    ]
    if texts:
        message["content"] = "".join(texts)
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


# ---- the store -------------------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict[str, Any]]  # the conversation through this response (no instructions)
    input_items: list[dict[str, Any]]  # the request's own input items
    task: asyncio.Task | None = field(default=None, repr=False)  # a background response's generation


class ResponseStore:
    """The stored responses, at most `capacity` (the oldest go first), by id."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self.responses[stored.response.id] = stored
        self.responses.move_to_end(stored.response.id)
        while len(self.responses) > self.capacity:
            _, oldest = self.responses.popitem(last=False)
            if oldest.task is not None:
                oldest.task.cancel()

    def get(self, response_id: str) -> StoredResponse:
        stored = self.responses.get(response_id)
        if stored is None:
            raise NotFound(f"no stored response with id {response_id!r}", param="response_id")
        return stored

    def pop(self, response_id: str) -> StoredResponse:
        stored = self.get(response_id)
        del self.responses[response_id]
        return stored


# ---- serving ---------------------------------------------------------------------------------------------


class ResponsesServing:
    """The /v1/responses endpoints for one served model."""

    def __init__(self, serving: OpenAIServing, capacity: int) -> None:
        self.serving = serving
        self.store = ResponseStore(capacity)

    async def create(self, request: ResponsesRequest) -> ResponseObject | AsyncIterator[str]:
        request.refusals()
        self.serving.check_model(request.model)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.responses.get(request.previous_response_id)
            if previous is None:
                raise BadRequest(
                    f"Previous response with id {request.previous_response_id!r} not found (responses are kept "
                    "in memory, the most recent --responses-store-size of them).",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if previous.response.status in ("queued", "in_progress"):
                raise BadRequest(
                    f"response {request.previous_response_id!r} is still {previous.response.status}",
                    param="previous_response_id",
                )
            history = previous.messages
        new, origins = input_messages(request.input)
        messages = history + new
        first = len(history) + (request.instructions is not None)  # (the instructions are a system message)
        run = await self.serving.start_chat(chat_request(request, messages), part_param(first, origins))
        response = self._new_response(request)
        items = [] if isinstance(request.input, str) else [item.model_dump(exclude_none=True) for item in request.input]
        stored = StoredResponse(
            response, messages, items or [{"type": "message", "role": "user", "content": request.input}]
        )
        if request.background:
            response.status = "queued"
            stored.task = asyncio.get_running_loop().create_task(self._background(run, stored))
            self.store.put(stored)
            return response.model_copy(deep=True)
        if request.stream:
            return self._stream(run, stored, request.store)
        outs = (await self.serving.collect(run.choices))[0]
        builder = OutputBuilder()
        builder.add(self._answer(run, outs), self._logprobs(run, outs))
        self._complete(stored, run, outs, builder)
        if request.store:
            self.store.put(stored)
        return response

    def get(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> DeletedResponse:
        stored = self.store.pop(response_id)
        if stored.task is not None:
            stored.task.cancel()
        return DeletedResponse(id=response_id)

    async def cancel(self, response_id: str) -> ResponseObject:
        """Stops a background response that is still running (its status becomes "cancelled"); a
        cancelled one is returned as it is."""
        stored = self.store.get(response_id)
        if stored.task is None:
            raise BadRequest("only responses created with background: true can be cancelled", param="response_id")
        if stored.response.status not in ("queued", "in_progress", "cancelled"):
            raise BadRequest(f"response {response_id!r} is already {stored.response.status}", param="response_id")
        stored.task.cancel()
        await asyncio.wait((stored.task,))  # its request is aborted before this returns
        return stored.response

    def input_items(self, response_id: str) -> InputItemList:
        """The response's own input items, as OpenAI lists them: each with an id, a message's text as
        a content part."""
        data = []
        for i, item in enumerate(self.store.get(response_id).input_items):
            item = {**item, "id": item.get("id") or f"msg_{response_id}_{i}"}
            if item.get("type") == "message" and isinstance(item["content"], str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            data.append(item)
        return InputItemList(
            data=data, first_id=data[0]["id"] if data else None, last_id=data[-1]["id"] if data else None
        )

    # ---- pieces ------------------------------------------------------------------------------------

    def _new_response(self, request: ResponsesRequest) -> ResponseObject:
        text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text is not None else None
        tool_choice = request.tool_choice
        return ResponseObject(
            id=_new_id("resp"),
            created_at=now(),
            status="in_progress",
            model=self.serving.model_name,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning.model_dump(exclude_none=True) if request.reasoning is not None else None,
            store=request.store,
            background=request.background,
            temperature=request.temperature,
            top_p=request.top_p,
            top_logprobs=request.top_logprobs,
            text=text or {"format": {"type": "text"}},
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            tools=request.tools,
            user=request.user,
        )

    def _answer(self, run: ChatRun, outs: list[StrOut]) -> ChatDelta:
        return run.parsers[0].parse("".join(out.text for out in outs))

    def _logprobs(self, run: ChatRun, outs: list[StrOut]) -> list[dict[str, Any]] | None:
        if not run.choices[0].sampling_params.logprobs:
            return None
        return [t.model_dump() for out in outs for t in self.serving._token_logprobs(out)]

    def _complete(self, stored: StoredResponse, run: ChatRun, outs: list[StrOut], builder: OutputBuilder) -> list[dict]:
        """Fills in the finished response (its output, status and usage); returns the output's last events."""
        response = stored.response
        finish = outs[-1].finish_reason if outs else "abort"
        status = {"length": "incomplete", "abort": "cancelled"}.get(finish, "completed")
        events = builder.finish(status)
        response.output, response.status, response.completed_at = builder.items, status, now()
        if status == "incomplete":
            response.incomplete_details = {"reason": "max_output_tokens"}
        usage = self.serving._usage([run.input], [outs])
        reasoning = "".join(
            part.text for item in builder.items if isinstance(item, ReasoningOut) for part in item.content
        )
        details = usage.prompt_tokens_details
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=details.cached_tokens,
                cache_write_tokens=usage.prompt_tokens - details.cached_tokens,
                media=[m.model_dump() for m in details.media],
            ),
            # the reasoning text's tokens (the answer's tokens are not split where the text is)
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=len(self.serving.tm.tokenizer.encode(reasoning)) if reasoning else 0
            ),
        )
        stored.messages = stored.messages + [assistant_message(builder.items)]
        return events

    async def _background(self, run: ChatRun, stored: StoredResponse) -> None:
        stored.response.status = "in_progress"
        builder = OutputBuilder()
        outs: list[StrOut] = []
        try:
            async with contextlib.aclosing(self.serving.tm.generate(run.choices)) as outputs:
                async for _, out in outputs:
                    outs.append(out)
            builder.add(self._answer(run, outs), self._logprobs(run, outs))
            self._complete(stored, run, outs, builder)
        except asyncio.CancelledError:
            stored.response.status, stored.response.completed_at = "cancelled", now()
            raise
        except Exception as exc:  # noqa: BLE001 - the failure is the response's
            self._fail(stored, exc)

    def _fail(self, stored: StoredResponse, exc: Exception) -> ApiError:
        if not isinstance(exc, ApiError):
            logger.error("a response failed", exc_info=exc)
            exc = InternalError("the server failed while generating this response")
        stored.response.status, stored.response.completed_at = "failed", now()
        stored.response.error = ResponseError(code=exc.code or exc.kind, message=exc.message)
        return exc

    async def _stream(self, run: ChatRun, stored: StoredResponse, store: bool) -> AsyncIterator[str]:
        """The typed events of a streamed response. The first ones wait for the first output, so that a
        request the scheduler refuses is still an error status; a later failure is an `error` event."""
        response, builder = stored.response, OutputBuilder()
        parser, outs = run.parsers[0], []
        try:
            async with contextlib.aclosing(self.serving.tm.generate(run.choices)) as outputs:
                async for _, out in outputs:
                    if not outs:
                        yield _sse(builder.event("response.created", response=response.model_dump()))
                        yield _sse(builder.event("response.in_progress", response=response.model_dump()))
                    outs.append(out)
                    delta = parser.feed(out.text) if out.text else ChatDelta()
                    if out.finish_reason is not None:
                        delta += parser.finish()
                    for event in builder.add(delta, self._logprobs(run, [out])):
                        yield _sse(event)
        except Exception as exc:
            if not outs:
                raise
            error = self._fail(stored, exc)
            yield _sse(builder.event("error", code=error.code or error.kind, message=error.message, param=error.param))
            if store:
                self.store.put(stored)
            return
        for event in self._complete(stored, run, outs, builder):
            yield _sse(event)
        if store:
            self.store.put(stored)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield _sse(builder.event(kind, response=response.model_dump()))


def _sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"
