"""HiRadixCache: the RadixCache extended over a host-memory tier (`--enable-hierarchical-cache`).

A node's KV lives in the device pool (`value`), in the host pool (`host_value`) or both. A node evicted from
the device keeps its place in the tree with only `host_value`: a later match runs through it, and the
request that matched it has it loaded back (`load_back`) before its prefill, instead of computing it again.
On a path from the root the nodes on the device come first: a node leaves the device only after its
children have, and comes back only after its parent.

When a node gets its host copy is the write policy:
- `write_through`: when it enters the tree (the copy runs right after the forward computing its KV);
- `write_through_selective`: when a second request has used it;
- `write_back`: when it is evicted from the device.
The host copy of a node on the device is kept; host eviction drops, least recently used first, leaves held
only by the host. A node evicted from the device whose backup finds no room in the host pool is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.cache_controller import HiCacheController, PrefetchOperation
from vlm_serve.kv_cache.hicache_storage import page_keys
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import CachedReq, MatchResult, RadixCache, TreeNode
from vlm_serve.messages.backend import HiCacheStats

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2}  # uses before a node is backed up


TOKEN_BITS = (1 << 64) - 1  # a cache key's token id (or pad value); above them, its adapter's load id


class HiRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        controller: HiCacheController,
        write_policy: str = "write_through",
        storage_namespace: str = "",
    ) -> None:
        """`storage_namespace`: the root of the storage tier's key chains (see `hicache_storage`)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(WRITE_POLICIES)}, not {write_policy!r}")
        self.controller = controller
        self.host_allocator = controller.host_pool.allocator
        self.write_threshold = WRITE_THRESHOLD.get(write_policy)
        self.namespace = storage_namespace
        # the root of an adapter's chains, by its load id (the key range of its KV: `Req.cache_key`); None for
        # an adapter no longer loaded, whose KV is then not stored
        self.adapter_namespace: Callable[[int], str | None] = lambda load_id: None
        self.host_hit_tokens = 0  # tokens loaded back from the host tier for requests
        self.storage_hit_tokens = 0  # tokens read from the storage tier into the host tier for requests
        super().__init__(req_to_token_pool, allocator)

    # ---- sizes -------------------------------------------------------------------------------------

    def host_size(self) -> int:
        """Tokens whose KV the host tier holds."""
        return self.host_allocator.size - self.host_allocator.available_size()

    # ---- lookup ------------------------------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """The cached prefix on the device, and after it the part of the match held by the host tier."""
        path = self._match_path(key)
        on_device = [n for n in path if not n.evicted]
        indices = torch.cat([n.value for n in on_device]) if on_device else self.root.value
        last_node = on_device[-1] if on_device else self.root
        host_hit = sum(len(n.key) for n in path[len(on_device) :])
        return MatchResult(indices, last_node, path[-1] if host_hit else None, host_hit)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        cached = super().insert(key, value)
        if self.write_threshold is not None:
            for node in self._match_path(key):
                node.hit_count += 1
                if node.host_value is None and node.hit_count >= self.write_threshold:
                    self.write_backup(node, deferred=True)  # (its KV's forward may not be launched yet)
        return cached

    # ---- between the tiers -------------------------------------------------------------------------

    def write_backup(self, node: TreeNode, deferred: bool = False) -> bool:
        """Gives `node` a host copy of its KV (and stores its pages), evicting host-only leaves for room.
        False if there is none."""
        slots = self._alloc_host(len(node.key))
        if slots is None:
            return False
        node.host_value = slots
        stored = self.controller.storage is not None and self._chain_root(node.key[0]) is not None
        keys = self._page_keys(node) if stored else None
        self.controller.write(slots, node.value, keys, deferred=deferred)
        return True

    def _page_keys(self, node: TreeNode) -> list[str]:
        """The storage keys of `node`'s pages (computed once, from its parent's)."""
        chain = []
        while node is not self.root and node.hash_value is None:
            chain.append(node)
            node = node.parent
        parent_key = self._chain_root(chain[-1].key[0]) if node is self.root else node.hash_value[-1]
        for n in reversed(chain):
            n.hash_value = page_keys(parent_key, _token_ids(n.key), self.page_size)
            parent_key = n.hash_value[-1]
        return (chain[0] if chain else node).hash_value

    def _chain_root(self, first: int) -> str | None:
        """The root of the key chain of a prefix that starts with (cache key) `first`: the base's namespace,
        or its adapter's (None: not stored)."""
        return self.namespace if first <= TOKEN_BITS else self.adapter_namespace(first >> 64)

    # ---- the storage tier --------------------------------------------------------------------------

    def prefetch_from_storage(self, key: list[int]) -> tuple[PrefetchOperation, int] | None:
        """Starts reading from storage the pages of `key` after the part the tree holds (device or host).
        Returns the read and the position its pages start at; None if no whole page is left to read."""
        key = key[: len(key) - len(key) % self.page_size]
        path = self._match_path(key)
        start = sum(len(n.key) for n in path)
        if start == len(key):
            return None
        parent_key = self._page_keys(path[-1])[-1] if path else self._chain_root(key[0])
        if parent_key is None:
            return None
        tokens = _token_ids(key[start:])
        return self.controller.storage.prefetch(page_keys(parent_key, tokens, self.page_size)), start

    def take_prefetched(self, key: list[int], start: int, op: PrefetchOperation, num_pages: int) -> int:
        """Puts the first `num_pages` pages `op` read for `key` (from position `start`) into the host tier,
        under the part of `key` the tree holds now. Returns the tokens added."""
        ps = self.page_size
        end = start + num_pages * ps
        path = self._match_path(key[:end])
        matched = sum(len(n.key) for n in path)
        if matched < start or matched == end:  # (the tree lost the prefix they follow, or has them already)
            return 0
        first = (matched - start) // ps
        held = [n for n in path if n.evicted]
        for n in held:
            n.host_ref += 1  # (making room must not evict the nodes they hang from)
        slots = self._alloc_host(end - matched)
        for n in held:
            n.host_ref -= 1
        if slots is None:
            return 0
        parent = path[-1] if path else self.root
        node = TreeNode(key[matched:end], None, parent)
        node.host_value, node.hash_value = slots, op.keys[first:num_pages]
        parent.children[self._child_key(node.key)] = node
        self.controller.load_pages_to_host(slots, op.pages[first:num_pages])
        self.storage_hit_tokens += end - matched
        return end - matched

    def load_back(self, last_host_node: TreeNode) -> TreeNode | None:
        """Brings the evicted nodes on the path to `last_host_node` back to the device: slots for them
        (evicting other nodes), and their copy queued before any later forward. Returns the path's last
        node, now on the device, or None (nothing changed) when the device pool cannot hold them."""
        nodes = []
        node = last_host_node
        while node.evicted:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        ancestor = node
        for n in nodes:
            n.host_ref += 1  # (evicting for their device slots may back up others and evict host leaves)
        self.inc_lock_ref(ancestor)
        try:
            need = sum(len(n.key) for n in nodes)
            if need > self.allocator.available_size():
                self.evict(need - self.allocator.available_size())
            slots = self.allocator.alloc(need)
        finally:
            self.dec_lock_ref(ancestor)
            for n in nodes:
                n.host_ref -= 1
        if slots is None:
            return None
        self.controller.load(slots, torch.cat([n.host_value for n in nodes]))
        offset = 0
        for n in nodes:
            n.value = slots[offset : offset + len(n.key)]
            offset += len(n.key)
            self._evictable += len(n.key)
        self.host_hit_tokens += need
        return last_host_node

    def load_back_for(self, req: CachedReq) -> bool:
        """`req`'s prefix extended by the host part of its match (whose device part it holds locked):
        loaded back, locked, and set as its prefix. False (nothing changed) if the device cannot hold it."""
        node = self.load_back(req.last_host_node)
        if node is None:
            return False
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        values = []
        while node is not self.root:
            values.append(node.value)
            node = node.parent
        req.prefix_indices, req.last_node = torch.cat(values[::-1]), req.last_host_node
        req.last_host_node, req.host_hit_length = None, 0
        return True

    # ---- eviction ----------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` device slots (if that many are evictable), least recently used
        first: each node goes to the host tier (backed up first if it was not) or, without room there,
        out of the tree. Returns the number freed."""
        self.controller.flush()

        def remove(node: TreeNode) -> None:
            if node.host_value is None and not self.write_backup(node):
                self._drop(node)
            else:
                self.allocator.free(node.value)
                node.value = None
            self._evictable -= len(node.key)

        return self._evict_lru(num_tokens, self._device_evictable, remove)

    def _device_evictable(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and not node.evicted
            and node.lock_ref == 0
            and all(c.evicted for c in node.children.values())
        )

    def _drop(self, node: TreeNode) -> None:
        """Takes `node` (on the device, its children evicted) and its subtree out of the tree."""
        self.allocator.free(node.value)
        del node.parent.children[self._child_key(node.key)]
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            self.host_allocator.free(child.host_value)
            stack.extend(child.children.values())

    def evict_host(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` host slots (if that many are held by evicted leaves), least
        recently used first. Returns the number freed."""

        def remove(node: TreeNode) -> None:
            self.host_allocator.free(node.host_value)
            del node.parent.children[self._child_key(node.key)]

        return self._evict_lru(num_tokens, self._host_evictable, remove)

    def _host_evictable(self, node: TreeNode) -> bool:
        return node is not self.root and node.evicted and not node.children and node.host_ref == 0

    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        short = num_tokens - self.host_allocator.available_size()
        if short > 0:
            self.evict_host(short)
        return self.host_allocator.alloc(num_tokens)

    def after_launch(self) -> None:
        self.controller.flush()  # the write-through backups of the prefixes it computes

    def evict_all(self) -> None:
        """Empties both tiers (nothing may be locked)."""
        self.evict(self.evictable_size())
        self.evict_host(self.host_size())

    def idle_problems(self) -> list[str]:
        problems = super().idle_problems()
        held = sum(len(n.host_value) for n in self._nodes() if n.host_value is not None)
        if held != self.host_size():
            problems.append(f"{self.host_size() - held} host KV slots leaked")
        if any(n.host_ref for n in self._nodes()):
            problems.append("host tier nodes still held for loading")
        return problems

    def stats(self, cached_prompt_tokens: int) -> HiCacheStats:
        """The tiers' figures, given the prompt tokens served from the cache as a whole. (Pages read from
        storage for a request are loaded back from the host right after: they count as storage hits.)"""
        c = self.controller
        stats = HiCacheStats(
            hit_tokens={
                "device": cached_prompt_tokens - self.host_hit_tokens,
                "host": max(self.host_hit_tokens - self.storage_hit_tokens, 0),
            },
            copied_bytes={"device_to_host": c.written.bytes, "host_to_device": c.loaded.bytes},
            copy_seconds={"device_to_host": c.written.seconds, "host_to_device": c.loaded.seconds},
            usage_tokens={"host": self.host_size()},
            capacity_tokens={"host": self.host_allocator.size},
        )
        if c.storage is not None:
            io, per_token = c.storage, c.host_pool.layout.bytes_per_token
            stats.hit_tokens["storage"] = self.storage_hit_tokens
            stats.copied_bytes |= {"host_to_storage": io.written.bytes, "storage_to_host": io.read.bytes}
            stats.copy_seconds |= {"host_to_storage": io.written.seconds, "storage_to_host": io.read.seconds}
            if (usage := io.backend.usage_bytes()) is not None:  # (Mooncake's store is shared: not known here)
                stats.usage_tokens["storage"] = usage // per_token
            stats.capacity_tokens["storage"] = io.backend.capacity_bytes() // per_token
            stats.storage_failures = {"corrupt": io.backend.corrupt, "errors": io.failures}
            stats.storage_failures["dropped_writes"] = io.dropped_writes
        return stats


def _token_ids(key: list[int]) -> list[int]:
    """A cache key's token ids (an adapter's moved back into the base's range; the base's as they are)."""
    return key if not key or key[0] <= TOKEN_BITS else [t & TOKEN_BITS for t in key]
