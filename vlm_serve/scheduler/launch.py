"""Launching a batch: its tensors built, its forward run on the forward thread (overlap) or here, and what
the result's processing needs kept (`LaunchedBatch`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.llm.forward_batch import ForwardBatch, ForwardMode, ForwardOutput
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.overlap import ForwardThread, FutureMap
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.drafting import Drafting
from vlm_serve.scheduler.metrics import SchedulerMetrics
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch


@dataclass
class LaunchedBatch:
    """A batch whose forward was launched: what `process_batch_result` needs once it has run."""

    reqs: list[Req]
    forward_mode: ForwardMode
    num_prefill_reqs: int  # the first rows; the others (a mixed batch) were decoding
    samples: list[bool]  # per row: whether its sampled token is an output (not for a chunk before the end)
    kv_ends: list[int]  # per row: its tokens with KV once the batch has run
    future_start: int  # FutureMap slot of row 0's token
    result: Future[ForwardOutput]
    num_drafts: list[int] | None = None  # TARGET_VERIFY: each row's draft tokens
    keep_aux: bool = False  # whether the EAGLE-3 draft ran after it (else its requests draft no more)

    @classmethod
    def of(cls, batch: ScheduleBatch, forward_batch: ForwardBatch) -> LaunchedBatch:
        """What to keep of a batch about to be launched (its result is set when the forward has run)."""
        verify = batch.forward_mode == ForwardMode.TARGET_VERIFY
        return cls(
            reqs=list(batch.reqs),
            forward_mode=batch.forward_mode,
            num_prefill_reqs=batch.num_prefill_reqs,
            samples=list(batch.samples),
            kv_ends=list(forward_batch.seq_lens_cpu),
            future_start=forward_batch.future_start,
            result=Future(),
            num_drafts=[len(d) for d in forward_batch.draft_ids] if verify else None,
            keep_aux=forward_batch.keep_aux,
        )


class SchedulerLaunchMixin:
    """The scheduler's launch of a batch: a part of `Scheduler`, which holds the state named here."""

    concerns: SchedulerConcerns
    runner: ModelRunner
    tree_cache: RadixCache
    future_map: FutureMap
    drafting: Drafting
    forward: Callable[[ForwardBatch], ForwardOutput]
    forward_thread: ForwardThread | None
    metrics: SchedulerMetrics
    forward_ct: int
    log_stats: Callable[[ForwardMode, int, int], None]  # (SchedulerMetricsMixin's)

    def run_batch(self, batch: ScheduleBatch) -> LaunchedBatch:
        """Builds the batch's tensors and launches its forward: on the forward thread with overlap (the
        result arrives later), else here and now. Requests whose token it samples get a future id."""
        t0 = time.perf_counter()
        verify = batch.forward_mode == ForwardMode.TARGET_VERIFY
        if batch.forward_mode.is_decode():
            forward_batch = batch.prepare_for_decode()
        elif verify:
            forward_batch = batch.prepare_for_verify(draft_model=self.drafting.eagle is not None)
        else:
            forward_batch = batch.prepare_for_extend()
        forward_batch.future_start = self.future_map.alloc(len(batch.reqs))
        forward_batch.keep_aux = self.drafting.eagle is not None and not self.drafting.skips(batch)
        if forward_batch.keep_aux and not verify:
            forward_batch.draft_next_ids = batch.draft_next_ids(forward_batch)
        self.runner.init_forward_metadata(forward_batch)
        for i, (req, samples) in enumerate(zip(batch.reqs, batch.samples)):
            if verify:
                req.verifying = True  # (how many tokens it keeps is waited for)
            elif samples:
                req.future_token = FutureMap.future_id(forward_batch.future_start + i)
        for req in batch.reqs[: batch.num_prefill_reqs]:
            # share the prompt (or chunk) at once: every forward that could read its KV runs after this one
            self.tree_cache.cache_unfinished_req(req)
        launched = LaunchedBatch.of(batch, forward_batch)
        t1 = time.perf_counter()
        self.metrics.time_schedule += t1 - t0
        if self.forward_thread is not None:
            launched.result = self.forward_thread.launch(forward_batch)
        else:
            launched.result.set_result(self.forward(forward_batch))
            self.metrics.time_forward += time.perf_counter() - t1
        self.tree_cache.after_launch()
        self.forward_ct += 1
        if self.forward_ct % self.concerns.log.log_interval == 0:
            self.log_stats(batch.forward_mode, len(batch.reqs), len(forward_batch.input_ids))
        return launched
