"""The prefill side of PD, as SGLang's disaggregation/prefill.py lays it out: `bootstrap_queue` → the usual way
(encoding stage, `waiting_queue`, chunked prefill) → `inflight_queue`.

A request that came with bootstrap info gets a KV sender for its room and waits in the bootstrap queue
until its decode server has said where its KV goes. After each of its chunks runs, the KV of the whole
pages that chunk completed goes out; after the last one, the rest with the metadata record (the first
token, sampled here). The request then waits in the inflight queue, holding its KV, until the transfer
has succeeded: only then does its KV go into the prefix cache, and the request ends here (with its one
token: the router answers its client from the decode side).

The KV of a batch's positions goes out only once the scheduler has processed the batch's result
(`send_computed`): with an EAGLE-3 draft, its KV (the pool's last layer) of those positions is written
then, and goes with the target's, so the decode server's draft reads the whole prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlm_serve.disaggregation.transfer import KVPoll, TransferBackend
from vlm_serve.scheduler.pd_common import Disaggregation, PDScheduler, PrefillRecord, lora_identity
from vlm_serve.scheduler.schedule_batch import FinishReason, Req

if TYPE_CHECKING:
    import torch

    from vlm_serve.llm.layers.sampler import SampleOutput
    from vlm_serve.messages.backend import BootstrapInfo


class PrefillDisaggregation(Disaggregation):
    """The prefill server's PD queues, driven by its scheduler."""

    def __init__(self, scheduler: PDScheduler, backend: TransferBackend, records: torch.Tensor) -> None:
        super().__init__(scheduler, backend, records)
        self.bootstrap_queue: list[Req] = []  # waiting for the decode side's destination
        self.inflight_queue: list[Req] = []  # prompt done, KV on its way
        self.computed: list[tuple[Req, int, bytes | None]] = []  # KV computed, to send: (req, end, record)

    def __len__(self) -> int:
        return len(self.bootstrap_queue) + len(self.inflight_queue)

    def queue_sizes(self) -> dict[str, int]:
        return {"bootstrap": len(self.bootstrap_queue), "inflight": len(self.inflight_queue)}

    def add(self, req: Req) -> None:
        req.transfer = self.backend.sender(req.bootstrap)
        self.bootstrap_queue.append(req)
        self.enter(req)

    def refuse(self, bootstrap: BootstrapInfo, why: str) -> None:
        """This side refused a request: its decode side learns it at once rather than waiting for it."""
        self.backend.sender(bootstrap).abort()

    def process(self) -> None:
        """Moves on the requests whose transfers moved on (every TP rank, every iteration)."""
        s = self.scheduler
        if self.bootstrap_queue:
            waiting = []
            for req, state in zip(self.bootstrap_queue, self.polls(self.bootstrap_queue)):
                if state == KVPoll.FAILED:
                    self.fail(req, "bootstrap")
                elif state == KVPoll.BOOTSTRAPPING:
                    waiting.append(req)
                elif req.transfer.num_slots != len(req.origin_input_ids):
                    message = (
                        f"the decode server sees a prompt of {req.transfer.num_slots} tokens, this one of "
                        f"{len(req.origin_input_ids)}: they do not serve the same model or settings"
                    )
                    self.fail(req, "mismatch", FinishReason.error(500, "disaggregation_mismatch", message))
                else:
                    s.to_waiting_queue(req)
            self.bootstrap_queue = waiting
        if self.inflight_queue:
            inflight = []
            for req, state in zip(self.inflight_queue, self.polls(self.inflight_queue)):
                if state == KVPoll.SUCCESS:
                    self.transfer_succeeded(req)
                    req.transfer = None
                    s.tree_cache.cache_finished_req(req)
                    s.finish(req, FinishReason("length"))
                elif state == KVPoll.FAILED:
                    s.tree_cache.cache_finished_req(req)  # (its KV is good: it stays in the prefix cache)
                    self.fail(req, "transfer")
                else:
                    inflight.append(req)
            self.inflight_queue = inflight

    def chunk_done(self, req: Req, computed: int) -> None:
        """A forward computed the request's prompt up to position `computed` (not its end): the KV of the
        whole pages before it is to go out."""
        self.computed.append((req, computed - computed % self.scheduler.allocator.page_size, None))

    def prompt_done(self, req: Req, token: int, out: SampleOutput, row: int) -> None:
        """The last chunk ran and sampled the first token: the rest of the KV is to go out with the
        record, and the request waits for the transfer in the inflight queue."""
        s, params = self.scheduler, req.sampling_params
        req.output_ids.append(token)
        record = PrefillRecord(
            prompt_len=len(req.origin_input_ids),
            first_token=token,
            logprob=out.logprobs[row] if params.logprobs else None,
            top_logprobs=out.top_logprobs[row] if params.logprobs and params.top_logprobs else None,
            cached_tokens=req.cached_tokens,
            media_tokens=[it.num_tokens(s.merge_size) for it in req.mm_items],
            mrope_delta=req.mrope_delta,
            lora=lora_identity(s.runner, req),
        )
        if params.logprobs:  # (the token's answer here, which the router drops, still has its log-probs)
            req.output_logprobs.append(record.logprob)
            if params.top_logprobs:
                req.output_top_logprobs.append(record.top_logprobs)
        self.computed.append((req, len(req.origin_input_ids), record.to_bytes()))
        self.inflight_queue.append(req)
        self.enter(req)

    def send_computed(self) -> None:
        """Sends the KV that `chunk_done` and `prompt_done` said is computed (and the records)."""
        for req, end, meta in self.computed:
            if end > req.kv_sent or meta is not None:
                self.transfer_started(req)
                row = self.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx]
                req.transfer.send(row[req.kv_sent : end].tolist(), req.kv_sent, meta)
                req.kv_sent = end
        self.computed.clear()

    def remove(self, req: Req) -> bool:
        """Takes an aborted request out of the PD queues (releasing what it holds); False if it is in
        neither."""
        if req in self.bootstrap_queue:
            self.bootstrap_queue.remove(req)
            return True
        if req in self.inflight_queue:
            self.inflight_queue.remove(req)
            self.scheduler.tree_cache.cache_finished_req(req)
            return True
        return False
