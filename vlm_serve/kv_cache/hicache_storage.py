"""The storage tier of the KV cache (HiCache's L3): KV pages by content key, kept across restarts and shared
by replicas, in a directory (`file`) or in Mooncake's distributed store (`mooncake`).

A page's key is a chain: the digest of the previous page's key and this page's token ids, so it names the
whole prefix up to the page's end. Image and video tokens are their pad values, which carry 62 bits of the
item's content hash (processing settings included), so the same text with another picture has other keys.
The chain starts from a namespace digest of everything else the KV depends on: the checkpoint's weights,
the KV's dtype and layout, the tensor-parallel rank whose heads the page holds.

Each stored value is framed with a magic, its length and a digest of its bytes: a truncated or corrupted
page is detected when read, dropped, and computed again.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path

MAGIC = b"VLMKV01\n"
HEADER = struct.Struct("<8sQ32s")  # magic, payload length, blake2b-256 of the payload
STORAGE_BACKENDS = ("file", "mooncake")


def namespace_key(*identity: object) -> str:
    """The root of every key chain: a digest of what the KV depends on besides the tokens."""
    return hashlib.blake2b(repr(identity).encode(), digest_size=32).hexdigest()


def page_keys(parent_key: str, token_ids: list[int], page_size: int) -> list[str]:
    """The keys of the pages of `token_ids` (whole pages) following a page keyed `parent_key`."""
    keys = []
    for start in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        h = hashlib.blake2b(parent_key.encode(), digest_size=32)
        h.update(struct.pack(f"<{page_size}q", *token_ids[start : start + page_size]))
        parent_key = h.hexdigest()
        keys.append(parent_key)
    return keys


def frame(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, len(payload), hashlib.blake2b(payload, digest_size=32).digest()) + payload


def unframe(blob: bytes | None) -> bytes | None:
    """The payload of a framed value; None if it is missing, truncated or corrupted."""
    if blob is None or len(blob) < HEADER.size:
        return None
    magic, length, digest = HEADER.unpack_from(blob)
    payload = blob[HEADER.size :]
    if magic != MAGIC or length != len(payload) or hashlib.blake2b(payload, digest_size=32).digest() != digest:
        return None
    return payload


class HiCacheStorage(ABC):
    """A store of framed KV pages by key. Methods are called from the storage threads."""

    corrupt = 0  # values found truncated or corrupted, and dropped

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The page's payload, or None if the store does not have it (or had it corrupted: then dropped)."""

    @abstractmethod
    def set(self, key: str, payload: bytes) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def usage_bytes(self) -> int | None:
        """Bytes the store holds, where this server can know it."""
        return None

    def capacity_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class HiCacheFile(HiCacheStorage):
    """Pages as files in a directory (local, or shared by replicas), at most `max_bytes` of them: the least
    recently used files go first. Files are written whole under a temporary name, then renamed, so a
    reader never sees a partial one (unless the disk itself damages it: the frame catches that).

    Each process keeps its own count of the directory's size, from the files it found at start, wrote and
    read; files another replica writes meanwhile are read but counted by that replica."""

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path).expanduser()
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # (the read and write threads share the index)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recently used first
        files = [(f.stat().st_mtime_ns, f) for f in self.path.glob("*.kv")]
        for _, f in sorted(files):
            self._index[f.stem] = f.stat().st_size
        self._usage = sum(self._index.values())
        self._evict_over(self.max_bytes)

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.kv"

    def get(self, key: str) -> bytes | None:
        try:
            blob = self._file(key).read_bytes()
        except FileNotFoundError:
            return None
        payload = unframe(blob)
        with self._lock:
            if payload is None:
                self.corrupt += 1
                self._remove(key)
                return None
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = len(blob)
                self._usage += len(blob)
        try:
            os.utime(self._file(key))  # (a restarted server finds the most recently used last)
        except FileNotFoundError:
            pass
        return payload

    def set(self, key: str, payload: bytes) -> None:
        blob = frame(payload)
        if len(blob) > self.max_bytes:
            return
        with self._lock:
            self._evict_over(self.max_bytes - len(blob))
        tmp = self.path / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, self._file(key))
        with self._lock:
            self._usage += len(blob) - self._index.pop(key, 0)
            self._index[key] = len(blob)

    def exists(self, key: str) -> bool:
        return self._file(key).is_file()

    def _remove(self, key: str) -> None:
        self._usage -= self._index.pop(key, 0)
        try:
            self._file(key).unlink()
        except FileNotFoundError:
            pass

    def _evict_over(self, limit: int) -> None:
        while self._usage > limit and self._index:
            self._remove(next(iter(self._index)))

    def usage_bytes(self) -> int:
        return self._usage

    def capacity_bytes(self) -> int:
        return self.max_bytes
