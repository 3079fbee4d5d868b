"""The scheduler process: requests in over ZMQ, `Scheduler.step()`, each step's new tokens out.

With tensor parallelism every rank runs this loop. Rank 0 alone talks to the other processes: it
receives the messages of an iteration and broadcasts them over a gloo group, so every rank applies
the same requests and aborts before the same step and their scheduling decisions agree.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.detokenizer import stop_holdback
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.schedule_batch import Req
from vlm_serve.llm.scheduler.scheduler import Scheduler
from vlm_serve.server.io_struct import (
    AbortReq,
    BatchTokenIdOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    PortArgs,
    StatsOut,
    TokenIdOut,
    TokenizedGenerateReq,
    recv_pyobj,
    send_pyobj,
)
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder_pool import EncoderPool

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle rank 0 waits this long for a message before checking on its parent


class SchedulerProcess:
    """Feeds a `Scheduler` from the HTTP process and reports every request's progress to the detokenizer."""

    def __init__(self, scheduler: Scheduler, port_args: PortArgs, tp_rank: int, control_group: Any) -> None:
        self.scheduler = scheduler
        self.tp_rank = tp_rank
        self.control_group = control_group  # gloo group for broadcasting inputs (TP > 1), else None
        self.sent: dict[str, int] = {}  # output ids already reported, per request
        self.outs: list[TokenIdOut] = []
        self.replies: list[Any] = []
        if tp_rank == 0:
            context = zmq.Context()
            self.recv_from_tokenizer = context.socket(zmq.PULL)
            self.recv_from_tokenizer.bind(port_args.scheduler_input)
            self.send_to_detokenizer = context.socket(zmq.PUSH)
            self.send_to_detokenizer.connect(port_args.detokenizer_input)
        self.parent = mp.parent_process()

    # ---- the loop ----------------------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            self.process_input_requests(self.recv_requests())
            finished = self.scheduler.step()
            self.send_outputs(finished)

    def recv_requests(self) -> list[Any]:
        """Every message waiting now; an idle scheduler waits a while for the first one."""
        messages: list[Any] = []
        if self.tp_rank == 0:
            idle = self.scheduler.is_idle()
            if idle and not self.recv_from_tokenizer.poll(IDLE_POLL_MS):
                if self.parent is not None and not self.parent.is_alive():
                    raise SystemExit(0)  # the server was killed without a chance to stop us
            while True:
                try:
                    messages.append(recv_pyobj(self.recv_from_tokenizer, zmq.NOBLOCK))
                except zmq.Again:
                    break
        if self.control_group is not None:
            box = [messages]
            dist.broadcast_object_list(box, src=0, group=self.control_group)
            messages = box[0]
        return messages

    def process_input_requests(self, messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, TokenizedGenerateReq):
                self.add_request(message)
            elif isinstance(message, AbortReq):
                self.scheduler.abort_request(message.rid, message.message)
            elif isinstance(message, FlushCacheReq):
                self.replies.append(self.flush_cache())
            elif isinstance(message, GetStatsReq):
                self.replies.append(self.stats())
            else:
                logger.error("unknown message %s ignored", type(message).__name__)

    def add_request(self, message: TokenizedGenerateReq) -> None:
        req = Req(message.rid, message.input_ids, message.sampling_params, message.mm_items, priority=message.priority)
        try:
            self.scheduler.add_request(req)
        except ValueError as exc:
            self.outs.append(TokenIdOut(message.rid, error=str(exc)))
            return
        self.sent[req.rid] = 0

    def send_outputs(self, finished: list[Req]) -> None:
        """Reports what each request produced since the last report (one message per step)."""
        for req in [*self.scheduler.reqs.values(), *finished]:
            sent = self.sent.get(req.rid)
            if sent is None or (sent == len(req.output_ids) and not req.finished):
                continue
            params = req.sampling_params
            out = TokenIdOut(
                req.rid, req.output_ids[sent:], stop_holdback=stop_holdback(params.stop),
                prompt_tokens=len(req.origin_input_ids), cached_tokens=req.cached_tokens,
            )  # fmt: skip
            if params.logprobs:
                out.logprobs = req.output_logprobs[sent:]
                out.top_logprobs = req.output_top_logprobs[sent:]
            if req.finished:
                reason = req.finished_reason
                out.finish_reason, out.matched_stop, out.message = reason.kind, reason.matched, reason.message
                out.output_text = req.output_text
                del self.sent[req.rid]
            else:
                self.sent[req.rid] = len(req.output_ids)
            self.outs.append(out)
        if self.tp_rank == 0:
            if self.outs:
                send_pyobj(self.send_to_detokenizer, BatchTokenIdOut(self.outs))
            for reply in self.replies:
                send_pyobj(self.send_to_detokenizer, reply)
        self.outs, self.replies = [], []

    # ---- control -----------------------------------------------------------------------------------

    def flush_cache(self) -> FlushCacheOut:
        scheduler = self.scheduler
        if not scheduler.is_idle():
            return FlushCacheOut(False, f"{len(scheduler.reqs)} request(s) in flight; flush when idle")
        scheduler.tree_cache.evict(scheduler.tree_cache.evictable_size())
        scheduler.encoding.cache.clear()
        return FlushCacheOut(True)

    def stats(self) -> StatsOut:
        s, m = self.scheduler, self.scheduler.metrics
        used = s.max_total_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
        cache = s.encoding.cache
        encoder = s.encoding.encoder
        pool = encoder if isinstance(encoder, EncoderPool) else None
        return StatsOut(
            num_running=len(s.running_batch.reqs), num_waiting=len(s.waiting_queue), num_encoding=len(s.encoding),
            kv_usage=used / s.max_total_tokens, max_total_tokens=s.max_total_tokens,
            prefix_cache_hit_rate=m.cache_hit_rate, cached_prompt_tokens=m.cached_prompt_tokens,
            computed_prompt_tokens=m.computed_prompt_tokens, generated_tokens=m.generated_tokens,
            num_retractions=m.num_retractions,
            embedding_cache={
                "hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions, "usage_bytes": cache.usage_bytes,
            },
            encoder_load=[rank.load for rank in pool.ranks] if pool else [],
            encoder_restarts=pool.num_restarts if pool else 0,
            media_items=m.media_items, media_seconds={k: asdict(h) for k, h in m.media_seconds.items()},
        )  # fmt: skip


