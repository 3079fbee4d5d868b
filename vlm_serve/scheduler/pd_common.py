"""What the prefill and decode sides of PD share: the metadata record that goes with a request's KV, and
how the TP ranks of one server agree on where their transfers stand."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from vlm_serve.disaggregation.transfer import KVPoll, TransferBackend
from vlm_serve.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch

if TYPE_CHECKING:
    from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
    from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
    from vlm_serve.kv_cache.radix_cache import RadixCache
    from vlm_serve.llm.model_runner import ModelRunner
    from vlm_serve.scheduler.concerns import SchedulerConcerns
    from vlm_serve.scheduler.metrics import SchedulerMetrics
    from vlm_serve.scheduler.schedule_policy import NewTokenRatio

META_SLOT_BYTES = 4096  # one record; a request's record (its first token's top log-probs at most) is far smaller


@dataclass
class PrefillRecord:
    """What the decode side learns from the prefill side besides the KV: the first token (sampled there,
    with its log-probs where asked), how many prompt tokens the prefix cache served, each media item's
    token count, the MRoPE position delta of generated tokens, and the LoRA adapter (name and digest) its KV
    was computed through."""

    prompt_len: int
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0
    media_tokens: list[int] = field(default_factory=list)
    mrope_delta: int = 0
    lora: str | None = None

    def to_bytes(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > META_SLOT_BYTES:
            raise ValueError(
                f"the prefill record takes {len(data)} bytes, more than a metadata slot ({META_SLOT_BYTES})"
            )
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefillRecord:
        fields = json.loads(data.rstrip(b"\0"))
        if fields.get("top_logprobs") is not None:
            fields["top_logprobs"] = [tuple(pair) for pair in fields["top_logprobs"]]
        return cls(**fields)


def lora_identity(runner: ModelRunner, req: Req) -> str | None:
    """The LoRA adapter `req` runs through, by name and digest (None: the base)."""
    adapter = runner.lora.loaded(req.lora_id) if runner.lora is not None else None
    return adapter.identity if adapter is not None else None


def agreed_polls(polls: list[KVPoll], tp_size: int, group: dist.ProcessGroup | None) -> list[KVPoll]:
    """Each transfer's state as the whole TP group sees it: the least advanced of the ranks' states (a
    request moves on only when every rank's part of its KV has), so every rank decides the same."""
    if tp_size == 1 or not polls:
        return polls
    states = torch.tensor([int(p) for p in polls], dtype=torch.int32)
    dist.all_reduce(states, op=dist.ReduceOp.MIN, group=group)
    return [KVPoll(s) for s in states.tolist()]


class PDScheduler(Protocol):
    """What the PD queues use of the scheduler that drives them (scheduler.Scheduler): its pools and
    cache, its batch, its limits, and the steps of a request's life they hand requests on to."""

    concerns: SchedulerConcerns
    runner: ModelRunner
    tree_cache: RadixCache
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    running_batch: ScheduleBatch
    metrics: SchedulerMetrics
    tp_size: int
    tp_cpu_group: dist.ProcessGroup | None
    merge_size: int
    max_total_tokens: int
    max_running_requests: int
    new_token_ratio: NewTokenRatio

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch: ...

    def to_waiting_queue(self, req: Req) -> None: ...

    def append_token(
        self, req: Req, token: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None
    ) -> None: ...

    def finish(self, req: Req, reason: FinishReason) -> None: ...


class Disaggregation:
    """What both sides' queues share: the scheduler that drives them, the rank's transfer backend, the
    wait limit in each queue (`--disaggregation-timeout`: the other side may have died), and the
    transfers' figures for /metrics."""

    def __init__(self, scheduler: PDScheduler, backend: TransferBackend, records: torch.Tensor) -> None:
        """`records`: the metadata slots (one per request row) that `backend`'s layout points into; held
        here for as long as the backend may write or read them by address."""
        self.scheduler = scheduler
        self.backend = backend
        self.records = records
        self.timeout = scheduler.concerns.disaggregation.disaggregation_timeout
        pool = scheduler.runner.token_to_kv_pool
        # one token's KV on all TP ranks (equal shares: this rank's times their number)
        self.token_bytes = pool.layout.bytes_per_token * scheduler.tp_size
        self.entered: dict[str, float] = {}  # rid -> when it entered its PD queue
        self.started: dict[str, float] = {}  # rid -> when its transfer started
        self.timed_out: set[str] = set()

    def enter(self, req: Req) -> None:
        """The request enters one of the PD queues, where it may wait `timeout` for the other side."""
        self.entered[req.rid] = time.monotonic()

    def polls(self, reqs: list[Req]) -> list[KVPoll]:
        """Where each request's transfer stands, as the TP group agrees; one that waited too long in its
        queue has FAILED."""
        s, now, states = self.scheduler, time.monotonic(), []
        for req in reqs:
            state = req.transfer.poll()
            if state not in (KVPoll.SUCCESS, KVPoll.FAILED) and now - self.entered[req.rid] > self.timeout:
                state = KVPoll.FAILED
                self.timed_out.add(req.rid)
            states.append(state)
        return agreed_polls(states, s.tp_size, s.tp_cpu_group)

    def transfer_started(self, req: Req) -> None:
        self.started.setdefault(req.rid, time.monotonic())

    def transfer_succeeded(self, req: Req) -> None:
        seconds = time.monotonic() - self.started.pop(req.rid)
        self.entered.pop(req.rid, None)
        self.scheduler.metrics.observe_transfer(len(req.origin_input_ids) * self.token_bytes, seconds)

    def fail(self, req: Req, stage: str, reason: FinishReason | None = None) -> None:
        """Ends a request whose transfer failed at `stage` (as the backend says why, unless `reason`)."""
        if req.rid in self.timed_out:
            stage = "timeout"
            message = (
                f"the other side of this prefill/decode pair did not answer within {self.timeout:g} s "
                "(--disaggregation-timeout)"
            )
            reason = FinishReason.error(503, "kv_transfer_timeout", message)
        elif reason is None:
            message = f"the KV transfer failed at {stage}: {req.transfer.failure or 'the other side failed'}"
            reason = FinishReason.error(503, "kv_transfer_failed", message)
        self.scheduler.metrics.transfer_failed(stage)
        self.scheduler.finish(req, reason)

    def forget(self, req: Req) -> None:
        """A request has finished (the scheduler calls this for every request)."""
        for held in (self.entered, self.started):
            held.pop(req.rid, None)
        self.timed_out.discard(req.rid)
