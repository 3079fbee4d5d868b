"""The scheduler loop: admit waiting requests into a prefill, otherwise decode the running batch."""

from __future__ import annotations

import logging

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns `waiting_queue` and `running_batch`; `step()` runs one forward and returns finished requests."""

    def __init__(self, runner: ModelRunner, eos_token_ids: list[int]) -> None:
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], runner.req_to_token_pool, runner.allocator)

    def add_request(self, req: Req) -> None:
        limit = self.runner.context_len
        if len(req.origin_input_ids) + req.sampling_params.max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(req.origin_input_ids)} tokens plus max_new_tokens "
                f"{req.sampling_params.max_new_tokens} exceeds the context length {limit}"
            )
        req.init_positions(self.runner.model_config.vision.spatial_merge_size)
        self.waiting_queue.append(req)

    def step(self) -> list[Req]:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            finished = self.run_batch(batch, batch.prepare_for_extend)
            self.running_batch.reqs.extend(r for r in batch.reqs if not r.finished)
            return finished
        if not self.running_batch.reqs:
            return []
        finished = self.run_batch(self.running_batch, self.running_batch.prepare_for_decode)
        self.running_batch.reqs = [r for r in self.running_batch.reqs if not r.finished]
        return finished

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """First come, first served, while request rows and KV memory (prompt + all output) last."""
        free_rows = self.runner.req_to_token_pool.available_size()
        budget = self.runner.allocator.available_size() - sum(
            r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.running_batch.reqs
        )
        page = self.runner.allocator.page_size
        admitted = []
        for req in self.waiting_queue:
            need = len(req.origin_input_ids) + req.sampling_params.max_new_tokens + page
            if len(admitted) == free_rows or need > budget:
                break
            admitted.append(req)
            budget -= need
        if not admitted:
            if self.waiting_queue and not self.running_batch.reqs:
                raise RuntimeError("the first waiting request does not fit in an empty KV cache")
            return None
        self.waiting_queue = self.waiting_queue[len(admitted) :]
        needs_vision = [r for r in admitted if r.needs_vision]
        if needs_vision:
            self.runner.encode_vision(needs_vision)
        return ScheduleBatch(admitted, self.runner.req_to_token_pool, self.runner.allocator)

    def run_batch(self, batch: ScheduleBatch, prepare) -> list[Req]:
        forward_batch: ForwardBatch = prepare()
        hidden = self.runner.forward(forward_batch)
        logits = self.runner.compute_logits(hidden[forward_batch.last_token_indices()])
        next_ids = self.runner.sample(logits, batch.reqs)
        finished = []
        for req, token in zip(batch.reqs, next_ids):
            self.process_output(req, token)
            if req.finished:
                batch.release(req)
                finished.append(req)
        return finished

    def process_output(self, req: Req, token: int) -> None:
        params = req.sampling_params
        req.output_ids.append(token)
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            req.finished_reason = "stop"
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finished_reason = "length"
