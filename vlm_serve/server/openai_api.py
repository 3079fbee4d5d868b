"""Chat and text completions in OpenAI's shapes, on top of the TokenizerManager.

`chat_completion` / `completion` return a response body, or an async iterator of SSE lines when the
request streams. Every problem with the request raises ValueError (the app turns it into a 400).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from vlm_serve.config import MediaLimitSettings, ServerArgs
from vlm_serve.errors import ApiError, InternalError, ModelNotFoundError
from vlm_serve.messages.backend import SpeculativeCounts, TokenizedGenerateReq
from vlm_serve.messages.frontend import GenerateReqInput, StrOut
from vlm_serve.messages.logprobs import PromptLogprobs
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.processor import PartParam, chat_part_param
from vlm_serve.server.chat_output import ChatDelta, ChatOutput, tool_use
from vlm_serve.server.output_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    MediaTokens,
    PromptLogprob,
    PromptTokensDetails,
    SpeculativeUsage,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    error_body,
    new_id,
    now,
)
from vlm_serve.server.protocol import ChatCompletionRequest, ChatPrompt, CompletionRequest, ImagePart, VideoPart
from vlm_serve.server.tokenizer_manager import TokenizerManager
from vlm_serve.server.tool_parser import ToolCall

logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """A chat request on its way: its model input, one scheduler message per choice, and each choice's
    parser of the answer (reasoning, content, tool calls)."""

    input: ProcessedInput
    choices: list[TokenizedGenerateReq]
    parsers: list[ChatOutput]


class OpenAIServing:
    """The /v1 endpoints' logic for one served model."""

    def __init__(self, tm: TokenizerManager, server_args: ServerArgs, model_name: str) -> None:
        self.tm = tm
        self.server_args = server_args
        self.model_name = model_name
        # the LoRA adapters loaded (kept as the scheduler loads and unloads them), name -> folder
        self.lora_paths: dict[str, str] = server_args.lora_adapters() if server_args.enable_lora else {}

    def check_model(self, name: str | None) -> str | None:
        """A request may name the served model, "default" (SGLang's alias for it) or none (sglang-router
        sends a chat request without a model as "unknown"); or a LoRA adapter, which it then goes through
        (its name is returned; None: the base model)."""
        if name in self.lora_paths:
            return name
        if name not in (None, "default", "unknown", self.model_name):
            raise ModelNotFoundError(name)
        return None

    # ---- chat --------------------------------------------------------------------------------------

    async def chat_prompt(
        self, request: ChatPrompt, tools: list[dict] | None = None, part_param: PartParam = chat_part_param
    ) -> ProcessedInput:
        """The model input of a chat request: its messages (and tools) rendered with its template
        options, and its media processed with its media options (a part's own options win over
        request-wide ones). A part whose media cannot be used is a 400 whose `param` is `part_param(i, j)`
        for message i's part j (`messages[i].content[j]`)."""
        check_media_parts(request, self.server_args)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        media = request.media_options()
        video = {f"video_{k}" if k.endswith("_pixels") else k: v for k, v in media["video"].items()}
        template_kwargs = dict(request.chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
        return await self.tm.process_messages(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=template_kwargs,
            part_param=part_param,
            **media["image"],
            **video,
        )

    async def start_chat(self, request: ChatCompletionRequest, part_param: PartParam = chat_part_param) -> ChatRun:
        """A chat request as model input and scheduler messages (the chat completions and responses
        endpoints both start here; `part_param` as in `chat_prompt`)."""
        lora = self.check_model(request.model)
        tools = tool_use(request)
        x = await self.chat_prompt(request, tools.tools, part_param)
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking") is not False
        reasoning = self.server_args.reasoning_parser is not None and thinking
        sampling = self.tm.sampling_params(request, reasoning=reasoning, tool_grammar=tools.grammar)
        (bootstrap,) = request.bootstraps(1, request.n)
        choices = self.tm.normalize(GenerateReqInput(x, sampling, request.priority, bootstrap, lora))
        parsers = [ChatOutput(self.server_args.reasoning_parser, tools.parse, thinking) for _ in choices]
        return ChatRun(x, choices, parsers)

    async def chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        run = await self.start_chat(request)
        x, choices, parsers = run.input, run.choices, run.parsers
        params = choices[0].sampling_params
        if request.stream:
            return errors_as_events(self._chat_stream(request, x, choices, parsers))
        per_choice = await self.collect(choices)
        choices = []
        echoed = request.echoed()  # (no log-probs: the answer's come from its own tokens, as in vLLM)
        for i, outs in enumerate(per_choice):
            logprobs = [t for out in outs for t in self._token_logprobs(out)] if params.logprobs else None
            answer = parsers[i].parse("".join(out.text for out in outs))
            content = echoed + answer.content
            message = ChatMessageOut(
                role=request.answer_role,
                content=content if content or not (answer.reasoning or answer.tool_calls) else None,
                reasoning_content=answer.reasoning or None,
                tool_calls=[_tool_call(call) for call in answer.tool_calls] or None,
            )
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None,
                    finish_reason=_finish_reason(outs[-1].finish_reason, answer.tool_calls),
                    matched_stop=outs[-1].matched_stop,
                )
            )
        return ChatCompletionResponse(
            id=new_id("chatcmpl"),
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=self._usage([x], per_choice),
            prompt_logprobs=(
                self._prompt_logprobs(per_choice[0][0].prompt_logprobs, params.prompt_logprobs)
                if params.prompt_logprobs is not None
                else None
            ),
        )

    async def _chat_stream(
        self,
        request: ChatCompletionRequest,
        x: ProcessedInput,
        choices: list[TokenizedGenerateReq],
        parsers: list[ChatOutput],
    ) -> AsyncIterator[str]:
        rid, created, params = new_id("chatcmpl"), now(), choices[0].sampling_params

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            return sse(
                ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
            )

        started = [False] * params.n
        per_choice: list[list[StrOut]] = [[] for _ in range(params.n)]
        held: list[list[TokenLogprob]] = [[] for _ in range(params.n)]  # logprobs of text a parser holds back
        continuous_usage = request.stream_options is not None and request.stream_options.continuous_usage

        def usage_so_far(i: int) -> Usage | None:
            return self._usage([x], [per_choice[i]]) if continuous_usage else None

        echoed = request.echoed()
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                if not started[i]:
                    started[i] = True
                    delta = DeltaMessage(role=request.answer_role, content="")
                    yield chunk([ChatStreamChoice(index=i, delta=delta)], usage_so_far(i))
                    if echoed:  # a chunk of its own, as vLLM sends it
                        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echoed))], usage_so_far(i))
                per_choice[i].append(out)
                # a token's logprobs come with its text (the detokenizer holds both back together, and
                # here they wait while a parser holds the text back)
                parsed = parsers[i].feed(out.text) if out.text else ChatDelta()
                if out.finish_reason is not None:
                    parsed += parsers[i].finish()
                if params.logprobs:
                    held[i] += self._token_logprobs(out)
                if parsed or out.finish_reason is not None:
                    first_call = parsers[i].num_tool_calls - len(parsed.tool_calls)
                    delta = DeltaMessage(
                        content=parsed.content or None,
                        reasoning_content=parsed.reasoning or None,
                        tool_calls=[_tool_call_delta(first_call + k, call) for k, call in enumerate(parsed.tool_calls)]
                        or None,
                    )
                    logprobs = ChoiceLogprobs(content=held[i]) if params.logprobs else None
                    held[i] = []
                    finish = _finish_reason(out.finish_reason, parsers[i].num_tool_calls)
                    choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
                    yield chunk([choice], usage_so_far(i))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], self._usage([x], per_choice))
        yield "data: [DONE]\n\n"

    # ---- text completions --------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """Each prompt gets its own `n` choices: prompt i's choice j has index i * n + j, as in vLLM."""
        lora = self.check_model(request.model)
        prompts = request.prompts()
        inputs = [self.tm.tokenize(prompt) for prompt in prompts]
        sampling = self.tm.sampling_params(request)
        bootstraps = request.bootstraps(len(inputs), request.n)
        choices = [
            choice
            for x, bootstrap in zip(inputs, bootstraps)
            for choice in self.tm.normalize(GenerateReqInput(x, sampling, request.priority, bootstrap, lora))
        ]
        echoes = [self._prompt_text(prompt) for prompt in prompts] if request.echo else [None] * len(prompts)
        if request.stream:
            return errors_as_events(self._completion_stream(request, inputs, echoes, choices))
        per_choice = await self.collect(choices)
        n = len(choices) // len(inputs)
        choices = []
        for i, outs in enumerate(per_choice):
            text, logprobs = self._completion_piece(request, inputs[i // n], echoes[i // n], outs, 0)
            prompt_logprobs = None
            if request.prompt_logprobs is not None:
                prompt_logprobs = self._prompt_logprobs(outs[0].prompt_logprobs, request.prompt_logprobs)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=outs[-1].finish_reason,
                    matched_stop=outs[-1].matched_stop,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        return CompletionResponse(
            id=new_id("cmpl"),
            created=now(),
            model=self.model_name,
            choices=choices,
            usage=self._usage(inputs, per_choice),
        )

    async def _completion_stream(
        self,
        request: CompletionRequest,
        inputs: list[ProcessedInput],
        echoes: list[str | None],
        choices: list[TokenizedGenerateReq],
    ) -> AsyncIterator[str]:
        rid, created, n = new_id("cmpl"), now(), len(choices) // len(inputs)
        per_choice: list[list[StrOut]] = [[] for _ in choices]
        offsets = [0] * len(choices)
        continuous_usage = request.stream_options is not None and request.stream_options.continuous_usage
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
                echo = echoes[i // n] if len(per_choice[i]) == 1 else None  # with the choice's first piece
                logprobs_due = request.logprobs is not None and out.new_ids
                if out.text or out.finish_reason is not None or echo is not None or logprobs_due:
                    text, logprobs = self._completion_piece(request, inputs[i // n], echo, [out], offsets[i])
                    offsets[i] += len(text)
                    choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=out.finish_reason)
                    usage = self._usage([inputs[i // n]], [per_choice[i]]) if continuous_usage else None  # so far
                    yield sse(
                        CompletionResponse(
                            id=rid, created=created, model=self.model_name, choices=[choice], usage=usage
                        )
                    )
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = self._usage(inputs, per_choice)
            yield sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as `echo` shows it: its text, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tm.tokenizer.decode(prompt, skip_special_tokens=False)

    def _completion_piece(
        self, request: CompletionRequest, x: ProcessedInput, echo: str | None, outs: list[StrOut], offset: int
    ) -> tuple[str, CompletionLogprobs | None]:
        """Text and logprobs of consecutive outputs of one choice, whose text starts at `offset` of the
        choice's; an `echo` (the prompt's text) comes first, and with logprobs its tokens' entries."""
        text = "".join(out.text for out in outs)
        logprobs = CompletionLogprobs() if request.logprobs is not None else None
        if echo is not None:
            text = echo + text
            if logprobs is not None:
                self._add_prompt_completion_logprobs(logprobs, x.input_ids, outs[0].prompt_logprobs, request.logprobs)
            offset += len(echo)
        if logprobs is not None:
            for out in outs:
                self._add_completion_logprobs(logprobs, out, offset)
                offset += len(out.text)
        return text, logprobs

    # ---- pieces ------------------------------------------------------------------------------------

    async def collect(self, choices: list[TokenizedGenerateReq]) -> list[list[StrOut]]:
        """Every output of each choice, in order (the last one finishes it)."""
        per_choice: list[list[StrOut]] = [[] for _ in choices]
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
        return per_choice

    def _usage(self, inputs: list[ProcessedInput], outputs: list[list[StrOut]]) -> Usage:
        """Usage of a request whose prompts `inputs` produced `outputs`: each prompt's choices in turn."""
        merge = self.tm.processor.image_processor.config.merge_size
        media = [MediaTokens(type=item.modality, tokens=item.num_tokens(merge)) for x in inputs for item in x.mm_items]
        prompt_tokens = sum(len(x.input_ids) for x in inputs)
        completion_tokens = sum(len(out.new_ids) for outs in outputs for out in outs)
        n = len(outputs) // len(inputs)  # a prompt's choices share its cached prefix
        cached = sum(
            max((outs[-1].cached_tokens for outs in outputs[i : i + n] if outs), default=0)
            for i in range(0, len(outputs), n)
        )
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, media=media),
            speculative=_speculative_usage([outs[-1].spec for outs in outputs if outs and outs[-1].spec is not None]),
        )

    def _token_text(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_logprobs(self, out: StrOut) -> list[TokenLogprob]:
        result = []
        for j, token_id in enumerate(out.new_ids):
            text = self._token_text(token_id)
            top = out.top_logprobs[j] if j < len(out.top_logprobs) else []
            alternatives = [
                TopLogprob(token=(t := self._token_text(tid)), logprob=json_logprob(lp), bytes=list(t.encode()))
                for tid, lp in top
            ]
            result.append(
                TokenLogprob(
                    token=text,
                    logprob=json_logprob(out.logprobs[j]),
                    bytes=list(text.encode()),
                    top_logprobs=alternatives,
                )
            )
        return result

    def _add_completion_logprobs(self, logprobs: CompletionLogprobs, out: StrOut, offset: int) -> None:
        tops = out.top_logprobs or [[]] * len(out.new_ids)  # (none without top alternatives)
        self._add_logprobs(logprobs, out.new_ids, out.logprobs, tops, offset)

    def _add_prompt_completion_logprobs(
        self, logprobs: CompletionLogprobs, prompt_ids: list[int], scores: PromptLogprobs | None, top: int
    ) -> None:
        """An echoed prompt's entries, its text starting at offset 0: none for its first token (nothing
        predicts it), nor for those an aborted request did not reach."""
        scores = scores or PromptLogprobs()
        missing = [None] * (len(prompt_ids) - 1 - len(scores))
        tops = [None, *(alternatives[:top] for alternatives in scores.top_logprobs), *missing]
        self._add_logprobs(logprobs, prompt_ids, [None, *scores.logprobs, *missing], tops, 0)

    def _add_logprobs(
        self,
        logprobs: CompletionLogprobs,
        token_ids: list[int],
        token_logprobs: list[float | None],
        tops: list[list[tuple[int, float]] | None],
        offset: int,
    ) -> None:
        """Appends the tokens' entries to the legacy logprobs lists; their text starts at `offset`."""
        for token_id, token_logprob, top in zip(token_ids, token_logprobs, tops):
            text = self._token_text(token_id)
            logprobs.tokens.append(text)
            token_logprob = json_logprob(token_logprob)
            logprobs.token_logprobs.append(token_logprob)
            # the token's own entry first, then its top alternatives: up to `logprobs` + 1 entries (with
            # `logprobs: 0`, the token's alone), as OpenAI's legacy API and vLLM give them
            alternatives = {self._token_text(tid): json_logprob(lp) for tid, lp in top} if top is not None else None
            logprobs.top_logprobs.append(None if alternatives is None else {text: token_logprob, **alternatives})
            logprobs.text_offset.append(offset)
            offset += len(text)

    def _prompt_logprobs(self, scores: PromptLogprobs | None, top: int) -> list[dict[int, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then each token's entry and its
        `top` best alternatives', by token id."""

        def entry(token_id: int, logprob: float, rank: int) -> PromptLogprob:
            return PromptLogprob(logprob=logprob, rank=rank, decoded_token=self._token_text(token_id))

        body: list[dict[int, PromptLogprob] | None] = [None]
        scores = scores or PromptLogprobs()
        columns = zip(scores.token_ids, scores.logprobs, scores.ranks, scores.top_logprobs)
        for token_id, logprob, rank, alternatives in columns:
            position = {token_id: entry(token_id, logprob, rank)}
            for alt_rank, (alt_id, alt_logprob) in enumerate(alternatives[:top], start=1):
                position.setdefault(alt_id, entry(alt_id, alt_logprob, alt_rank))
            body.append(position)
        return body


LOGPROB_FLOOR = -9999.0  # what a log-prob of -inf is reported as (JSON has no -Infinity), as vLLM reports it


def json_logprob(logprob: float | None) -> float | None:
    """A log-prob as JSON can carry it: a token that a grammar or `min_tokens` ruled out has a log-prob of
    -inf, and an answer lists such tokens among its top alternatives when fewer tokens are left."""
    return LOGPROB_FLOOR if logprob == float("-inf") else logprob


def _finish_reason(reason: str | None, tool_calls: Any) -> str | None:
    """ "tool_calls" for an answer that stopped after calling tools, as OpenAI reports it."""
    return "tool_calls" if reason == "stop" and tool_calls else reason


def _tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _tool_call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    """A whole call in one delta: its id, name and complete arguments."""
    function = FunctionCallDelta(name=call.name, arguments=call.arguments)
    return ToolCallDelta(index=index, id=call.id, type="function", function=function)


def _speculative_usage(counts: list[SpeculativeCounts]) -> SpeculativeUsage | None:
    """The choices' speculative tallies summed; None where the server does not draft (or none has ended)."""
    if not counts:
        return None
    total = SpeculativeCounts(
        *(sum(getattr(c, f) for c in counts) for f in ("verify_steps", "draft_tokens", "accepted_tokens"))
    )
    return SpeculativeUsage(
        verify_steps=total.verify_steps,
        draft_tokens=total.draft_tokens,
        accepted_tokens=total.accepted_tokens,
        mean_accepted_length=total.mean_accepted_length,
    )


def sse(body: BaseModel | dict | list) -> str:
    """One server-sent event of JSON: a model without its unset fields, or a dict or list as it is."""
    value = body.model_dump(exclude_none=True) if isinstance(body, BaseModel) else body
    data = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def errors_as_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events; a failure after the first becomes an event `{"error": {...}}` in OpenAI's shape,
    then `[DONE]`, as vLLM and SGLang send it (the openai client raises it as an `APIError`). A failure
    before the first is raised as it is: the response is then an error status, not a stream."""
    started = False
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event
                started = True
        except Exception as exc:
            if not started:
                raise
            if not isinstance(exc, ApiError):
                logger.exception("a streamed response failed")
                exc = InternalError("the server failed while streaming this response")
            body = error_body(exc)
            yield f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"


def check_media_parts(request: ChatPrompt, limits: MediaLimitSettings) -> None:
    """At most `limit_mm_per_prompt` images and videos, each asking no more than the server's caps
    (with its own options, or else the request-wide ones)."""
    parts = [
        part
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, (ImagePart, VideoPart))
    ]
    check_media_count(len(parts), limits)
    request_wide = request.media_options()
    for part in parts:
        kind = "image" if isinstance(part, ImagePart) else "video"
        pixel_cap = limits.mm_max_image_pixels if kind == "image" else limits.mm_max_video_pixels
        caps = {"min_pixels": pixel_cap, "max_pixels": pixel_cap}
        if kind == "video":
            caps.update(fps=limits.mm_max_fps, max_frames=limits.mm_max_frames)
        options = {**request_wide[kind], **part.model_dump(include=set(caps), exclude_none=True)}
        for name, cap in caps.items():
            value = options.get(name)
            if value is not None and value > cap:
                raise ValueError(f"{kind} {name}={value} exceeds this server's limit of {cap}")
        low, high = options.get("min_pixels"), options.get("max_pixels")
        if low is not None and high is not None and low > high:
            raise ValueError(f"{kind} min_pixels={low} is larger than max_pixels={high}")


def check_media_count(count: int, limits: MediaLimitSettings) -> None:
    """A prompt may bring at most `limit_mm_per_prompt` images and videos."""
    if count > limits.limit_mm_per_prompt:
        raise ValueError(
            f"the request has {count} images and videos; this server accepts at most "
            f"{limits.limit_mm_per_prompt} per prompt (--limit-mm-per-prompt)"
        )
