"""The storage tier's stage: a request whose prompt goes on past what the tree holds has the rest of its
pages read from storage into the host tier, from where its prefill loads them back.

When it goes on to the encoding stage or `waiting_queue` is the prefetch policy
(`--hicache-storage-prefetch-policy`):
- `best_effort`: at once; the pages read by the time it is scheduled are used, the read stops there;
- `wait_complete`: once every page storage has is read (then its pictures inside them need no vision tower),
  or after `STALL_SECONDS` of a storage that stalls;
- `timeout`: the same, but after `--hicache-storage-prefetch-timeout` seconds at most, with what was read.

Under TP every rank reads its own heads' pages: the ranks take the same number of pages (the fewest any
rank read) at the same step, so their trees stay the same.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from vlm_serve.kv_cache.cache_controller import PrefetchOperation
from vlm_serve.kv_cache.hiradix_cache import HiRadixCache
from vlm_serve.scheduler.schedule_batch import Req

# a read still going after this long is a storage that stalls: even wait_complete goes on without the rest
STALL_SECONDS = 30.0


class StoragePrefetch:
    """Prefetches from the storage tier, by request; holds the requests whose policy waits for them."""

    def __init__(self, tree: HiRadixCache, policy: str, timeout: float, tp_group: dist.ProcessGroup | None) -> None:
        self.tree = tree
        self.policy = policy
        self.timeout = timeout
        self.tp_group = tp_group
        self.ops: dict[str, tuple[Req, PrefetchOperation, int]] = {}  # rid -> request, its read, where it starts
        self.held: list[Req] = []  # waiting for their reads (wait_complete, timeout)

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, req: Req) -> bool:
        return req in self.held

    def start(self, req: Req) -> bool:
        """Starts reading `req`'s pages beyond the tree; True if it waits for them here."""
        if req.rid in self.ops or req.prompt_logprobs_pending:  # (a prompt whose log-probs it asks is computed)
            return False
        started = self.tree.prefetch_from_storage(req.cache_key(req.origin_input_ids[:-1]))
        if started is None:
            return False
        self.ops[req.rid] = (req, *started)
        if self.policy == "best_effort":
            return False
        self.held.append(req)
        return True

    def poll(self) -> list[Req]:
        """The held requests whose reads are over (or timed out), their pages taken into the host tier."""
        if not self.held:
            return []
        now = time.monotonic()
        limit = self.timeout if self.policy == "timeout" else STALL_SECONDS
        over = self._agree([int(self.ops[r.rid][1].done or now - self.ops[r.rid][1].start > limit) for r in self.held])
        ready = [r for r, x in zip(self.held, over) if x]
        for req in ready:
            self.held.remove(req)
            self.take(req)
        return ready

    def take(self, req: Req) -> bool:
        """Takes what `req`'s read has so far into the host tier and ends it (before `req` is matched).
        True if the tree took pages."""
        entry = self.ops.pop(req.rid, None)
        if entry is None:
            return False
        _, op, start = entry
        op.cancelled = True
        (num_pages,) = self._agree([len(op.pages)])
        return (
            num_pages > 0 and self.tree.take_prefetched(req.cache_key(req.origin_input_ids), start, op, num_pages) > 0
        )

    def forget(self, req: Req) -> None:
        """`req` ended: its read is abandoned."""
        entry = self.ops.pop(req.rid, None)
        if entry is not None:
            entry[1].cancelled = True
        if req in self.held:
            self.held.remove(req)

    def _agree(self, values: list[int]) -> list[int]:
        """The smallest of each value over the TP ranks."""
        if self.tp_group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp_group)
        return t.tolist()
