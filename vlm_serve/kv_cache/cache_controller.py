"""HiCacheController: the copies between the device KV pool and the host tier, in launch order with the
forwards.

Every copy runs where the forwards run (the forward thread under overlap, else inline), after every forward
launched before it and before every forward launched after it. So the tree may hand a device slot that is
being written back to a new request at once (its next writer is a later forward), load a prefix back right
before the prefill that reads it without waiting for anything, and never block the scheduler loop on a copy.

A write-through backup is recorded when its prefix enters the tree, which happens before the forward that
computes its KV is launched: such backups wait in `pending` until `flush`, which the scheduler calls after
the launch.

With a storage tier (`StorageIO`), a page backed up to the host is also written to storage: a snapshot of its
host copy is taken in order after the copy, and written by a thread of its own. Prefetches read pages on
another thread; the pages read are put into the host pool, again in order, by `load_pages_to_host`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_serve.kv_cache.hicache_storage import HiCacheStorage
from vlm_serve.kv_cache.memory_pool import TokenToKVPool
from vlm_serve.kv_cache.memory_pool_host import TokenToKVPoolHost

logger = logging.getLogger(__name__)

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


@dataclass(eq=False)
class PrefetchOperation:
    """The pages of one prompt read from storage in order, up to the first one storage does not have."""

    keys: list[str]
    pages: list[torch.Tensor] = field(default_factory=list)  # read so far (appended by the read thread)
    done: bool = False  # every page read, or one missing
    cancelled: bool = False
    start: float = field(default_factory=time.monotonic)


class StorageIO:
    """The storage tier's threads: one reads the pages of prefetches, one writes pages backed up to the host.
    Writes waiting beyond `max_pending_bytes` (storage slower than the backups) are dropped, not queued."""

    def __init__(
        self, backend: HiCacheStorage, page_shape: tuple[int, ...], dtype: torch.dtype, max_pending_bytes: int
    ):
        self.backend = backend
        self.page_shape, self.dtype = page_shape, dtype
        self.page_bytes = torch.Size(page_shape).numel() * dtype.itemsize
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.read = TierCounts()  # storage -> host
        self.written = TierCounts()  # host -> storage
        self.dropped_writes = 0  # pages
        self.failures = 0  # reads and writes that raised (a read that fails is a miss)
        self._reads: queue.SimpleQueue[PrefetchOperation | None] = queue.SimpleQueue()
        self._writes: queue.SimpleQueue[tuple[list[str], torch.Tensor] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._read_loop, name="hicache-read", daemon=True),
            threading.Thread(target=self._write_loop, name="hicache-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def prefetch(self, keys: list[str]) -> PrefetchOperation:
        op = PrefetchOperation(keys)
        self._reads.put(op)
        return op

    def write(self, keys: list[str], pages: torch.Tensor) -> None:
        """Queues `pages` (a snapshot: the host copy may be reused meanwhile) to be stored under `keys`."""
        size = len(keys) * self.page_bytes
        if self.pending_bytes + size > self.max_pending_bytes:
            self.dropped_writes += len(keys)
            return
        self.pending_bytes += size
        self._writes.put((keys, pages))

    def _read_loop(self) -> None:
        while (op := self._reads.get()) is not None:
            start = time.perf_counter()
            for key in op.keys:
                if op.cancelled:
                    break
                page = self._read(key)
                if page is None:
                    break
                op.pages.append(page)
                self.read.tokens += self.page_shape[2]
                self.read.bytes += self.page_bytes
            op.done = True
            self.read.seconds += time.perf_counter() - start

    def _read(self, key: str) -> torch.Tensor | None:
        try:
            payload = self.backend.get(key)
        except Exception:  # noqa: BLE001 - a store that fails to read is a miss: the page is computed again
            self.failures += 1
            logger.warning("hicache storage: reading page %s failed", key, exc_info=True)
            return None
        if payload is None or len(payload) != self.page_bytes:
            return None
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.page_shape)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            keys, pages = item
            start = time.perf_counter()
            for key, page in zip(keys, pages):
                try:
                    if not self.backend.exists(key):
                        self.backend.set(key, page.view(torch.uint8).numpy().tobytes())
                        self.written.tokens += self.page_shape[2]
                        self.written.bytes += self.page_bytes
                except Exception:  # noqa: BLE001 - a page not stored is only a later miss
                    self.failures += 1
                    logger.warning("hicache storage: writing page %s failed", key, exc_info=True)
            self.pending_bytes -= len(keys) * self.page_bytes
            self.written.seconds += time.perf_counter() - start

    def close(self, timeout: float = 5.0) -> None:
        """Ends the threads once the writes queued are done (waiting `timeout` seconds at most for them; a
        read under way is left to end on its own)."""
        self._reads.put(None)
        self._writes.put(None)
        self._threads[1].join(timeout)
        self.backend.close()


class HiCacheController:
    """Copies KV pages between `device_pool` and `host_pool` through `submit` (which runs a function after
    every forward launched before it), and between `host_pool` and `storage` if there is one."""

    def __init__(
        self,
        device_pool: TokenToKVPool,
        host_pool: TokenToKVPoolHost,
        submit: Submit = run_inline,
        storage: StorageIO | None = None,
    ):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.submit = submit
        self.storage = storage
        # backups not yet submitted: host slots, device slots, storage keys of their pages (or None)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, list[str] | None]] = []
        self.in_flight: deque[Future[Any]] = deque()
        self.written = TierCounts()  # device -> host
        self.loaded = TierCounts()  # host -> device

    def write(
        self,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        storage_keys: list[str] | None = None,
        *,
        deferred: bool = False,
    ) -> None:
        """Copies the KV of `device_slots` into `host_slots` (and stores its pages under `storage_keys`):
        now (after the forwards launched so far), or `deferred` to the next `flush` (its KV is computed by a
        forward not launched yet)."""
        self.pending.append((host_slots, device_slots, storage_keys))
        if not deferred:
            self.flush()

    def flush(self) -> None:
        """Submits the deferred backups (the forwards computing their KV are launched)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        self._track(self.submit(self._backup, pending))

    def _backup(self, pending: list[tuple[torch.Tensor, torch.Tensor, list[str] | None]]) -> None:
        host = torch.cat([h for h, _, _ in pending])
        self._copy(self.host_pool.backup_from_device, host, torch.cat([d for _, d, _ in pending]), self.written)
        stored = [(h, keys) for h, _, keys in pending if keys]
        if self.storage is not None and stored:
            pages = self.host_pool.get_pages(torch.cat([h for h, _ in stored]))
            self.storage.write([k for _, keys in stored for k in keys], pages)

    def load_pages_to_host(self, host_slots: torch.Tensor, pages: list[torch.Tensor]) -> None:
        """Puts pages read from storage into `host_slots`, in order with every other copy."""
        self.flush()
        self._track(self.submit(self.host_pool.set_pages, host_slots, torch.stack(pages)))

    def load(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copies the KV of `host_slots` into `device_slots` before any forward launched from now on."""
        self.flush()
        self._track(self.submit(self._copy, self.host_pool.load_to_device, device_slots, host_slots, self.loaded))

    def _copy(self, copy: Callable, a: torch.Tensor, b: torch.Tensor, counts: TierCounts) -> None:
        start = time.perf_counter()
        copy(self.device_pool, a, b)
        counts.seconds += time.perf_counter() - start
        counts.tokens += a.numel()
        counts.bytes += a.numel() * self.host_pool.layout.bytes_per_token

    def _track(self, future: Future[Any] | None) -> None:
        if future is not None:
            self.in_flight.append(future)
        self.check()

    def check(self) -> None:
        """Raises the error of a copy that failed (KV that did not arrive would be served wrong)."""
        while self.in_flight and self.in_flight[0].done():
            self.in_flight.popleft().result()
