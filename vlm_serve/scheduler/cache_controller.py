"""HiCacheController: the copies between the device KV pool and the host tier, in launch order with the
forwards.

Every copy runs where the forwards run (the forward thread under overlap, else inline), after every forward
launched before it and before every forward launched after it. So the tree may hand a device slot that is
being written back to a new request at once (its next writer is a later forward), load a prefix back right
before the prefill that reads it without waiting for anything, and never block the scheduler loop on a copy.

A write-through backup is recorded when its prefix enters the tree, which happens before the forward that
computes its KV is launched: such backups wait in `pending` until `flush`, which the scheduler calls after
the launch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from vlm_serve.llm.mem_cache.memory_pool import TokenToKVPool
from vlm_serve.llm.mem_cache.memory_pool_host import TokenToKVPoolHost

Submit = Callable[..., "Future[Any] | None"]


def run_inline(fn: Callable[..., Any], *args: Any) -> None:
    """The normal loop's executor: the forwards run inline, so do the copies."""
    fn(*args)


@dataclass
class TierCounts:
    """What went through one direction of copies (cumulative)."""

    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0  # spent copying, where the copies run


class HiCacheController:
    """Copies KV pages between `device_pool` and `host_pool` through `submit` (which runs a function after
    every forward launched before it)."""

    def __init__(self, device_pool: TokenToKVPool, host_pool: TokenToKVPoolHost, submit: Submit = run_inline):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.submit = submit
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # write-through backups not yet submitted
        self.in_flight: deque[Future[Any]] = deque()
        self.written = TierCounts()  # device -> host
        self.loaded = TierCounts()  # host -> device

    def write(self, host_slots: torch.Tensor, device_slots: torch.Tensor, *, deferred: bool = False) -> None:
        """Copies the KV of `device_slots` into `host_slots`: now (after the forwards launched so far), or
        `deferred` to the next `flush` (its KV is computed by a forward not launched yet)."""
        self.pending.append((host_slots, device_slots))
        if not deferred:
            self.flush()

    def flush(self) -> None:
        """Submits the deferred backups (the forwards computing their KV are launched)."""
        if not self.pending:
            return
        host = torch.cat([h for h, _ in self.pending])
        device = torch.cat([d for _, d in self.pending])
        self.pending = []
        self._track(self.submit(self._copy, self.host_pool.backup_from_device, host, device, self.written))

    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copies the KV of `host_slots` into `device_slots` before any forward launched from now on."""
        self.flush()
        self._track(self.submit(self._copy, self.host_pool.load_to_device, device_slots, host_slots, self.loaded))

    def _copy(self, copy: Callable, a: torch.Tensor, b: torch.Tensor, counts: TierCounts) -> None:
        start = time.perf_counter()
        copy(self.device_pool, a, b)
        counts.seconds += time.perf_counter() - start
        counts.tokens += a.numel()
        counts.bytes += a.numel() * self.host_pool.size_per_token

    def _track(self, future: Future[Any] | None) -> None:
        if future is not None:
            self.in_flight.append(future)
        self.check()

    def check(self) -> None:
        """Raises the error of a copy that failed (KV that did not arrive would be served wrong)."""
        while self.in_flight and self.in_flight[0].done():
            self.in_flight.popleft().result()