def ignore_interrupts() -> None:
    """In a child of the server: Ctrl-C reaches the whole process group, but the server decides how
    its children stop; SIGTERM (the server's request) exits through `finally` blocks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, dist_port: int, ready: Connection
) -> None:
    """Entry point of a scheduler process: builds the model and its scheduler, reports ("ready", limits)
    or ("error", traceback) on `ready`, then loops until stopped."""
    ignore_interrupts()
    logging.basicConfig(
        level=server_args.log_level.upper(), format=f"%(asctime)s scheduler TP{tp_rank} %(levelname)s %(message)s"
    )
    scheduler = None
    try:
        control_group = None
        if server_args.tp_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
            backend = "nccl" if server_args.resolved_device().type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=tp_rank, world_size=server_args.tp_size)
            control_group = dist.new_group(backend="gloo")
        model_config = ModelConfig.from_pretrained(server_args.model)
        runner = ModelRunner(server_args, model_config)
        scheduler = Scheduler(server_args, runner, Tokenizer.from_pretrained(server_args.model))
        process = SchedulerProcess(scheduler, port_args, tp_rank, control_group)
    except Exception:  # noqa: BLE001 - reported to the server, which stops
        ready.send(("error", traceback.format_exc()))
        if scheduler is not None:
            scheduler.shutdown()
        return
    ready.send((
        "ready",
        {
            "max_total_tokens": scheduler.max_total_tokens, "context_length": runner.context_len,
            "max_running_requests": scheduler.max_running_requests, "page_size": scheduler.page_size,
        },
    ))  # fmt: skip
    try:
        process.event_loop()
    finally:
        scheduler.shutdown()
