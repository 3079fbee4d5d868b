"""Chat and text completions in OpenAI's shapes, on top of the TokenizerManager.

`chat_completion` / `completion` return a response body, or an async iterator of SSE lines when the
request streams. Every problem with the request raises ValueError (the app turns it into a 400).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from vlm_serve.config import ServerArgs
from vlm_serve.server.io_struct import GenerateReqInput, StrOut, TokenizedGenerateReq
from vlm_serve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ImagePart,
    MediaTokens,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    VideoPart,
    new_id,
    now,
)
from vlm_serve.server.tokenizer_manager import TokenizerManager
from vlm_serve.multimodal import ProcessedInput

class OpenAIServing:
    """The /v1 endpoints' logic for one served model."""

    def __init__(self, tm: TokenizerManager, server_args: ServerArgs, model_name: str) -> None:
        self.tm = tm
        self.server_args = server_args
        self.model_name = model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise LookupError(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    # ---- chat --------------------------------------------------------------------------------------

    async def chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        check_media_parts(request, self.server_args)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        x = await self.tm.process_messages(messages)
        choices = self.tm.normalize(GenerateReqInput(x, request.sampling(), request.priority))
        params = choices[0].sampling_params
        if request.stream:
            return self._chat_stream(request, x, choices)
        per_choice = await self._collect(choices)
        choices = []
        for i, outs in enumerate(per_choice):
            logprobs = [t for out in outs for t in self._token_logprobs(out)] if params.logprobs else None
            choices.append(ChatChoice(
                index=i, message=ChatMessageOut(content="".join(out.text for out in outs)),
                logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None,
                finish_reason=outs[-1].finish_reason, matched_stop=outs[-1].matched_stop,
            ))  # fmt: skip
        return ChatCompletionResponse(
            id=new_id("chatcmpl"), created=now(), model=self.model_name, choices=choices,
            usage=self._usage(x, per_choice),
        )  # fmt: skip

    async def _chat_stream(
        self, request: ChatCompletionRequest, x: ProcessedInput, choices: list[TokenizedGenerateReq]
    ) -> AsyncIterator[str]:
        rid, created, params = new_id("chatcmpl"), now(), choices[0].sampling_params

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage))

        started = [False] * params.n
        per_choice: list[list[StrOut]] = [[] for _ in range(params.n)]
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
                if not started[i]:
                    started[i] = True
                    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                if out.text or out.finish_reason is not None or (params.logprobs and out.new_ids):
                    logprobs = ChoiceLogprobs(content=self._token_logprobs(out)) if params.logprobs else None
                    delta = DeltaMessage(content=out.text or None)
                    yield chunk([ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=out.finish_reason)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], self._usage(x, per_choice))
        yield "data: [DONE]\n\n"

    # ---- text completions --------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(request.model)
        x = self.tm.tokenize(request.prompt)
        sampling = request.sampling()
        top = request.logprobs
        sampling.update(logprobs=top is not None, top_logprobs=top or 0)  # the legacy API's integer logprobs
        choices = self.tm.normalize(GenerateReqInput(x, sampling, request.priority))
        params = choices[0].sampling_params
        if request.stream:
            return self._completion_stream(request, x, choices)
        per_choice = await self._collect(choices)
        choices = []
        for i, outs in enumerate(per_choice):
            logprobs = None
            if params.logprobs:
                logprobs, offset = CompletionLogprobs(), 0
                for out in outs:
                    self._add_completion_logprobs(logprobs, out, offset)
                    offset += len(out.text)
            choices.append(CompletionChoice(
                index=i, text="".join(out.text for out in outs), logprobs=logprobs,
                finish_reason=outs[-1].finish_reason, matched_stop=outs[-1].matched_stop,
            ))  # fmt: skip
        return CompletionResponse(
            id=new_id("cmpl"), created=now(), model=self.model_name, choices=choices, usage=self._usage(x, per_choice)
        )

    async def _completion_stream(
        self, request: CompletionRequest, x: ProcessedInput, choices: list[TokenizedGenerateReq]
    ) -> AsyncIterator[str]:
        rid, created, params = new_id("cmpl"), now(), choices[0].sampling_params
        per_choice: list[list[StrOut]] = [[] for _ in range(params.n)]
        offsets = [0] * params.n
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
                logprobs = None
                if params.logprobs:
                    logprobs = CompletionLogprobs()
                    self._add_completion_logprobs(logprobs, out, offsets[i])
                offsets[i] += len(out.text)
                if out.text or out.finish_reason is not None:
                    choice = CompletionChoice(index=i, text=out.text, logprobs=logprobs, finish_reason=out.finish_reason)
                    yield _sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice]))
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = self._usage(x, per_choice)
            yield _sse(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[], usage=usage))
        yield "data: [DONE]\n\n"

    # ---- pieces ------------------------------------------------------------------------------------

    async def _collect(self, choices: list[TokenizedGenerateReq]) -> list[list[StrOut]]:
        """Every output of each choice, in order (the last one finishes it)."""
        per_choice: list[list[StrOut]] = [[] for _ in choices]
        async with contextlib.aclosing(self.tm.generate(choices)) as outputs:
            async for i, out in outputs:
                per_choice[i].append(out)
        return per_choice

    def _usage(self, x: ProcessedInput, outputs: list[list[StrOut]]) -> Usage:
        """Usage of a request whose choices produced `outputs`."""
        merge = self.tm.processor.image_processor.config.merge_size
        media = [MediaTokens(type=item.modality, tokens=item.num_tokens(merge)) for item in x.mm_items]
        prompt_tokens = len(x.input_ids)
        completion_tokens = sum(len(out.new_ids) for outs in outputs for out in outs)
        cached = max((outs[-1].cached_tokens for outs in outputs if outs), default=0)
        return Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, media=media),
        )  # fmt: skip

    def _token_text(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token_logprobs(self, out: StrOut) -> list[TokenLogprob]:
        result = []
        for j, token_id in enumerate(out.new_ids):
            text = self._token_text(token_id)
            top = out.top_logprobs[j] if j < len(out.top_logprobs) else []
            alternatives = [
                TopLogprob(token=(t := self._token_text(tid)), logprob=lp, bytes=list(t.encode())) for tid, lp in top
            ]
            result.append(
                TokenLogprob(token=text, logprob=out.logprobs[j], bytes=list(text.encode()), top_logprobs=alternatives)
            )
        return result

    def _add_completion_logprobs(self, logprobs: CompletionLogprobs, out: StrOut, offset: int) -> None:
        for j, token_id in enumerate(out.new_ids):
            text = self._token_text(token_id)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(out.logprobs[j])
            top = out.top_logprobs[j] if j < len(out.top_logprobs) else []
            logprobs.top_logprobs.append({self._token_text(tid): lp for tid, lp in top})
            logprobs.text_offset.append(offset)
            offset += len(text)


def _sse(body: BaseModel) -> str:
    data = json.dumps(body.model_dump(exclude_none=True), ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def check_media_parts(request: ChatCompletionRequest, server_args: ServerArgs) -> None:
    """At most `limit_mm_per_prompt` images and videos, each asking no more than the server's caps."""
    parts = [
        part
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, (ImagePart, VideoPart))
    ]
    if len(parts) > server_args.limit_mm_per_prompt:
        raise ValueError(
            f"the request has {len(parts)} images and videos; this server accepts at most "
            f"{server_args.limit_mm_per_prompt} per prompt (--limit-mm-per-prompt)"
        )
    for part in parts:
        kind = "image" if isinstance(part, ImagePart) else "video"
        pixel_cap = server_args.mm_max_image_pixels if kind == "image" else server_args.mm_max_video_pixels
        caps = {"min_pixels": pixel_cap, "max_pixels": pixel_cap}
        if kind == "video":
            caps.update(fps=server_args.mm_max_fps, max_frames=server_args.mm_max_frames)
        for name, cap in caps.items():
            value = getattr(part, name)
            if value is not None and value > cap:
                raise ValueError(f"{kind} {name}={value} exceeds this server's limit of {cap}")
        if part.min_pixels is not None and part.max_pixels is not None and part.min_pixels > part.max_pixels:
            raise ValueError(f"{kind} min_pixels={part.min_pixels} is larger than max_pixels={part.max_pixels}")
