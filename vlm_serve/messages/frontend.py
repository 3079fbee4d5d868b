"""Messages of the front ends: the `GenerateReqInput` a front end receives (turned into one
`TokenizedGenerateReq` per choice by `normalize`), and the text the detokenizer sends back to it
(`BatchStrOut` of `StrOut`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vlm_serve.errors import ApiError, BadRequest, InternalError, ServiceUnavailable
from vlm_serve.messages.backend import BootstrapInfo, SchedulerLimits, SpeculativeCounts, TokenizedGenerateReq
from vlm_serve.multimodal.items import MediaTimings, ProcessedInput
from vlm_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlm_serve.messages.logprobs import PromptLogprobs


@dataclass
class GenerateReqInput:
    """A generation request as a front end receives it: a processed prompt, its sampling settings (made
    by the protocol layer over the checkpoint's defaults), a priority and, behind sglang-router's PD
    mode, where its KV comes from: one `BootstrapInfo` for the request, or one per choice. The HTTP
    server and `Engine` both turn it into scheduler messages with `normalize`, so they agree on the
    answer's length and on choices."""

    input: ProcessedInput
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    bootstrap: BootstrapInfo | list[BootstrapInfo] | None = None
    lora_name: str | None = None  # a LoRA adapter's name (None: the base model)

    def sampling_params(self, limits: SchedulerLimits) -> SamplingParams:
        """The settings with the answer's length known: without one, an answer may run to the context
        length, or what the KV pool can hold, as in vLLM. ValueError if prompt and answer cannot fit."""
        params, prompt_tokens = self.sampling, len(self.input.input_ids)
        if params.max_new_tokens is None:
            params = replace(params, max_new_tokens=max(limits.max_sequence_tokens - prompt_tokens, 1))
        if self.bootstrap is None:  # (a PD request's scheduler refuses it, which tells its other side at once)
            limits.check_fits(prompt_tokens, params.max_new_tokens)
        return params

    def normalize(self, rid: str, limits: SchedulerLimits) -> list[TokenizedGenerateReq]:
        """One message per choice, with ids `{rid}-{i}` (choice i of a seeded request uses seed + i, and
        of a request with one bootstrap room ROOM and `n` > 1, room "ROOM/i")."""
        choices = self.sampling_params(limits).per_choice()
        x = self.input
        return [
            TokenizedGenerateReq(
                f"{rid}-{i}", x.input_ids, choice, x.mm_items, self.priority, bootstrap, self.lora_name
            )
            for i, (choice, bootstrap) in enumerate(zip(choices, self._bootstraps(len(choices))))
        ]

    def _bootstraps(self, n: int) -> list[BootstrapInfo | None]:
        """The bootstrap info of each of `n` choices; ValueError if one per choice was given for another `n`."""
        if self.bootstrap is None:
            return [None] * n
        if isinstance(self.bootstrap, list):
            if len(self.bootstrap) != n:
                raise ValueError(f"bootstrap_room: {len(self.bootstrap)} rooms were given for {n} choices")
            return self.bootstrap
        if n == 1:
            return [self.bootstrap]
        return [replace(self.bootstrap, room=f"{self.bootstrap.room}/{i}") for i in range(n)]


@dataclass
class StrOut:
    """One request's output step as text: `text` is what was added since the last message."""

    rid: str
    text: str
    new_ids: list[int]  # the tokens whose text `text` completes (with their logprobs); the last message has the rest
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    matched_stop: int | str | None
    message: str
    prompt_tokens: int
    cached_tokens: int
    media_timings: list[MediaTimings] = field(default_factory=list)
    status: int = 0  # of an error
    code: str = ""
    prompt_logprobs: PromptLogprobs | None = None  # with its first output, when asked
    spec: SpeculativeCounts | None = None  # with its last output, when speculative decoding is on

    @classmethod
    def failed(cls, rid: str, status: int, code: str, message: str) -> StrOut:
        """The end of a request that could not be served, as a front end learns it."""
        return cls(rid, "", [], [], [], "error", None, message, 0, 0, status=status, code=code)

    def failure(self) -> ApiError:
        """The error a request ends with when this output says it failed: 400 the request's fault
        (`BadRequest`, a ValueError), 503 the server cannot serve it now, else an internal error."""
        kind = {400: BadRequest, 503: ServiceUnavailable}.get(self.status, InternalError)
        return kind(self.message, code=self.code or None)


@dataclass
class BatchStrOut:
    outs: list[StrOut]
