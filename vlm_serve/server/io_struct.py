"""The typed messages between the front ends, the scheduler and the detokenizer.

A front end (the HTTP process's TokenizerManager, or the in-process `Engine`) turns a
`GenerateReqInput` into one `TokenizedGenerateReq` per choice. Front end -> scheduler:
`TokenizedGenerateReq`, `AbortReq`, `FlushCacheReq`, `GetStatsReq`. Scheduler -> detokenizer:
`BatchTokenIdOut` (new token ids of the iteration's requests) and replies (`FlushCacheOut`,
`StatsOut`), which the detokenizer passes on. Detokenizer -> front end: `BatchStrOut` (text deltas).
In the server they cross processes over ZMQ (`vlm_serve.ipc`: pixel tensors inside a
`TokenizedGenerateReq` travel as shared memory); in `Engine` they are handed over in queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlm_serve.multimodal import MediaTimings, MultimodalItem, ProcessedInput
from vlm_serve.sampling_params import SamplingParams, sampling_params_from_openai
from vlm_serve.server.errors import ApiError, BadRequest, InternalError, ServiceUnavailable

if TYPE_CHECKING:
    from vlm_serve.llm.prompt_logprobs import PromptLogprobs
    from vlm_serve.vision.encoder_pool import PoolAddresses


@dataclass
class PortArgs:
    """ZMQ addresses of the server's channels (ipc:// sockets in a private temporary folder)."""

    scheduler_input: str  # HTTP process -> scheduler rank 0
    detokenizer_input: str  # scheduler rank 0 -> detokenizer
    tokenizer_input: str  # detokenizer -> HTTP process
    encoder: PoolAddresses | None = None  # the encoder pool (scheduler rank 0 <-> encoder ranks)


@dataclass
class SchedulerLimits:
    """What the scheduler can take, reported when it is ready: front ends check requests against it."""

    max_total_tokens: int  # KV pool size
    context_length: int  # longest prompt + output
    max_running_requests: int
    page_size: int

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + output that can ever run: the context, or what the KV pool holds."""
        return min(self.context_length, self.max_total_tokens - self.page_size)


@dataclass
class GenerateReqInput:
    """A generation request as a front end receives it: a processed prompt, OpenAI-named sampling
    settings (`max_tokens`, `temperature`, `n`, ...) and a priority. The HTTP server and `Engine` both
    turn it into scheduler messages with `normalize`, so they agree on defaults and on choices."""

    input: ProcessedInput
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = 0

    def sampling_params(self, defaults: dict[str, Any], limits: SchedulerLimits) -> SamplingParams:
        """The settings over `defaults` (the checkpoint's generation config). Without max_tokens an
        answer may run to the context length, or what the KV pool can hold, as in vLLM. Unknown names
        raise TypeError, bad values ValueError."""
        sampling = dict(self.sampling)
        if sampling.get("max_tokens") is None and sampling.get("max_completion_tokens") is None:
            sampling["max_tokens"] = max(limits.max_sequence_tokens - len(self.input.input_ids), 1)
        return sampling_params_from_openai(defaults, sampling)

    def normalize(self, rid: str, defaults: dict[str, Any], limits: SchedulerLimits) -> list[TokenizedGenerateReq]:
        """One message per choice, with ids `{rid}-{i}` (choice i of a seeded request uses seed + i)."""
        params = self.sampling_params(defaults, limits)
        x = self.input
        return [
            TokenizedGenerateReq(f"{rid}-{i}", x.input_ids, choice, x.mm_items, self.priority)
            for i, choice in enumerate(params.per_choice())
        ]


@dataclass
class TokenizedGenerateReq:
    """One choice of a request: prompt ids (placeholders not yet padded) and preprocessed media."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    priority: int = 0


@dataclass
class AbortReq:
    rid: str
    message: str = "aborted"


@dataclass
class FlushCacheReq:
    """Drop the prefix cache and both multimodal caches (refused while requests are in flight)."""


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class GetStatsReq:
    """Ask the scheduler for a `StatsOut` snapshot (for /metrics)."""


@dataclass
class StatsOut:
    """Gauges and cumulative counters of the scheduler side, for Prometheus."""

    num_running: int
    num_waiting: int
    num_encoding: int
    kv_usage: float  # share of KV slots held by requests (not counting evictable cache)
    max_total_tokens: int
    prefix_cache_hit_rate: float
    cached_prompt_tokens: int
    computed_prompt_tokens: int
    generated_tokens: int
    num_retractions: int
    embedding_cache: dict[str, float]  # hits, misses, inflight_hits, evictions, usage_bytes
    encoder_load: list[int]  # patches in flight per encoder rank (empty for the inline tower)
    encoder_restarts: int
    media_items: int
    media_seconds: dict[str, Any]  # stage -> Histogram
    vit_items: int  # images and videos run through a vision tower (once each, however many requests wait)


@dataclass
class TokenIdOut:
    """What one request produced in one step. A request that could not be served ends with finish reason
    "error", its `status` and `code` (see `FinishReason`); one the scheduler refused gets only that."""

    rid: str
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: int | str | None = None
    message: str = ""  # why it was aborted or failed
    status: int = 0  # of an error: its HTTP status
    code: str = ""  # of an error: its cause in a word
    output_text: str | None = None  # final text cut before a matched stop string
    stop_holdback: int = 0  # characters a stop string could still take back from the text so far
    prompt_tokens: int = 0
    cached_tokens: int = 0
    media_timings: list[MediaTimings] = field(default_factory=list)  # per image / video, when finished
    prompt_logprobs: PromptLogprobs | None = None  # with its first report, when asked


@dataclass
class BatchTokenIdOut:
    outs: list[TokenIdOut]


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

    @classmethod
    def failed(cls, rid: str, status: int, code: str, message: str) -> StrOut:
        """The end of a request that could not be served, as a front end learns it."""
        return cls(rid, "", [], [], [], "error", None, message, 0, 0, status=status, code=code)

    def failure(self) -> ApiError:
        """The error a request ends with when this output says it failed: 400 the request's fault
        (`BadRequest`, a ValueError), 503 the server cannot serve it now, else an internal error."""
        kind = {400: BadRequest, 503: ServiceUnavailable}.get(self.status, InternalError)
        error = kind(self.message)
        error.code = self.code
        return error


@dataclass
class BatchStrOut:
    outs: list[StrOut]
