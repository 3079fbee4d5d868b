"""The storage backend of the hierarchical cache a server's settings name (apart from the interface, which
the backends implement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlm_serve.kv_cache.hicache_mooncake import HiCacheMooncake
from vlm_serve.kv_cache.hicache_storage import HiCacheFile, HiCacheStorage

if TYPE_CHECKING:
    from vlm_serve.config import HiCacheSettings


def create_storage_backend(args: HiCacheSettings) -> HiCacheStorage:
    """The backend `--hicache-storage-backend` names, set up as its settings say."""
    if args.hicache_storage_backend == "file":
        return HiCacheFile(args.hicache_storage_dir, int(args.hicache_storage_size * 1e9))
    return HiCacheMooncake.from_extra_config(args.hicache_storage_backend_extra_config)
