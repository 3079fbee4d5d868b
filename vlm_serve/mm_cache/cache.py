"""A byte-budgeted LRU cache keyed by content hash, for processed inputs and vision embeddings."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

V = TypeVar("V")


class MultimodalCache(Generic[V]):
    """LRU map from 128-bit content hash to a value of a caller-stated size, within `budget_bytes`.

    Least recently used unpinned entries are evicted to make room; pinned entries never are. Pins are
    counted (two `pin`s need two `unpin`s). An entry that would not fit even after evicting every
    unpinned entry is not stored, and nothing is evicted for it. A budget of 0 disables the cache:
    nothing is stored and every `get` is a miss. `hits`, `misses`, `inflight_hits`, `evictions` and
    `usage_bytes` are for metrics. Safe to share between threads (the HTTP server preprocesses on
    several); `get_or_compute` computes a missing value once however many threads ask for it at once.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.hits = 0
        self.misses = 0
        self.inflight_hits = 0  # lookups that found their value being computed, and waited for it
        self.evictions = 0
        self.usage_bytes = 0
        self._entries: OrderedDict[int, tuple[V, int]] = OrderedDict()  # (value, nbytes), LRU first
        self._pins: dict[int, int] = {}
        self._flights: dict[int, Future[V]] = {}  # keys being computed by `get_or_compute`
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, key: int) -> V | None:
        """The value stored under `key` (now the most recently used), or None."""
        with self._lock:
            value = self._lookup(key)
            if value is None:
                self.misses += 1
            return value

    def get_or_compute(self, key: int, compute: Callable[[], V], nbytes: Callable[[V], int]) -> tuple[V, bool]:
        """The value under `key`, on a miss made by `compute` and stored (`nbytes` gives its size); and
        whether this call computed it. Single flight: a thread asking for a key that another thread is
        computing waits for that result (an in-flight hit, neither hit nor miss), even one too big to
        store, or raises the same exception (equal hashes mean equal content, which fails alike)."""
        with self._lock:
            value = self._lookup(key)
            if value is not None:
                return value, False
            flight = self._flights.get(key)
            waits = flight is not None
            if waits:
                self.inflight_hits += 1
            else:
                self.misses += 1
                flight = self._flights[key] = Future()
        if waits:
            return flight.result(), False
        try:
            value = compute()
            size = nbytes(value)
        except BaseException as exc:  # the waiters must never wait forever
            with self._lock:
                del self._flights[key]
            flight.set_exception(exc)
            raise
        with self._lock:
            self._put(key, value, size)
            del self._flights[key]  # a thread asking from now on finds the value stored (or computes it)
        flight.set_result(value)
        return value, True

    def _lookup(self, key: int) -> V | None:
        """Under the lock: the stored value (now the most recently used, counted as a hit), or None."""
        if key not in self._entries:
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return self._entries[key][0]

    def put(self, key: int, value: V, nbytes: int) -> bool:
        """Store `value` under `key`, evicting as needed; whether it is stored. A key already present
        keeps its value (equal hashes mean equal content) and becomes the most recently used."""
        with self._lock:
            return self._put(key, value, nbytes)

    def _put(self, key: int, value: V, nbytes: int) -> bool:
        """`put` under the lock."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        pinned_bytes = sum(self._entries[k][1] for k in self._pins)
        if self.budget_bytes == 0 or nbytes > self.budget_bytes - pinned_bytes:
            return False
        victims = (k for k in list(self._entries) if k not in self._pins)
        while self.usage_bytes + nbytes > self.budget_bytes:
            self.usage_bytes -= self._entries.pop(next(victims))[1]
            self.evictions += 1
        self._entries[key] = (value, nbytes)
        self.usage_bytes += nbytes
        return True

    def pin(self, key: int) -> None:
        """Keep the stored entry `key` from eviction until a matching `unpin`."""
        with self._lock:
            if key not in self._entries:
                raise KeyError(f"cannot pin {key:#x}: not in the cache")
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: int) -> None:
        with self._lock:
            count = self._pins.get(key)
            if count is None:
                raise KeyError(f"cannot unpin {key:#x}: not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            for key in [k for k in self._entries if k not in self._pins]:
                self.usage_bytes -= self._entries.pop(key)[1]
