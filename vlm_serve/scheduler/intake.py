"""Requests in: what the scheduler reads each iteration (`recv_requests`), and each request's way to
`waiting_queue` — validated against the model and the pool, past the grammar queue, the encoding stage
or its PD side's queue. A request the server cannot take is refused with the reason, alone."""

from __future__ import annotations

import logging
import time
from typing import Any

from vlm_serve.detokenizer import IncrementalDetokenizer
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.llm.lora.adapter import LoRAError, read_adapter
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.messages.backend import (
    AbortReq,
    FlushCacheReq,
    GetStatsReq,
    LoadLoRAReq,
    LoRAOut,
    SchedulerLimits,
    TokenizedGenerateReq,
    UnloadLoRAReq,
)
from vlm_serve.multimodal.padding import pad_input_ids
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.grammar_queue import GrammarQueue
from vlm_serve.scheduler.metrics import SchedulerMetrics
from vlm_serve.scheduler.output_streamer import FailReq, OutputStreamer, SchedulerIO
from vlm_serve.scheduler.pd_decode import DecodeDisaggregation
from vlm_serve.scheduler.pd_prefill import PrefillDisaggregation
from vlm_serve.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, request_failure
from vlm_serve.scheduler.storage_prefetch import StoragePrefetch
from vlm_serve.scheduler.tp_broadcast import TPBroadcast
from vlm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ENCODER_WAIT_SECONDS = 0.05  # with nothing to run but media being encoded, wait this long per iteration
TRANSFER_WAIT_SECONDS = 0.002  # the same for KV transfers (PD) and pages read from storage


