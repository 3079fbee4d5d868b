"""Messages to and from the scheduler. Front end (the HTTP process's TokenizerManager, or the in-process
`Engine`) -> scheduler: `TokenizedGenerateReq`, `AbortReq`, `FlushCacheReq`, `GetStatsReq`. Scheduler ->
detokenizer: `BatchTokenIdOut` (new token ids of the iteration's requests) and replies (`FlushCacheOut`,
`StatsOut`), which the detokenizer passes on. The scheduler reports `SchedulerLimits` when it is ready."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlm_serve.errors import ContextLengthExceeded
from vlm_serve.multimodal.items import MediaTimings, MultimodalItem
from vlm_serve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlm_serve.messages.logprobs import PromptLogprobs


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

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises `ContextLengthExceeded` unless a prompt and its longest answer fit in the context, and
        in the KV cache."""
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthExceeded(self.context_length, prompt_tokens, max_tokens)
        if prompt_tokens + max_tokens > self.max_sequence_tokens:
            why = " (all this server's KV cache can hold)"
            raise ContextLengthExceeded(self.max_sequence_tokens, prompt_tokens, max_tokens, why)


@dataclass
class BootstrapInfo:
    """Where the KV of a request served by a prefill/decode pair comes from: the prefill server's
    bootstrap address, and the room, a key both sides of the request share (sglang-router gives both
    the same `bootstrap_room`; choice i of a request with `n` > 1 is room "ROOM/i")."""

    host: str
    port: int
    room: str


@dataclass
class TokenizedGenerateReq:
    """One choice of a request: prompt ids (placeholders not yet padded) and preprocessed media."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    priority: int = 0
    bootstrap: BootstrapInfo | None = None  # set on both sides of a prefill/decode pair
    lora_name: str | None = None  # the LoRA adapter it runs through (None: the base model)


@dataclass
class AbortReq:
    rid: str
    message: str = "aborted"


@dataclass
class FlushCacheReq:
    """Drop the prefix cache and both multimodal caches (refused while requests are in flight)."""


@dataclass
class LoadLoRAReq:
    """Load the LoRA adapter in folder `path` under `name` (every TP rank)."""

    name: str
    path: str


@dataclass
class UnloadLoRAReq:
    name: str


@dataclass
class LoRAOut:
    """Whether a LoRA adapter was loaded or unloaded, and if not why (the request's fault: a 400)."""

    success: bool
    message: str = ""


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class GetStatsReq:
    """Ask the scheduler for a `StatsOut` snapshot (for /metrics)."""


@dataclass
class HiCacheStats:
    """The prefix cache's tiers (--enable-hierarchical-cache): prompt tokens each served, what was copied
    between them and how long the copies took, and each tier's usage."""

    hit_tokens: dict[str, int]  # tier (device, host, storage) -> prompt tokens served from it
    copied_bytes: dict[str, int]  # copy (device_to_host, host_to_device, ...) -> bytes
    copy_seconds: dict[str, float]  # copy -> seconds spent copying
    usage_tokens: dict[str, int]  # tier below the device (host, storage) -> tokens held
    capacity_tokens: dict[str, int]  # tier -> tokens it can hold
    # storage pages found corrupt (dropped), reads and writes that failed, writes dropped (storage too slow)
    storage_failures: dict[str, int] = field(default_factory=dict)


@dataclass
class SpeculativeCounts:
    """Speculative decoding's tally, for one request or the whole server: verify steps that had drafts,
    draft tokens verified, and of those the ones kept."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafts: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step, the one the step samples itself included (1.0 with no drafts kept)."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


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
    spec: SpeculativeCounts  # speculative decoding, over every request so far
    embedding_cache: dict[str, float]  # hits, misses, inflight_hits, evictions, usage_bytes
    encoder_load: list[int]  # patches in flight per encoder rank (empty for the inline tower)
    encoder_restarts: int
    media_items: int
    media_seconds: dict[str, Any]  # stage -> Histogram
    vit_items: int  # images and videos run through a vision tower (once each, however many requests wait)
    # PD (none in a colocated server): queue sizes by name, and the KV transfers (all TP ranks' bytes)
    disaggregation_queues: dict[str, int] = field(default_factory=dict)
    kv_transfer_bytes: int = 0
    kv_transfer_request_bytes: dict[str, Any] | None = None  # a Histogram's fields
    kv_transfer_seconds: dict[str, Any] | None = None
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)  # by the stage they failed at
    hicache: HiCacheStats | None = None  # with --enable-hierarchical-cache


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
    spec: SpeculativeCounts | None = None  # when finished, with speculative decoding on


@dataclass
class BatchTokenIdOut:
    outs: list[TokenIdOut]
