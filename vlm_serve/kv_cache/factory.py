"""The prefix cache a server's settings ask for: a plain radix tree, or one over a host-memory tier and,
below that, a storage backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.cache_controller import HiCacheController, StorageIO
from vlm_serve.kv_cache.hicache_mooncake import HiCacheMooncake
from vlm_serve.kv_cache.hicache_storage import HiCacheFile, HiCacheStorage, namespace_key
from vlm_serve.kv_cache.hiradix_cache import HiRadixCache
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from vlm_serve.kv_cache.memory_pool_host import TokenToKVPoolHost
from vlm_serve.kv_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from vlm_serve.config import HiCacheSettings

logger = logging.getLogger(__name__)


def create_storage_backend(settings: HiCacheSettings) -> HiCacheStorage:
    """The backend `--hicache-storage-backend` names, set up as its settings say."""
    if settings.hicache_storage_backend == "file":
        return HiCacheFile(settings.hicache_storage_dir, int(settings.hicache_storage_size * 1e9))
    return HiCacheMooncake.from_extra_config(settings.hicache_storage_backend_extra_config)


def create_tree_cache(
    settings: HiCacheSettings | None,
    disable: bool,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    device_pool: TokenToKVPool,
    submit: Callable[..., Any],
    namespace: Callable[[], str],
    adapter_digest: Callable[[int], str | None] | None,
) -> RadixCache:
    """A HiRadixCache over a host pool (and a storage tier, if `settings` name one) whose copies go through
    `submit`; a plain RadixCache where `settings` is None, one that caches nothing with `disable`. `namespace()` names everything the KV depends on
    besides its tokens (the root of the storage tier's keys); `adapter_digest(load_id)` a loaded LoRA
    adapter's files (None once unloaded), under which its KV is stored."""
    if settings is None or disable:
        return RadixCache(req_to_token_pool, allocator, disable=disable)
    per_token = device_pool.layout.bytes_per_token
    if settings.hicache_size:
        size = int(settings.hicache_size * 1e9) // per_token
    else:
        size = int(settings.hicache_ratio * device_pool.size)
    if size < device_pool.size:
        raise ValueError(
            f"hicache_size {settings.hicache_size} GB holds {size} tokens, fewer than the KV pool's "
            f"{device_pool.size}: the host pool keeps a copy of the KV pool's prefixes and the ones evicted from it"
        )
    host_pool = TokenToKVPoolHost(device_pool, size)
    logger.info("host KV pool: %d tokens (%.1f MiB)", host_pool.size, host_pool.size * per_token / 2**20)
    storage = None
    if settings.hicache_storage_backend is not None:
        pending = host_pool.size * per_token // 4  # writes waiting beyond this are dropped
        storage = StorageIO(create_storage_backend(settings), host_pool.page_shape(), host_pool.dtype, pending)
    controller = HiCacheController(device_pool, host_pool, submit, storage)
    tree = HiRadixCache(
        req_to_token_pool,
        allocator,
        controller,
        settings.hicache_write_policy,
        namespace() if storage is not None else "",
    )
    if storage is not None and adapter_digest is not None:

        def adapter_namespace(load_id: int) -> str | None:  # (an adapter's KV: under its files' digest)
            digest = adapter_digest(load_id)
            return namespace_key(tree.namespace, digest) if digest is not None else None

        tree.adapter_namespace = adapter_namespace
    return tree
