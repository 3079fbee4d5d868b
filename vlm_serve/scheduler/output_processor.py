"""A launched batch's result, row by row: each request's sampled token (or the tokens a verify step kept)
appended with its log-probs, finish checks, and what the request's PD side or cache does next."""

from __future__ import annotations

import time

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.llm.forward_batch import ForwardMode, ForwardOutput, sample_groups
from vlm_serve.llm.layers.sampler import SampleOutput
from vlm_serve.llm.overlap import ForwardThread, FutureMap
from vlm_serve.scheduler.drafting import Drafting
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.launch import LaunchedBatch
from vlm_serve.scheduler.metrics import SchedulerMetrics
from vlm_serve.scheduler.output_streamer import OutputStreamer
from vlm_serve.scheduler.pd_decode import DecodeDisaggregation
from vlm_serve.scheduler.pd_prefill import PrefillDisaggregation
from vlm_serve.scheduler.schedule_batch import Req


class SchedulerOutputProcessorMixin:
    """The scheduler's result processing: a part of `Scheduler`, which holds the state named here and the steps
    of a request's life it calls (`finish`, `fail_request`)."""

    reqs: dict[str, Req]
    waiting_queue: list[Req]
    tree_cache: RadixCache
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    eos_token_ids: set[int]
    encoding: EncodingStage
    drafting: Drafting
    disagg: PrefillDisaggregation | DecodeDisaggregation | None
    forward_thread: ForwardThread | None
    outputs: OutputStreamer
    metrics: SchedulerMetrics

    def process_batch_result(self, batch: LaunchedBatch) -> None:
        """Appends each request's sampled token and checks whether it finished. Under overlap a request
        may have changed since the batch was launched: aborted (skipped), or retracted or preempted
        (its token is kept; it re-prefills with it)."""
        result = batch.result.result()  # waits for the forward
        out = result.sample
        t0 = time.perf_counter()
        next_token_ids = out.tolist()
        if batch.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            self.metrics.num_decode_batches += 1
            self.metrics.peak_decode_batch = max(self.metrics.peak_decode_batch, len(batch.reqs))
        elif batch.forward_mode == ForwardMode.MIXED:
            self.metrics.num_mixed_batches += 1
        else:
            self.metrics.num_prefill_batches += 1
        for i, (req, rows) in enumerate(zip(batch.reqs, sample_groups(len(batch.reqs), batch.num_drafts))):
            req.verifying = False
            if req.finished or req.to_finish is not None:
                continue
            failure = next((out.failures[row] for row in rows if row in out.failures), None)
            if failure is not None:
                self.fail_request(req, "while sampling", failure)
                continue
            try:
                self._process_result_row(batch, i, req, result, next_token_ids, rows)
            except Exception as exc:  # noqa: BLE001 - its own failure: it ends, the others go on
                self.fail_request(req, "while its output was processed", exc)
        self.drafting.drafted(batch.reqs, batch.keep_aux, result.draft_states)
        if isinstance(self.disagg, PrefillDisaggregation):
            self.disagg.send_computed()  # (after the draft's extend: its KV goes too)
        self.metrics.time_process += time.perf_counter() - t0
        if self.forward_thread is not None:
            self.metrics.time_forward = self.forward_thread.busy_seconds

    def _process_result_row(
        self, batch: LaunchedBatch, i: int, req: Req, result: ForwardOutput, next_token_ids: list[int], rows: range
    ) -> None:
        """Row `i` of a batch's result: request `req`'s prompt log-probs, its token(s) (sampled at `rows`)."""
        out = result.sample
        if result.prompt_logprobs[i] is not None:
            req.prompt_logprobs.extend(result.prompt_logprobs[i])
        if i < batch.num_prefill_reqs and req.mm_embeds and req.kv_len >= len(req.origin_input_ids):
            self.encoding.release(req)  # the prompt's KV is computed: its embeddings are not needed
        pd_prefill = i < batch.num_prefill_reqs and req.transfer is not None  # its KV goes to a decode server
        if not batch.samples[i]:  # a chunk that is not the last: nothing to sample yet
            if pd_prefill:
                self.disagg.chunk_done(req, batch.kv_ends[i])
            return
        if req.future_token == FutureMap.future_id(batch.future_start + i):
            req.future_token = 0  # (a later batch may already have given it the next one)
        if pd_prefill:
            self.disagg.prompt_done(req, next_token_ids[i], out, i)
            return
        if batch.num_drafts is not None:
            self.append_verified(req, batch.num_drafts[i], result.accepted[i], out, rows)
        else:
            logprobs = out.logprobs[i] if req.sampling_params.logprobs else None
            top = out.top_logprobs[i] if req.sampling_params.logprobs and req.sampling_params.top_logprobs else None
            self.append_token(req, next_token_ids[i], logprobs, top)
        if req.finished:
            if req.req_pool_idx is not None:
                self.tree_cache.cache_finished_req(req)
            else:  # released while the batch ran: it waits to be prefilled again
                self.waiting_queue.remove(req)

    def append_token(
        self, req: Req, token: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None
    ) -> None:
        """A token for the request's answer (with its log-probs where it asked for them); it may end it."""
        req.output_ids.append(token)
        self.metrics.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.sampling_params.logprobs:
            req.output_logprobs.append(logprob)
            if req.sampling_params.top_logprobs:
                req.output_top_logprobs.append(top_logprobs)
        reason = req.check_finished(token, self.eos_token_ids)
        if reason is not None:
            self.finish(req, reason)

    def append_verified(self, req: Req, num_drafts: int, tokens: list[int], out: SampleOutput, rows: range) -> None:
        """The tokens a verify forward kept (`tokens`, sampled at its `rows` of `out`), with their log-probs,
        until one ends the answer; then the KV of the positions not kept is released (RadixCache only ever
        holds kept tokens)."""
        computed_end = req.kv_len  # the last token and every draft were computed
        self.drafting.verified(req, len(tokens))
        for counts in (self.metrics.spec, req.spec):
            counts.add(num_drafts, len(tokens) - 1)
        for token, row in zip(tokens, rows):
            self.append_token(req, token, out.logprobs[row], out.top_logprobs[row])
            if req.finished:
                break
        if req.req_pool_idx is None:  # preempted while it was verified: it is prefilled again, with these
            return
        # computed and kept: the tokens before the last appended one (whose KV the next step computes)
        req.kv_len = min(computed_end - num_drafts + len(tokens) - 1, len(req.fill_ids) - 1)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[req.kv_len : computed_end].long()
        page_size = self.allocator.page_size
        kept_page = int(row[req.kv_len - 1]) // page_size  # (the next tokens fill its tail)
        self.allocator.free(slots[slots // page_size != kept_page])

    # ---- outputs -----------------------------------------------------------------------------------

    def stream_output(self) -> None:
        self.outputs.stream_output(self.reqs.values())
