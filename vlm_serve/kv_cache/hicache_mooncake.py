"""The storage tier in Mooncake's distributed store (`--hicache-storage-backend mooncake`): a
`mooncake_master` places each page in the memory segment one of its clients mounted, every server being
a client, so the servers of a deployment share their pages (a page lives as long as the client holding it).

`--hicache-storage-backend-extra-config` (JSON) sets the client up: `master_server_address` (HOST:PORT of
the master's RPC, required), `metadata_server` (the master's HTTP metadata URL, or `P2PHANDSHAKE`, the
default), `global_segment_size` (bytes this server lends the store, default 4 GiB), `local_buffer_size`
(bytes, at least a page; default 64 MiB), `protocol` (`tcp` or `rdma`), `device_name` (RDMA devices) and
`local_hostname` (the address other clients reach this one at; default 127.0.0.1).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from vlm_serve.kv_cache.hicache_storage import HiCacheStorage, frame, unframe

INSTALL = 'pip install -e ".[pd]"'


@dataclass(frozen=True)
class MooncakeStoreConfig:
    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 64 << 20
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"

    @classmethod
    def from_json(cls, text: str | None) -> MooncakeStoreConfig:
        try:
            given = json.loads(text or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"hicache_storage_backend_extra_config: unknown keys {unknown} (known: {sorted(known)})")
        if "master_server_address" not in given:
            raise ValueError(
                "the mooncake storage backend needs the master's address: "
                '--hicache-storage-backend-extra-config \'{"master_server_address": "HOST:PORT"}\''
            )
        return cls(**given)


class HiCacheMooncake(HiCacheStorage):
    """Pages in Mooncake's distributed store, through this server's client of it."""

    def __init__(self, config: MooncakeStoreConfig) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # (read when the library loads)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "3")  # (else an absent master takes 90 s to fail)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(f"the mooncake storage backend needs Mooncake's store ({exc}): {INSTALL}") from exc
        self.config = config
        self.store = MooncakeDistributedStore()
        status = self.store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        if status != 0:
            raise RuntimeError(
                f"Mooncake's store client did not start (status {status}): is a mooncake_master serving at "
                f"{config.master_server_address}?"
            )

    @classmethod
    def from_extra_config(cls, text: str | None) -> HiCacheMooncake:
        return cls(MooncakeStoreConfig.from_json(text))

    def get(self, key: str) -> bytes | None:
        blob = self.store.get(key)
        if not blob:  # (a key it does not have reads as empty)
            return None
        payload = unframe(blob)
        if payload is None:
            self.corrupt += 1
            self.store.remove(key, True)
        return payload

    def set(self, key: str, payload: bytes) -> None:
        self.store.put(key, frame(payload))

    def exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def capacity_bytes(self) -> int:
        return self.config.global_segment_size

    def close(self) -> None:
        self.store.close()