class SchedulerIntakeMixin:
    """The scheduler's request intake: a part of `Scheduler`, which holds the state named here and the steps of a
    request's life it calls (`stop_request`, `finish`, `is_idle` ...)."""

    concerns: SchedulerConcerns
    runner: ModelRunner
    tokenizer: Tokenizer
    io: SchedulerIO | None
    tp_rank: int
    tp_broadcast: TPBroadcast | None
    vocab_size: int
    reqs: dict[str, Req]
    waiting_queue: list[Req]
    running_batch: ScheduleBatch
    tree_cache: RadixCache
    grammar_queue: GrammarQueue
    encoding: EncodingStage
    storage_prefetch: StoragePrefetch | None
    disagg: PrefillDisaggregation | DecodeDisaggregation | None
    outputs: OutputStreamer
    metrics: SchedulerMetrics
    limits: SchedulerLimits
    _idle_checked: bool

    def recv_requests(self) -> list[Any]:
        """Rank 0 reads every waiting message (an idle scheduler waits a while for the first one); with
        TP it broadcasts them, so every rank applies the same requests before the same step. Pixel
        values are left out of the broadcast: only rank 0 encodes."""
        messages = []
        if self.tp_rank == 0:
            messages = self.outputs.take_failures() + self.io.recv(block=self.is_idle())
        return self.tp_broadcast.messages(messages) if self.tp_broadcast is not None else messages

    def process_input_requests(self, recv_reqs: list[Any]) -> None:
        for message in recv_reqs:
            if isinstance(message, TokenizedGenerateReq):
                self.handle_generate_request(message)
            elif isinstance(message, AbortReq):
                self.abort_request(message.rid, message.message)
            elif isinstance(message, FailReq):
                if message.rid in self.reqs:
                    self.stop_request(self.reqs[message.rid], message.reason)
            elif isinstance(message, FlushCacheReq):
                self.outputs.replies.append(self.flush_cache())
            elif isinstance(message, GetStatsReq):
                self.outputs.replies.append(self.get_stats())
            elif isinstance(message, LoadLoRAReq | UnloadLoRAReq):
                self.outputs.replies.append(self.change_lora(message))
            else:
                logger.error("unknown message %s ignored", type(message).__name__)
        if self.grammar_queue:  # (the same on every rank: this step may broadcast)
            for req, failure in self.grammar_queue.poll(not self._has_work() and not len(self.encoding)):
                if failure is None:
                    self._enqueue(req)
                else:
                    self.finish(req, failure)
        if self.storage_prefetch is not None and len(self.storage_prefetch):
            if not self._has_work() and not len(self.encoding):
                time.sleep(TRANSFER_WAIT_SECONDS)  # (the pages are read on another thread)
            for req in self.storage_prefetch.poll():
                self._past_storage(req)
        if len(self.encoding):
            self.process_encoding_results(0.0 if self._has_work() else ENCODER_WAIT_SECONDS)
        if self.disagg is not None and len(self.disagg):
            if not self._has_work() and not len(self.encoding):
                time.sleep(TRANSFER_WAIT_SECONDS)  # (the transfers move on other threads)
            self.disagg.process()

    def change_lora(self, message: LoadLoRAReq | UnloadLoRAReq) -> LoRAOut:
        """Loads or unloads a LoRA adapter (an adapter still in use by a request is not unloaded)."""
        manager = self.runner.lora
        try:
            if manager is None:
                raise LoRAError("this server was started without --enable-lora")
            if isinstance(message, LoadLoRAReq):
                if any(a is not None and a.name == message.name for a in manager.slots):
                    raise LoRAError(f"a LoRA adapter named {message.name!r} is loaded already")
                manager.load(read_adapter(message.name, message.path, manager.max_rank))
                return LoRAOut(True)
            slot, load_id = manager.resolve(message.name)
            using = sum(r.lora_id == load_id for r in self.reqs.values())
            if using:
                raise LoRAError(f"LoRA adapter {message.name!r} is in use by {using} request(s): unload it after them")
            manager.unload(slot)
            return LoRAOut(True)
        except LoRAError as exc:
            return LoRAOut(False, str(exc))

    def handle_generate_request(self, message: TokenizedGenerateReq) -> None:
        req = Req(
            message.rid,
            message.input_ids,
            message.sampling_params,
            message.mm_items,
            priority=message.priority,
            bootstrap=message.bootstrap,
        )
        try:
            if message.lora_name is not None:
                if self.runner.lora is None:
                    raise ValueError(f"LoRA adapter {message.lora_name!r} asked of a server without --enable-lora")
                slot, req.lora_id = self.runner.lora.resolve(message.lora_name)
                req.lora_slot = slot if self.runner.lora.slots[slot].adapts_lm else -1
                req.tower_lora = self.runner.lora.tower(slot)
            self.add_request(req)
        except Exception as exc:  # noqa: BLE001 - ValueError: the request's own fault; else the server's, its alone
            if isinstance(exc, ValueError):
                code = getattr(exc, "code", None) or ""  # (an ApiError's, e.g. context_length_exceeded)
                reason = FinishReason.error(400, code, str(exc))
            else:
                reason = request_failure(req, "while being admitted", exc)
            if req.bootstrap is not None and self.disagg is not None:
                self.disagg.refuse(req.bootstrap, reason.message)
            if self.reqs.get(req.rid) is req:  # it failed once admitted: stopped where it got to
                self.stop_request(req, reason)
                return
            self.outputs.refuse(message.rid, reason)

    def add_request(self, req: Req) -> None:
        """Validates and queues a request; a request that can never run raises ValueError."""
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        req.check_inputs(self.vocab_size)
        prompt_len, params = len(req.origin_input_ids), req.sampling_params
        if req.bootstrap is not None and self.disagg is None:
            req.bootstrap = None  # a colocated server serves it whole
        if req.bootstrap is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with prefill/decode disaggregation")
        if self.concerns.disaggregation.disaggregation_mode == "decode" and req.mm_items and req.bootstrap is None:
            raise ValueError(
                "this decode server takes images and videos only with bootstrap_host, bootstrap_port and "
                "bootstrap_room (from sglang-router's PD mode): it has no vision tower"
            )
        self.limits.check_fits(prompt_len, params.max_new_tokens)
        req.origin_input_ids = pad_input_ids(req.origin_input_ids, req.mm_items, self.vocab_size)
        req.init_positions(self.runner.model_config.vision)
        if req.sampling_params.stop or req.sampling_params.stop_regex:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.reqs[req.rid] = req
        self._idle_checked = False
        if not self.grammar_queue.add(req):  # (else it goes on when its grammar is compiled)
            self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """An admitted request goes on: to its side's PD queue if it came with bootstrap info, else to
        `waiting_queue`."""
        if req.bootstrap is not None:
            self.disagg.add(req)
        else:
            self.to_waiting_queue(req)

    def to_waiting_queue(self, req: Req) -> None:
        """A request to `waiting_queue`: first through the storage tier's stage if its prompt goes on past the
        prefix cache (and the prefetch policy waits for the pages), then through the encoding stage if its
        media need it."""
        if self.storage_prefetch is not None and self.storage_prefetch.start(req):
            return  # it goes on when its pages are read (`process_input_requests`)
        self._past_storage(req)

    def _past_storage(self, req: Req) -> None:
        if req.mm_items:
            covered = self.tree_cache.match_prefix(req.cache_key(req.origin_input_ids[:-1])).covered
            if req.prompt_logprobs_pending:  # it computes its whole prompt: no cached prefix covers an item
                covered = 0
            if self.encoding.add(req, covered):
                return  # it joins waiting_queue when its embeddings are ready
            self.metrics.observe_media(req.mm_items)
        self.waiting_queue.append(req)

    def process_encoding_results(self, timeout: float = 0.0) -> None:
        """Moves requests whose media are now encoded to `waiting_queue`; fails those that cannot be (as
        the encoding stage says why). With TP, rank 0 tells the others which, with the embeddings."""
        decoding = any(not r.finished for r in self.running_batch.reqs)
        ready, failed = self.encoding.poll(timeout, decoding) if self.tp_rank == 0 else ([], [])
        if self.tp_broadcast is not None:
            ready, failed = self.tp_broadcast.encoding_results(ready, failed, self.reqs, self.encoding)
        for req in ready:
            self.metrics.observe_media(req.mm_items)
            self.waiting_queue.append(req)
        for req, failure in failed:
            self.finish(req, failure)
