"""RadixCache: the prefixes whose KV is kept after their requests, shared by every later request.

A radix tree over token ids (image tokens appear as their pad values, so equal keys mean equal
content). Each node holds a run of ids (`key`) and the KV slots of those tokens (`value`). Keys are
matched and stored in whole pages. A node locked by a running request (`lock_ref` > 0, counted up the
whole path to the root) is protected; unlocked leaves are evicted least recently used first, their
slots going back to the allocator. A prefix is inserted once the forward that computes its KV is
launched: forwards run in launch order, so every forward that reads it runs after that one.

With `disable=True` nothing is shared: every match is empty and a finished request frees its KV.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool

_clock = itertools.count()  # access order for LRU; a counter keeps eviction order deterministic


class CachedReq(Protocol):
    """What the cache reads and sets of a request (schedule_batch.Req)."""

    req_pool_idx: int  # its row of req_to_token
    kv_len: int  # tokens whose KV slots the row holds
    fill_ids: list[int]  # its prompt and output ids so far (image tokens as their pad values)
    prefix_indices: torch.Tensor  # the KV slots of its prefix shared with the tree
    last_node: TreeNode  # where that prefix ends (locked for the request)
    last_host_node: TreeNode | None  # where the match ends in the host tier (HiRadixCache), if it goes on there
    host_hit_length: int

    def cache_key(self, ids: list[int]) -> list[int]: ...

    def reset_kv(self) -> None: ...


class TreeNode:
    __slots__ = (
        "children", "parent", "key", "value", "host_value", "hash_value", "lock_ref", "host_ref", "hit_count",
        "last_access",
    )  # fmt: skip

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None) -> None:
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # KV slots of `key` in the device pool, int64; None once evicted to the host tier
        self.host_value: torch.Tensor | None = None  # its slots in the host pool (HiRadixCache), if backed up
        self.hash_value: list[str] | None = None  # its pages' keys in the storage tier, once computed
        self.lock_ref = 0
        self.host_ref = 0  # (HiRadixCache) held in the host pool while its KV is on its way to the device
        self.hit_count = 0
        self.last_access = next(_clock)

    @property
    def evicted(self) -> bool:
        """Its KV is no longer in the device pool (only in the host tier)."""
        return self.value is None

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    indices: torch.Tensor  # KV slots of the matched prefix in the device pool (a whole number of pages)
    last_node: TreeNode  # deepest node of the match on the device; lock it to keep the prefix
    last_host_node: TreeNode | None = None  # (HiRadixCache) deepest node of the match in the host tier
    host_hit_length: int = 0  # tokens after `indices` whose KV the host tier holds (loaded back before use)

    @property
    def covered(self) -> int:
        """Tokens of the prompt whose KV some tier holds: no vision tower runs for a picture inside them."""
        return len(self.indices) + self.host_hit_length


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        allocator: TokenToKVPoolAllocator | None,
        disable: bool = False,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = allocator.page_size if allocator is not None else 1  # (the pool's layout's)
        self.disable = disable
        self.device = allocator.device if allocator is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64, device=self.device), None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self.evicted_tokens = 0  # tokens evicted from any tier so far (a match made before may be stale)

    # ---- sizes -------------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens held only by the tree: can be freed by `evict`."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by the tree and locked by running requests."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insertion ----------------------------------------------------------------------

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of `a` and `b`, rounded down to whole pages."""
        n = min(len(a), len(b))
        if a[:n] != b[:n]:
            n = next(i for i in range(n) if a[i] != b[i])
        return n - n % self.page_size

    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of `key` (whole pages), splitting a node where the match ends
        inside it so that `last_node` covers exactly the match."""
        path = self._match_path(key)
        indices = torch.cat([n.value for n in path]) if path else self.root.value
        return MatchResult(indices, path[-1] if path else self.root)

    def _match_path(self, key: list[int]) -> list[TreeNode]:
        """The nodes the longest cached prefix of `key` runs through, the last one split to end with it."""
        node, path = self.root, []
        if not self.disable:
            key = key[: len(key) - len(key) % self.page_size]
            while key:
                child = node.children.get(self._child_key(key))
                if child is None:
                    break
                child.last_access = next(_clock)
                n = self._match_len(child.key, key)
                if n < len(child.key):
                    child = self._split(child, n)
                path.append(child)
                node, key = child, key[n:]
        return path

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cuts `node` after `n` ids; returns the new upper part (which keeps the lock counts)."""
        upper = TreeNode(node.key[:n], None if node.value is None else node.value[:n], node.parent)
        upper.lock_ref, upper.host_ref, upper.hit_count = node.lock_ref, node.host_ref, node.hit_count
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:n], node.host_value[n:]
        if node.hash_value is not None:
            pages = n // self.page_size
            upper.hash_value, node.hash_value = node.hash_value[:pages], node.hash_value[pages:]
        upper.children = {self._child_key(node.key[n:]): node}
        node.parent.children[self._child_key(node.key)] = upper
        node.parent, node.key = upper, node.key[n:]
        if node.value is not None:
            node.value = node.value[n:]
        return upper

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Adds `key` with KV slots `value` (both whole pages). Returns how many leading tokens were
        already cached: the caller's own slots for those are duplicates it must free. (A node evicted to
        the host tier takes the caller's slots back: only its ancestors' are duplicates.)"""
        if self.disable:
            return 0
        node, done, cached = self.root, 0, None
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                new = TreeNode(rest, value[done:].clone(), node)
                node.children[self._child_key(rest)] = new
                self._evictable += len(rest)
                break
            child.last_access = next(_clock)
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            if child.evicted:  # (the device nodes of a path come before its evicted ones)
                cached = done if cached is None else cached
                child.value = value[done : done + n].clone()
                self._evictable += n
            node, done = child, done + n
        return done if cached is None else cached

    # ---- requests ----------------------------------------------------------------------------------

    def cache_unfinished_req(self, req: CachedReq) -> None:
        """After a prefill (or chunk) ran: share the request's computed prefix and lock it for the
        request, which keeps its KV row pointing at the tree's slots."""
        row = req.req_pool_idx
        slots = self.req_to_token_pool.req_to_token[row, : req.kv_len].long()
        aligned = req.kv_len - req.kv_len % self.page_size
        if self.disable or aligned <= len(req.prefix_indices):
            return
        keys = req.cache_key(req.fill_ids[:aligned])
        cached = self.insert(keys, slots[:aligned])
        self.allocator.free(slots[len(req.prefix_indices) : cached])
        match = self.match_prefix(keys)
        self.req_to_token_pool.write(row, 0, match.indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.indices, match.last_node

    def cache_finished_req(self, req: CachedReq, keep: bool = True) -> None:
        """A request is done (finished, aborted or retracted): its computed KV goes into the tree (or
        back to the allocator when the tree is disabled or not to `keep`) and its request row is freed.
        Only its own tokens' KV can be cached: the slots of drafts whose verification is still in flight
        go back to the allocator."""
        row = req.req_pool_idx
        slots = self.req_to_token_pool.req_to_token[row, : req.kv_len].long()
        own_from = len(req.prefix_indices)
        if keep and not self.disable:
            known = min(req.kv_len, len(req.fill_ids))
            aligned = known - known % self.page_size
            cached = self.insert(req.cache_key(req.fill_ids[:aligned]), slots[:aligned])
            self.allocator.free(slots[own_from:cached])
            own_from = aligned  # the tree took [cached, aligned)
        self.allocator.free(slots[own_from:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.reset_kv()

    def after_launch(self) -> None:
        """Called after each forward is launched: a tier below may now copy the KV it computes."""

    # ---- locks and eviction ------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` (if that many are evictable), least recently used leaves
        first. Returns the number freed."""

        def remove(leaf: TreeNode) -> None:
            self.allocator.free(leaf.value)
            self._evictable -= len(leaf.key)
            del leaf.parent.children[self._child_key(leaf.key)]

        return self._evict_lru(num_tokens, self._evictable_leaf, remove)

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _evict_lru(
        self, num_tokens: int, evictable: Callable[[TreeNode], bool], remove: Callable[[TreeNode], None]
    ) -> int:
        """Removes `evictable` nodes, least recently used first (a parent becomes a candidate once its
        last child went), until `num_tokens` went or none is left. Returns the tokens removed."""
        candidates = [n for n in self._nodes() if evictable(n)]
        heapq.heapify(candidates)
        freed = 0
        while freed < num_tokens and candidates:
            node = heapq.heappop(candidates)
            if not evictable(node):  # (removing another may have changed it)
                continue
            parent = node.parent
            remove(node)
            freed += len(node.key)
            if evictable(parent):
                heapq.heappush(candidates, parent)
        self.evicted_tokens += freed
        return freed

    def evict_all(self) -> None:
        """Empties the cache (nothing may be locked)."""
        self.evict(self.evictable_size())

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.children.values())
            stack.extend(node.children.values())
        return out

    def lock_counts(self) -> list[int]:
        """Lock count of every node but the root (all zero when no request is running)."""
        return [n.lock_ref for n in self._nodes()]

    def idle_problems(self) -> list[str]:
        """What is wrong with the cache when no request is running (nothing, unless a bug leaked a lock)."""
        if self.protected_size() != 0 or any(self.lock_counts()):
            return [f"{self.protected_size()} tokens still locked in the prefix cache"]
        return []
