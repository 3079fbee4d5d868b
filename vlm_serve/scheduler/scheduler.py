"""The scheduler: owns `waiting_queue`, `running_batch` and the RadixCache, decides every iteration what
the model runs, and runs its own event loop.

An iteration reads as SGLang's: `recv_requests` → `process_input_requests` → `get_next_batch_to_run`
(merge the last prefill into `running_batch`; a new prefill if one fits, continuing the `chunked_req`;
else decode the running batch, retracting requests when decode memory runs out) → `run_batch` →
`process_batch_result` → `stream_output`. `event_loop_normal` processes each batch's result right after
its forward. `event_loop_overlap` launches batch N+1 before processing batch N's result, so the
scheduler's own work overlaps the model's (see `llm/overlap.py`).

Its I/O is injected (`SchedulerIO`): ZMQ sockets in the server's scheduler process, queues in `Engine`,
which drives the same loop one iteration at a time (`run_iteration`).

This file holds the loops, a request's end and the choice of batches; the rest is in parts beside it:
requests in (`intake.py`), a batch launched (`launch.py`), results (`output_processor.py`), what goes out
(`output_streamer.py`), the settings it reads (`concerns.py`), reports and health (`stats.py`), and the
stages a request may wait in (`grammar_queue.py`, `encoding_stage.py`, `pd_prefill.py`/`pd_decode.py`),
drafting (`drafting.py`) and TP's broadcasts (`tp_broadcast.py`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections import deque
from collections.abc import Callable

import torch

from vlm_serve.disaggregation.factory import create_transfer_backend
from vlm_serve.disaggregation.transfer import KVLayout
from vlm_serve.kv_cache.cache_controller import run_inline
from vlm_serve.kv_cache.factory import create_tree_cache
from vlm_serve.kv_cache.hiradix_cache import HiRadixCache
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.llm.distributed import get_parallel_state
from vlm_serve.llm.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.overlap import ForwardThread, FutureMap
from vlm_serve.llm.speculative.worker import SpeculativeWorker
from vlm_serve.messages.backend import (
    SchedulerLimits,
)
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.drafting import Drafting
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.grammar_queue import GrammarQueue
from vlm_serve.scheduler.intake import SchedulerIntakeMixin
from vlm_serve.scheduler.launch import LaunchedBatch, SchedulerLaunchMixin
from vlm_serve.scheduler.metrics import SchedulerMetrics
from vlm_serve.scheduler.output_processor import SchedulerOutputProcessorMixin
from vlm_serve.scheduler.output_streamer import OutputStreamer, SchedulerIO
from vlm_serve.scheduler.pd_common import META_SLOT_BYTES
from vlm_serve.scheduler.pd_decode import DecodeDisaggregation
from vlm_serve.scheduler.pd_prefill import PrefillDisaggregation
from vlm_serve.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, request_failure
from vlm_serve.scheduler.schedule_policy import (
    AddReqResult,
    InBatchPrefixes,
    NewTokenRatio,
    PrefillAdder,
    SchedulePolicy,
)
from vlm_serve.scheduler.stats import SchedulerMetricsMixin
from vlm_serve.scheduler.storage_prefetch import StoragePrefetch
from vlm_serve.scheduler.tp_broadcast import TPBroadcast
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder import VisionEncoder

logger = logging.getLogger(__name__)

RETRACT_DECODE_STEPS = 20  # after a retraction the rest must be able to decode this many steps


class Scheduler(SchedulerIntakeMixin, SchedulerLaunchMixin, SchedulerOutputProcessorMixin, SchedulerMetricsMixin):
    """Turns requests into batches and batches into outputs, one `run_iteration` at a time."""

    def __init__(
        self,
        concerns: SchedulerConcerns,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        encoder: VisionEncoder | None,
        io: SchedulerIO | None = None,
    ) -> None:
        self.concerns = concerns
        settings = concerns.schedule
        self.runner = runner
        self.tokenizer = tokenizer
        self.io = io
        parallel = get_parallel_state()
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.tp_cpu_group = parallel.tp_cpu_group
        self.tp_broadcast = TPBroadcast(parallel, runner) if self.tp_size > 1 else None
        self.vocab_size = runner.model_config.text.vocab_size
        self.merge_size = runner.model_config.vision.spatial_merge_size
        self.eos_token_ids = set(runner.model_config.eos_token_ids)
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.future_map: FutureMap = runner.future_map
        self.max_total_tokens = runner.max_total_tokens
        self.max_running_requests = self.req_to_token_pool.size
        self.max_prefill_tokens = min(settings.max_prefill_tokens, self.max_total_tokens)
        chunk = settings.prefill_chunk
        self.chunked_prefill_size = None if chunk is None else min(chunk, self.max_prefill_tokens)
        self.enable_mixed_chunk = settings.enable_mixed_chunk and self.chunked_prefill_size is not None

        self.encoding = EncodingStage(encoder, settings.mm_cache_mb << 20)
        self.grammar_queue = GrammarQueue(tokenizer, runner.model_config, settings.grammar_compile_timeout, parallel)
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.reqs: dict[str, Req] = {}  # every unfinished request, by id

        self.new_token_ratio = NewTokenRatio(settings.schedule_conservativeness)

        self.enable_overlap = not settings.disable_overlap_schedule
        self.drafting = Drafting(concerns.speculative, runner)
        # what runs a launched batch: the runner's forward, or around it the drafts' verification and draft
        self.forward: Callable[[ForwardBatch], ForwardOutput] = (
            SpeculativeWorker(runner, self.drafting.eagle).forward_batch_generation
            if concerns.speculative.speculating
            else runner.forward_batch_generation
        )
        if encoder is not None and encoder.cores is not None:
            self.forward = encoder.cores.llm_side(self.forward)
        self.forward_thread = ForwardThread(runner, self.forward) if self.enable_overlap else None
        if self.forward_thread is not None:
            if encoder is not None:
                encoder.run_on(self.forward_thread)  # an inline vision tower runs in order with the forwards
            weakref.finalize(self, self.forward_thread.shutdown)  # dropped or left without shutdown()
        self.storage_prefetch: StoragePrefetch | None = None  # (with a storage tier)
        self.tree_cache = self._init_tree_cache()
        self.policy = SchedulePolicy(
            settings.schedule_policy, self.tree_cache, settings.enable_priority_scheduling, concerns.model.seed
        )
        self.running_batch = self.new_batch([])
        self.result_queue: deque[LaunchedBatch] = deque()  # launched, result not processed yet
        self.event_loop: Callable[[], None] = self.event_loop_overlap if self.enable_overlap else self.event_loop_normal
        self.run_iteration: Callable[[], None] = (
            self.run_iteration_overlap if self.enable_overlap else self.run_iteration_normal
        )
        self.metrics = SchedulerMetrics()
        self.forward_ct = 0
        self._idle_checked = True
        self.outputs = OutputStreamer(io, self.tp_rank, concerns.speculative.speculating)
        self.disagg = self._init_disaggregation()
        # What is alive now lives as long as the scheduler (the model, its pools, the tokenizer): frozen out of
        # the cyclic collector's generations. A decode step makes small objects per request, which trigger
        # collections, and the full ones would scan all of these again (at batch 160 on a 2-core EPYC, 1.7 ms
        # of a step with a 3 ms forward). `shutdown` gives them back to the collector, or the interpreter's exit
        # (whose last collection must free them).
        gc.collect()
        gc.freeze()
        weakref.finalize(self, gc.unfreeze)

    def _init_tree_cache(self) -> RadixCache:
        """The prefix cache; with --enable-hierarchical-cache over a host-memory tier, whose copies run in
        order with the forwards (not on PD's decode side, which keeps requests' KV only while they run)."""
        c, runner = self.concerns, self.runner
        tiers = c.hicache.enable_hierarchical_cache and c.disaggregation.disaggregation_mode != "decode"
        lora = runner.lora
        tree = create_tree_cache(
            c.hicache if tiers else None,
            c.schedule.disable_radix_cache,
            self.req_to_token_pool,
            self.allocator,
            runner.token_to_kv_pool,
            self.forward_thread.submit if self.forward_thread is not None else run_inline,
            runner.kv_namespace,
            None if lora is None else lambda load_id: getattr(lora.loaded(load_id), "digest", None),
        )
        if isinstance(tree, HiRadixCache) and tree.controller.storage is not None:
            policy, timeout = c.hicache.hicache_storage_prefetch_policy, c.hicache.hicache_storage_prefetch_timeout
            self.storage_prefetch = StoragePrefetch(tree, policy, timeout, self.tp_cpu_group)
        return tree

    def _init_disaggregation(self) -> PrefillDisaggregation | DecodeDisaggregation | None:
        """This rank's side of PD (`--disaggregation-mode`): its transfer backend, with the KV pool and a
        metadata slot per request row registered, and the side's queues."""
        mode = self.concerns.disaggregation.disaggregation_mode
        if mode == "null":
            return None
        records = torch.zeros(self.req_to_token_pool.size, META_SLOT_BYTES, dtype=torch.uint8)
        layout = KVLayout.of(self.runner.token_to_kv_pool, records)
        backend = create_transfer_backend(self.concerns.transfer, mode, self.tp_rank, layout)
        side = PrefillDisaggregation if mode == "prefill" else DecodeDisaggregation
        return side(self, backend, records)

    def shutdown(self) -> None:
        gc.unfreeze()
        if self.disagg is not None:
            self.disagg.backend.close()
        if self.storage_prefetch is not None:
            self.storage_prefetch.tree.controller.storage.close()
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
            self.forward_thread = None
        if self.encoding.encoder is not None:
            self.encoding.encoder.shutdown()
        self.grammar_queue.shutdown()

    def new_batch(self, reqs: list[Req], mode: ForwardMode = ForwardMode.DECODE) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache, mode)

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(
            self.max_total_tokens, self.runner.context_len, self.max_running_requests, self.allocator.page_size
        )

    # ---- the event loops ---------------------------------------------------------------------------

    def event_loop_normal(self) -> None:
        """Each batch's result is processed right after its forward (--disable-overlap-schedule)."""
        while True:
            self.run_iteration_normal()

    def run_iteration_normal(self) -> None:
        recv_reqs = self.recv_requests()
        self.process_input_requests(recv_reqs)
        batch = self.get_next_batch_to_run()
        if batch is not None:
            launched = self.run_batch(batch)
            self.process_batch_result(launched)
        else:
            self.self_check_when_idle()
        self.last_batch = batch
        self.stream_output()

    def event_loop_overlap(self) -> None:
        """Batch N+1 is prepared and launched while batch N runs; N's result is processed after that,
        while N+1 runs."""
        while True:
            self.run_iteration_overlap()

    def run_iteration_overlap(self) -> None:
        with self.forward_thread.scheduler_side():
            self._iteration_overlap()

    def _iteration_overlap(self) -> None:
        recv_reqs = self.recv_requests()
        self.process_input_requests(recv_reqs)
        batch = self.get_next_batch_to_run()
        if batch is None and self.result_queue:
            # what could run next waits for the batch in flight (its requests' last tokens)
            self.process_batch_result(self.result_queue.popleft())
            self.last_batch = None  # merged into running_batch already
            batch = self.get_next_batch_to_run()
        launched = self.run_batch(batch) if batch is not None else None
        if self.result_queue:
            self.process_batch_result(self.result_queue.popleft())  # the previous batch, while this one runs
        if launched is not None:
            self.result_queue.append(launched)
        else:
            self.self_check_when_idle()
        self.last_batch = batch
        self.stream_output()

    # ---- a request's end ---------------------------------------------------------------------------

    def abort_request(self, rid: str, message: str = "aborted") -> None:
        req = self.reqs.get(rid)
        if req is not None:
            self.stop_request(req, FinishReason("abort", message=message))

    def stop_request(self, req: Req, reason: FinishReason) -> None:
        """Ends a request wherever it is (an abort, or a failure of its own): at once where it waits; in a
        batch (it holds KV), when the next batch is built, which releases what it holds."""
        if req in self.grammar_queue:
            self.grammar_queue.remove(req)
        elif req in self.encoding:
            self.encoding.remove(req)
        elif req in self.waiting_queue:
            self.waiting_queue.remove(req)
        elif self.disagg is not None and self.disagg.remove(req):
            pass
        elif self.storage_prefetch is not None and req in self.storage_prefetch:
            pass  # (`finish` forgets its read)
        elif req.req_pool_idx is not None or req is self.chunked_req:
            req.to_finish = reason
            return
        self.finish(req, reason)

    def fail_request(self, req: Req, where: str, exc: Exception | str) -> None:
        """A request's own failure (its sampling, grammar or output): it ends with a 500 naming the cause,
        and the others go on."""
        if not req.finished and req.to_finish is None:
            self.stop_request(req, request_failure(req, where, exc))

    def finish(self, req: Req, reason: FinishReason) -> None:
        if req.transfer is not None and reason.kind in ("abort", "error"):
            req.transfer.abort()  # (the other side learns it; a finished transfer ignores it)
        if self.disagg is not None:
            self.disagg.forget(req)
        if self.storage_prefetch is not None:
            self.storage_prefetch.forget(req)
        self.encoding.release(req)
        req.finished_reason = reason
        del self.reqs[req.rid]
        self.metrics.num_finished += 1
        self.outputs.finished.append(req)

    def is_idle(self) -> bool:
        return not self.reqs and not self.result_queue

    def _has_work(self) -> bool:
        """Whether a batch can run now (without waiting for the encoder), or one is running."""
        return bool(self.waiting_queue or self.chunked_req or self.running_batch.reqs or self.result_queue) or (
            self.last_batch is not None and self.last_batch.forward_mode.extends_prompts()
        )

    # ---- choosing the next batch -------------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.last_batch is not None and self.last_batch.forward_mode.extends_prompts():
            # the last prefill's requests (but the one still being chunked) start decoding
            joined = [
                r
                for r in self.last_batch.reqs
                if not r.finished and r is not self.chunked_req and r.transfer is None  # (PD prefill: none decode here)
            ]
            self.running_batch.reqs = self.running_batch.reqs + joined
        self._release_stopped()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        return self.update_running_batch()

    def _release_stopped(self) -> None:
        """Releases the requests stopped while in a batch (aborted or failed) and drops finished ones from
        the running batch. A request may be in the batch still running (overlap): its KV is read by that
        forward and written only by later ones, which run after it. A failed request's KV is not cached:
        it may not match its tokens."""
        stopped = [r for r in self.running_batch.reqs if r.to_finish is not None and not r.finished]
        if self.chunked_req is not None and self.chunked_req.to_finish is not None:
            stopped.append(self.chunked_req)
            self.chunked_req = None
        for req in stopped:
            self.tree_cache.cache_finished_req(req, keep=req.to_finish.kind != "error")
            self.finish(req, req.to_finish)
        self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.finished]

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = len(self.running_batch.reqs) + (self.chunked_req is not None)
        if running >= self.max_running_requests and self.chunked_req is None:
            return None
        prefixes_matched = self.policy.calc_priority(self.waiting_queue)
        mixed = [r for r in self.running_batch.reqs if r.needs_decode] if self.enable_mixed_chunk else []
        adder = PrefillAdder(
            self.tree_cache,
            self.running_batch,
            self.new_token_ratio.value,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            len(mixed),
        )
        if self.chunked_req is not None:
            self.chunked_req.extend_len = self.chunked_req.seq_len - self.chunked_req.kv_len
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        in_batch = InBatchPrefixes(self.tree_cache)
        evicted = self.tree_cache.evicted_tokens  # (loading a host hit back evicts: later matches are redone)
        for req in list(self.waiting_queue):
            if (
                running + len(adder.can_run_list) >= self.max_running_requests
                or adder.new_chunked_req
                or self.chunked_req
            ):
                break
            # (pages read from storage for it join the host tier now, and no later: best_effort waits for none)
            took = self.storage_prefetch is not None and self.storage_prefetch.take(req)
            if not prefixes_matched or took or self.tree_cache.evicted_tokens != evicted:
                req.match_prefix(self.tree_cache)
            if req.mm_items and self.encoding.add(req, len(req.prefix_indices) + req.host_hit_length):
                self.waiting_queue.remove(req)  # its cached prefix shrank: it needs embeddings after all
                continue
            if in_batch.should_wait(req):
                continue  # it will hit the cache next round
            if self.concerns.schedule.enable_priority_scheduling:
                threshold = self.concerns.schedule.priority_scheduling_preemption_threshold
                result, preempted = adder.add_one_req_preempting(req, self.running_batch, threshold)
                if preempted:
                    self.metrics.num_preemptions += len(preempted)
                    self.waiting_queue.extend(preempted)
                    mixed = [r for r in mixed if r not in preempted]
            else:
                result = adder.add_one_req(req)
            if req in adder.can_run_list:
                in_batch.add(req)
            if result != AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        picked = set(map(id, adder.can_run_list))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in picked]
        for req in adder.can_run_list:
            if req.req_pool_idx is None:
                req.cached_tokens = max(req.cached_tokens, len(req.prefix_indices))
                self.metrics.cached_prompt_tokens += len(req.prefix_indices)
            self.metrics.computed_prompt_tokens += req.extend_len
        batch = self.new_batch(adder.can_run_list, ForwardMode.EXTEND)
        if mixed:
            batch.mix_with_running(mixed)
            self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.needs_decode]
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        """The decode batch: running requests that can still grow. Before it, retract requests if the
        KV cache cannot hold one more token each, else let `new_token_ratio` decay back towards its
        minimum."""
        batch = self.running_batch
        if not batch.reqs or any(r.verifying for r in batch.reqs):  # (its result comes first: one at a time)
            return None
        if not batch.check_decode_mem():
            retracted = batch.retract_decode(RETRACT_DECODE_STEPS)
            self.metrics.num_retractions += len(retracted)
            if isinstance(self.disagg, DecodeDisaggregation):
                retracted = self.disagg.requeue(retracted)
            self.waiting_queue = retracted + self.waiting_queue
            self.new_token_ratio.after_retraction(batch.reqs, RETRACT_DECODE_STEPS)
            logger.warning(
                "KV cache full: retracted %d request(s); new_token_ratio is now %.2f",
                len(retracted),
                self.new_token_ratio.value,
            )
        else:
            self.new_token_ratio.decay()
        decoding = [r for r in batch.reqs if r.needs_decode]  # the others' last token is in flight
        drafting = self.drafting.enabled(len(decoding))
        if drafting:  # drafts follow the tokens kept: those with tokens in flight wait for them
            decoding = [r for r in decoding if r.settled]
        if not decoding:
            return None
        decode = self.new_batch(decoding)
        if drafting:
            drafts = self.drafting.drafts(decoding)
            free = self.allocator.available_size() + self.tree_cache.evictable_size()
            # (drafts only where the pool holds them as well: whole pages for every request's 1 + k tokens)
            if any(drafts) and free >= sum(len(d) + 1 for d in drafts) + len(decoding) * self.allocator.page_size:
                decode.forward_mode, decode.draft_ids = ForwardMode.TARGET_VERIFY, drafts
        return decode
