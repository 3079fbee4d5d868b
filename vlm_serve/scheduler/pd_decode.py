"""The decode side of PD, as SGLang's disaggregation/decode.py lays it out: `prealloc_queue` →
`transfer_queue` → `running_batch`.

A request that came with bootstrap info gets a KV receiver for its room and waits in the prealloc queue
until its prefill rank is found and the KV pool can take it: its request row and the slots of its whole
prompt are then allocated under the scheduler's own admission rule (what running requests are expected
to still need is kept free), and the receiver tells the prefill side where the KV goes. In the transfer
queue it waits for the KV and the metadata record; then it joins the running batch with the first token
the prefill side sampled, without a prefill forward. The decode server never encodes media: a request's
items have their grids and hashes (for its ids and positions) but no pixels.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from vlm_serve.disaggregation.transfer import KVPoll, TransferBackend
from vlm_serve.scheduler.pd_common import Disaggregation, PDScheduler, PrefillRecord, lora_identity
from vlm_serve.scheduler.schedule_batch import FinishReason, Req
from vlm_serve.scheduler.schedule_policy import PrefillAdder

if TYPE_CHECKING:
    from vlm_serve.messages.backend import BootstrapInfo


# A write the prefill side had already started may still land in the slots of a transfer that ended
# without success (aborted here, or failed there): they go back to the pool only after this long.
QUARANTINE_SECONDS = 5.0


class DecodeDisaggregation(Disaggregation):
    """The decode server's PD queues, driven by its scheduler."""

    def __init__(self, scheduler: PDScheduler, backend: TransferBackend, records: torch.Tensor) -> None:
        super().__init__(scheduler, backend, records)
        self.prealloc_queue: list[Req] = []  # waiting for its prefill rank and for KV slots
        self.transfer_queue: list[Req] = []  # slots allocated, KV on its way
        self.quarantine: deque[tuple[float, torch.Tensor]] = deque()  # (when free, slots) of ended transfers

    def __len__(self) -> int:
        return len(self.prealloc_queue) + len(self.transfer_queue) + len(self.quarantine)

    @property
    def held_tokens(self) -> int:
        """KV slots held back from the pool for a while (not leaked: see QUARANTINE_SECONDS)."""
        page = self.scheduler.allocator.page_size
        return sum(-(-len(slots) // page) * page for _, slots in self.quarantine)  # (whole pages)

    def queue_sizes(self) -> dict[str, int]:
        return {"prealloc": len(self.prealloc_queue), "transfer": len(self.transfer_queue)}

    def add(self, req: Req) -> None:
        req.transfer = self.backend.receiver(req.bootstrap)
        self.prealloc_queue.append(req)
        self.enter(req)

    def refuse(self, bootstrap: BootstrapInfo, why: str) -> None:
        """This side refused a request: its prefill side learns it at once rather than waiting for it."""
        self.backend.receiver(bootstrap).abort()

    def process(self) -> None:
        """Moves on the requests whose transfers moved on (every TP rank, every iteration)."""
        now = time.monotonic()
        while self.quarantine and self.quarantine[0][0] <= now:
            self.scheduler.allocator.free(self.quarantine.popleft()[1])
        if self.prealloc_queue:
            adder, waiting, full = None, [], False
            for req, state in zip(self.prealloc_queue, self.polls(self.prealloc_queue)):
                if state == KVPoll.FAILED:
                    self.fail(req, "bootstrap")
                elif state == KVPoll.BOOTSTRAPPING or full:  # (in order: none overtakes one waiting for KV)
                    waiting.append(req)
                else:
                    adder = adder or self._budget()
                    if self._preallocate(req, adder):
                        self.transfer_queue.append(req)
                        self.enter(req)
                    else:
                        waiting.append(req)
                        full = True
            self.prealloc_queue = waiting
        if self.transfer_queue:
            transferring = []
            for req, state in zip(self.transfer_queue, self.polls(self.transfer_queue)):
                if state == KVPoll.SUCCESS:
                    self._start_decoding(req)
                elif state == KVPoll.FAILED:
                    self.release(req)
                    self.fail(req, "transfer")
                else:
                    transferring.append(req)
            self.transfer_queue = transferring

    def _budget(self) -> PrefillAdder:
        """The scheduler's own KV budget, with the requests whose KV is arriving counted as running."""
        s = self.scheduler
        running = s.new_batch(s.running_batch.reqs + self.transfer_queue)
        return PrefillAdder(s.tree_cache, running, s.new_token_ratio.value, s.max_total_tokens, None)

    def _preallocate(self, req: Req, adder: PrefillAdder) -> bool:
        """The request row and the prompt's KV slots, if the budget and the pools hold them."""
        s, prompt_len = self.scheduler, len(req.origin_input_ids)
        running = len(s.running_batch.reqs) + len(self.transfer_queue)
        if running >= s.max_running_requests or not adder.add_prompt_kv(req):
            return False
        short = prompt_len - s.allocator.available_size()
        if short > 0:
            s.tree_cache.evict(short)
        rows, slots = s.req_to_token_pool.alloc(1), s.allocator.alloc(prompt_len)
        if rows is None or slots is None:  # (the budget counts evictable KV that a lock may keep)
            if rows is not None:
                s.req_to_token_pool.free(rows)
            if slots is not None:
                s.allocator.free(slots)
            return False
        req.req_pool_idx, req.last_node = rows[0], s.tree_cache.root
        s.req_to_token_pool.write(req.req_pool_idx, 0, slots)
        req.transfer.init(slots.tolist(), req.req_pool_idx)
        self.transfer_started(req)
        return True

    def _start_decoding(self, req: Req) -> None:
        """The KV arrived: the request takes the first token from the record and joins the running batch."""
        s = self.scheduler
        record = PrefillRecord.from_bytes(req.transfer.meta)
        media_tokens = [it.num_tokens(s.merge_size) for it in req.mm_items]
        message = None
        if (record.prompt_len, record.media_tokens) != (len(req.origin_input_ids), media_tokens):
            message = (
                f"the prefill server computed a prompt of {record.prompt_len} tokens with media of "
                f"{record.media_tokens} tokens; this one has {len(req.origin_input_ids)} and {media_tokens}"
            )
        elif record.lora != (lora := lora_identity(s.runner, req)):
            message = (
                f"the prefill server computed the KV through LoRA adapter {record.lora or 'none (the base)'}, "
                f"this decode server runs the request through {lora or 'none (the base)'}: both must load the "
                "same adapters under the same names"
            )
        if message is not None:
            self.release(req)
            self.fail(req, "mismatch", FinishReason.error(500, "disaggregation_mismatch", message))
            return
        self.transfer_succeeded(req)
        s.metrics.observe_media(req.mm_items)  # (probed, not decoded: the prefill server encoded them)
        req.kv_len, req.cached_tokens, req.mrope_delta = record.prompt_len, record.cached_tokens, record.mrope_delta
        req.transfer = None  # (done: the request is an ordinary running one from here on)
        if req.grammar is not None:
            req.grammar.accept_token(record.first_token)
        s.append_token(req, record.first_token, record.logprob, record.top_logprobs)
        if req.finished:
            s.tree_cache.cache_finished_req(req)
        else:
            s.running_batch.reqs.append(req)

    def release(self, req: Req) -> None:
        """Frees the row of a request whose KV never arrived, and its slots after the quarantine (not into
        the prefix cache: they hold no KV)."""
        s = self.scheduler
        slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)].long()
        self.quarantine.append((time.monotonic() + QUARANTINE_SECONDS, slots.clone()))
        s.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv()

    def requeue(self, retracted: list[Req]) -> list[Req]:
        """Of the requests retracted here, those that can be prefilled again on this server: text only,
        since it has no vision tower. The others end (503): the prefill side's admission rule keeps
        this rare."""
        for req in retracted:
            if req.mm_items:
                message = "the decode server ran out of KV memory and cannot recompute this request's images"
                self.scheduler.finish(req, FinishReason.error(503, "kv_cache_full", message))
        return [r for r in retracted if not r.mm_items]

    def remove(self, req: Req) -> bool:
        """Takes an aborted request out of the PD queues (releasing what it holds); False if it is in
        neither."""
        if req in self.prealloc_queue:
            self.prealloc_queue.remove(req)
            return True
        if req in self.transfer_queue:
            self.transfer_queue.remove(req)
            self.release(req)
            return True
        return False
