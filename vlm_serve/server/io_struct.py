"""The typed messages the server's processes exchange over ZMQ.

HTTP process (TokenizerManager) -> scheduler: `TokenizedGenerateReq`, `AbortReq`, `FlushCacheReq`,
`GetStatsReq`. Scheduler -> detokenizer: `BatchTokenIdOut` (new token ids of the step's requests) and
replies (`FlushCacheOut`, `StatsOut`), which the detokenizer passes on. Detokenizer -> HTTP process:
`BatchStrOut` (text deltas). Pixel tensors inside a `TokenizedGenerateReq` travel as shared memory
(`send_pyobj` / `recv_pyobj` below use multiprocessing's pickler, which shares tensors instead of
copying them into the message).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import zmq

from vlm_serve.sampling_params import SamplingParams
from vlm_serve.vision.items import MultimodalItem


@dataclass
class PortArgs:
    """ZMQ addresses of the three channels (ipc:// sockets in a private temporary folder)."""

    scheduler_input: str  # HTTP process -> scheduler rank 0
    detokenizer_input: str  # scheduler rank 0 -> detokenizer
    tokenizer_input: str  # detokenizer -> HTTP process


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
    embedding_cache: dict[str, float]  # hits, misses, evictions, usage_bytes
    encoder_load: list[int]  # patches in flight per encoder rank (empty for the inline tower)
    encoder_restarts: int
    media_items: int
    media_seconds: dict[str, Any]  # stage -> Histogram


@dataclass
class TokenIdOut:
    """What one request produced in one step. `error` (nothing else set) means the scheduler refused it."""

    rid: str
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    matched_stop: int | str | None = None
    message: str = ""  # why it was aborted
    output_text: str | None = None  # final text cut before a matched stop string
    stop_holdback: int = 0  # characters a stop string could still take back from the text so far
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class BatchTokenIdOut:
    outs: list[TokenIdOut]


@dataclass
class StrOut:
    """One request's output step as text: `text` is what was added since the last message."""

    rid: str
    text: str
    new_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    matched_stop: int | str | None
    message: str
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass
class BatchStrOut:
    outs: list[StrOut]


def send_pyobj(socket: zmq.Socket, obj: Any, flags: int = 0) -> None:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    socket.send(buf.getvalue(), flags)


def recv_pyobj(socket: zmq.Socket, flags: int = 0) -> Any:
    return pickle.loads(socket.recv(flags))
