"""The scheduler: owns `waiting_queue`, `running_batch` and the RadixCache, and decides every step what
the model runs.

One step of `event_loop_normal`: merge the last prefill batch into `running_batch`, try a new prefill
(`get_new_batch_prefill`, which may continue the `chunked_req`), otherwise decode the running batch
(retracting requests when decode memory runs out); run it; process the result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vlm_serve.config import ServerArgs
from vlm_serve.detokenizer import IncrementalDetokenizer, find_stop
from vlm_serve.llm.forward_batch import ForwardMode
from vlm_serve.llm.layers.sampler import SampleOutput
from vlm_serve.llm.mem_cache.radix_cache import RadixCache
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.encoding_stage import EncodingStage
from vlm_serve.llm.scheduler.metrics import SchedulerMetrics
from vlm_serve.llm.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch
from vlm_serve.llm.scheduler.schedule_policy import (
    IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD,
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)
from vlm_serve.mm_cache.hashing import pad_input_ids
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder import InlineEncoder, VisionEncoder
from vlm_serve.vision.encoder_pool import EncoderPool

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens running requests are assumed to still use
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # the ratio decays to this fraction of its initial value
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps to decay from initial to minimum
RETRACT_DECODE_STEPS = 20  # after a retraction the rest must be able to decode this many steps
ENCODER_WAIT_SECONDS = 0.05  # with nothing to run but media being encoded, wait this long per step


@dataclass
class BatchResult:
    next_token_ids: list[int]
    sample: SampleOutput


class Scheduler:
    """Turns requests into batches. `step()` runs one batch and returns the requests it finished."""

    def __init__(self, server_args: ServerArgs, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        self.server_args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = runner.model_config.text.vocab_size
        self.eos_token_ids = set(runner.model_config.eos_token_ids)
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.page_size = server_args.page_size
        self.max_total_tokens = runner.max_total_tokens
        self.max_running_requests = self.req_to_token_pool.size
        self.max_prefill_tokens = min(server_args.max_prefill_tokens, self.max_total_tokens)
        chunk = server_args.chunked_prefill_size
        self.chunked_prefill_size = None if chunk == -1 else min(chunk, self.max_prefill_tokens)
        self.enable_mixed_chunk = server_args.enable_mixed_chunk and self.chunked_prefill_size is not None

        self.tree_cache = RadixCache(
            self.req_to_token_pool, self.allocator, self.page_size, disable=server_args.disable_radix_cache
        )
        self.policy = SchedulePolicy(
            server_args.schedule_policy, self.tree_cache, server_args.enable_priority_scheduling, server_args.seed
        )
        self.encoding = EncodingStage(self._create_encoder(), server_args.mm_cache_mb << 20)
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.reqs: dict[str, Req] = {}  # every unfinished request, by id

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        self.metrics = SchedulerMetrics()
        self.forward_ct = 0
        self._idle_checked = True
        self._finished: list[Req] = []

    def _create_encoder(self) -> VisionEncoder:
        if self.server_args.vit_dp == 0:
            return InlineEncoder(self.runner.model.visual, self.server_args.vit_max_patches_per_pass)
        return EncoderPool(self.server_args, self.runner.device)

    def shutdown(self) -> None:
        self.encoding.encoder.shutdown()

    def _new_batch(self, reqs: list[Req], mode: ForwardMode = ForwardMode.DECODE) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache, mode)

    # ---- requests in and out -----------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Validates and queues a request; a request that can never run raises ValueError."""
        prompt_len, max_new = len(req.origin_input_ids), req.sampling_params.max_new_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        placeholder = [False] * prompt_len
        for item in req.mm_items:
            if item.pixel_values.dim() != 2 or item.pixel_values.shape[0] != item.num_patches:
                raise ValueError(
                    f"{item.modality} pixel values of shape {tuple(item.pixel_values.shape)} do not match its grid "
                    f"{item.grid_thw} ({item.num_patches} patches)"
                )
            for start, end in item.spans:
                placeholder[start:end] = [True] * (end - start)
        bad = [t for t, mm in zip(req.origin_input_ids, placeholder) if not mm and not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        limit = self.runner.context_len
        if prompt_len + max_new > limit:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new}) exceeds the context length {limit}"
            )
        if prompt_len + max_new + self.page_size > self.max_total_tokens:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_new}) can never fit in the KV cache "
                f"({self.max_total_tokens} tokens)"
            )
        req.origin_input_ids = pad_input_ids(req.origin_input_ids, req.mm_items, self.vocab_size)
        req.init_positions(self.runner.model_config.vision.spatial_merge_size)
        if req.sampling_params.stop:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.reqs[req.rid] = req
        self._idle_checked = False
        if req.mm_items:
            covered = len(self.tree_cache.match_prefix(req.origin_input_ids[:-1]).indices)
            if not self.encoding.add(req, covered):
                return  # it joins waiting_queue when its embeddings are ready
            self.metrics.observe_media(req.mm_items)
        self.waiting_queue.append(req)

    def process_encoding_results(self, timeout: float = 0.0) -> None:
        """Moves requests whose media are now encoded to `waiting_queue`; fails those that cannot be."""
        ready, failed = self.encoding.poll(timeout)
        for req in ready:
            self.metrics.observe_media(req.mm_items)
            self.waiting_queue.append(req)
        for req, error in failed:
            self._finish(req, FinishReason("abort", message=error))

    def abort_request(self, rid: str, message: str = "aborted") -> None:
        """Stops a request wherever it is; everything it holds is released by the next step."""
        req = self.reqs.get(rid)
        if req is None:
            return
        if req in self.encoding:
            self.encoding.remove(req)
            self._finish(req, FinishReason("abort", message=message))
        elif req in self.waiting_queue:
            self.waiting_queue.remove(req)
            self._finish(req, FinishReason("abort", message=message))
        else:
            req.to_abort = message

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.encoding.release(req)
        req.finished_reason = reason
        del self.reqs[req.rid]
        self.metrics.num_finished += 1
        self._finished.append(req)

    def is_idle(self) -> bool:
        return not self.reqs

    # ---- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """One iteration of the event loop (after receiving requests). Returns finished requests."""
        if self.encoding.inflight:
            self.process_encoding_results(0.0 if self._has_work() else ENCODER_WAIT_SECONDS)
        t0 = time.perf_counter()
        batch = self.get_next_batch_to_run()
        self.last_batch = batch
        if batch is None:
            if self.is_idle() and not self._idle_checked:
                self.check_memory()
                self._idle_checked = True
        else:
            forward_batch = batch.prepare_for_decode() if batch.forward_mode.is_decode() else batch.prepare_for_extend()
            t2 = time.perf_counter()
            result = self.run_batch(batch, forward_batch)
            t3 = time.perf_counter()
            num_reqs, new_tokens = len(batch.reqs), len(forward_batch.input_ids)
            if batch.forward_mode.is_decode():
                self.process_batch_result_decode(batch, result)
            else:
                self.process_batch_result_prefill(batch, result)
            self.metrics.time_schedule += t2 - t0
            self.metrics.time_forward += t3 - t2
            self.metrics.time_process += time.perf_counter() - t3
            self.forward_ct += 1
            if self.forward_ct % self.server_args.log_interval == 0:
                self.log_stats(batch.forward_mode, num_reqs, new_tokens)
        finished, self._finished = self._finished, []
        return finished

    def _has_work(self) -> bool:
        """Whether a batch can run now (without waiting for the encoder)."""
        return bool(self.waiting_queue or self.chunked_req or not self.running_batch.is_empty()) or (
            self.last_batch is not None and not self.last_batch.forward_mode.is_decode()
        )

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.last_batch is not None and not self.last_batch.forward_mode.is_decode():
            # the last prefill's requests (but the one still being chunked) start decoding
            joined = [r for r in self.last_batch.reqs if not r.finished and r is not self.chunked_req]
            self.running_batch.reqs = self.running_batch.reqs + joined
        self._release_aborted()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running_batch.is_empty():
            return None
        self.update_running_batch()
        return self.running_batch if not self.running_batch.is_empty() else None

    def _release_aborted(self) -> None:
        if self.chunked_req is not None and self.chunked_req.to_abort is not None:
            self.tree_cache.cache_finished_req(self.chunked_req)
            self._finish(self.chunked_req, FinishReason("abort", message=self.chunked_req.to_abort))
            self.chunked_req = None
        aborted = [r for r in self.running_batch.reqs if r.to_abort is not None]
        for req in aborted:
            self.tree_cache.cache_finished_req(req)
            self._finish(req, FinishReason("abort", message=req.to_abort))
        if aborted:
            self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.finished]

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = len(self.running_batch.reqs) + (self.chunked_req is not None)
        if running >= self.max_running_requests and self.chunked_req is None:
            return None
        prefixes_matched = self.policy.calc_priority(self.waiting_queue)
        mixed_decode_tokens = len(self.running_batch.reqs) if self.enable_mixed_chunk else 0
        adder = PrefillAdder(
            self.tree_cache, self.running_batch, self.new_token_ratio, self.max_prefill_tokens,
            self.chunked_prefill_size, mixed_decode_tokens,
        )
        if self.chunked_req is not None:
            self.chunked_req.extend_len = self.chunked_req.seq_len - self.chunked_req.kv_len
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        in_batch = RadixCache(None, None)  # ids of requests picked this round, for in-batch sharing
        for req in list(self.waiting_queue):
            if running + len(adder.can_run_list) >= self.max_running_requests or adder.new_chunked_req or self.chunked_req:
                break
            if not prefixes_matched:
                req.match_prefix(self.tree_cache)
            if req.mm_items and not self.encoding.add(req, len(req.prefix_indices)):
                self.waiting_queue.remove(req)  # its cached prefix shrank: it needs embeddings after all
                continue
            if not self.tree_cache.disable and len(req.prefix_indices) <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                uncached = req.fill_ids[len(req.prefix_indices) :]
                if len(in_batch.match_prefix(uncached).indices) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    continue  # it will hit the cache next round
            result = adder.add_one_req(req)
            if result == AddReqResult.NO_TOKEN and self.server_args.enable_priority_scheduling:
                preempted = adder.preempt_to_schedule(
                    req, self.running_batch, self.server_args.priority_scheduling_preemption_threshold
                )
                if preempted:
                    self.metrics.num_preemptions += len(preempted)
                    self.waiting_queue.extend(preempted)
                    result = adder.add_one_req(req)
            if req in adder.can_run_list and not self.tree_cache.disable:
                uncached = req.fill_ids[len(req.prefix_indices) :]
                in_batch.insert(uncached, torch.zeros(len(uncached), dtype=torch.int64))
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
        batch = self._new_batch(adder.can_run_list, ForwardMode.EXTEND)
        if self.enable_mixed_chunk and not self.running_batch.is_empty():
            batch.mix_with_running(self.running_batch)
            self.running_batch = self._new_batch([])
        return batch

    def update_running_batch(self) -> None:
        """Before a decode: retract requests if the KV cache cannot hold one more token each, else
        let `new_token_ratio` decay back towards its minimum."""
        batch = self.running_batch
        if not batch.check_decode_mem():
            retracted = batch.retract_decode(RETRACT_DECODE_STEPS)
            self.metrics.num_retractions += len(retracted)
            self.waiting_queue = retracted + self.waiting_queue
            total_max_new = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
            decoded = sum(len(r.output_ids) for r in batch.reqs)
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(batch.reqs)) / max(total_max_new, 1))
            logger.warning(
                "KV cache full: retracted %d request(s); new_token_ratio is now %.2f",
                len(retracted), self.new_token_ratio,
            )
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)

    def run_batch(self, batch: ScheduleBatch, forward_batch) -> BatchResult:
        hidden = self.runner.forward(forward_batch)
        logits = self.runner.compute_logits(hidden[forward_batch.last_token_indices()])
        sample = self.runner.sample(logits, batch.reqs)
        return BatchResult(sample.next_token_ids, sample)

    # ---- results -----------------------------------------------------------------------------------

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if batch.forward_mode == ForwardMode.MIXED:
            self.metrics.num_mixed_batches += 1
        else:
            self.metrics.num_prefill_batches += 1
        for i, req in enumerate(batch.reqs):
            if req.mm_embeds and req.kv_len >= len(req.origin_input_ids):
                self.encoding.release(req)  # the prompt's KV is computed: its embeddings are not needed
            if req.kv_len < req.seq_len:  # a chunk that is not the last: nothing to sample yet
                self.tree_cache.cache_unfinished_req(req)
                continue
            self._append_token(req, result, i)
            if req.finished:
                self.tree_cache.cache_finished_req(req)
            elif i < batch.num_prefill_reqs:
                self.tree_cache.cache_unfinished_req(req)  # share the prompt while it decodes

    def process_batch_result_decode(self, batch: ScheduleBatch, result: BatchResult) -> None:
        self.metrics.num_decode_batches += 1
        for i, req in enumerate(batch.reqs):
            self._append_token(req, result, i)
            if req.finished:
                self.tree_cache.cache_finished_req(req)
        if any(r.finished for r in batch.reqs):
            batch.reqs = [r for r in batch.reqs if not r.finished]

    def _append_token(self, req: Req, result: BatchResult, i: int) -> None:
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        self.metrics.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.sampling_params.logprobs:
            req.output_logprobs.append(result.sample.logprobs[i])
            if req.sampling_params.top_logprobs:
                req.output_top_logprobs.append(result.sample.top_logprobs[i])
        reason = self._check_finished(req, token)
        if reason is not None:
            self._finish(req, reason)

    def _check_finished(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return FinishReason("stop", matched=token)
        if params.stop:
            new_text = req.detokenizer.update(req.output_ids)
            hit = None
            if new_text and len(req.output_ids) >= params.min_new_tokens:
                hit = find_stop(req.detokenizer.text, params.stop, len(new_text))
            if hit is not None:
                req.output_text = req.detokenizer.text[: hit[0]]
                return FinishReason("stop", matched=hit[1])
        if len(req.output_ids) >= params.max_new_tokens:
            return FinishReason("length")
        return None

    # ---- health ------------------------------------------------------------------------------------

    def check_memory(self) -> None:
        """Idle self-check: every KV slot is free or held by the tree, no lock is held and every
        request row is free. A failure is a leak, i.e. a bug."""
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        problems = []
        if free != self.max_total_tokens:
            problems.append(f"{self.max_total_tokens - free} KV slots leaked")
        if self.tree_cache.protected_size() != 0 or any(self.tree_cache.lock_counts()):
            problems.append(f"{self.tree_cache.protected_size()} tokens still locked in the prefix cache")
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append(f"{self.req_to_token_pool.size - self.req_to_token_pool.available_size()} request rows leaked")
        if problems:
            raise RuntimeError("scheduler idle self-check failed: " + "; ".join(problems))

    def log_stats(self, mode: ForwardMode, num_reqs: int, new_tokens: int) -> None:
        used = self.max_total_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()
        embeddings = self.encoding.cache
        logger.info(
            "%s batch: %d reqs, %d new tokens, KV usage %.2f, cache hit rate %.2f, running %d, queued %d, "
            "encoding %d, embedding cache hit rate %.2f (%.1f MiB)",
            mode.name.lower(), num_reqs, new_tokens, used / self.max_total_tokens, self.metrics.cache_hit_rate,
            len(self.running_batch.reqs), len(self.waiting_queue), len(self.encoding), embeddings.hit_rate,
            embeddings.usage_bytes / 2**20,
        )
