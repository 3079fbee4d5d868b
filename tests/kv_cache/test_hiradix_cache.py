"""The prefix cache over a host-memory tier (HiRadixCache): prefixes evicted from the device pool go to the
host pool and come back on a hit with their KV intact, under each write policy; the host tier evicts its
least recently used leaves; no slot of either pool leaks. The KV written for each token is a function of
the tokens up to it, so a match whose slots hold anything else is caught."""

from __future__ import annotations

import random

import pytest
import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.cache_controller import HiCacheController
from vlm_serve.kv_cache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, ReqToTokenPool, TokenToKVPool
from vlm_serve.kv_cache.memory_pool_host import TokenToKVPoolHost

CPU = torch.device("cpu")
LAYERS, HEADS, DIM = 2, 1, 2


def make_cache(device_tokens: int, host_tokens: int, page_size: int = 1, policy: str = "write_through") -> HiRadixCache:
    device_pool = TokenToKVPool(device_tokens, KVPoolLayout(LAYERS, HEADS, DIM, page_size, torch.float32), CPU)
    host_pool = TokenToKVPoolHost(device_pool, host_tokens)
    allocator = TokenToKVPoolAllocator(device_tokens, page_size, CPU)
    req_to_token_pool = ReqToTokenPool(size=4, max_context_len=64, device=CPU)
    return HiRadixCache(req_to_token_pool, allocator, HiCacheController(device_pool, host_pool), policy)


def kv_of(key: list[int]) -> torch.Tensor:
    """The KV a token gets in this test: a function of every token up to it (as a model's is)."""
    out, h = [], 0
    for t in key:
        h = (h * 1_000_003 + t + 1) % 1_000_000_007
        out.append(float(h % 65536))
    return torch.tensor(out)


def compute(cache: HiRadixCache, key: list[int]) -> None:
    """A request with prompt `key`: matches, loads its host hit back, computes (writes) the KV of the
    rest, then caches it all, as the scheduler does."""
    match = cache.match_prefix(key)
    prefix, last = match.indices, match.last_node
    cache.inc_lock_ref(last)
    if match.host_hit_length:
        node = cache.load_back(match.last_host_node)
        assert node is not None
        cache.dec_lock_ref(last)
        cache.inc_lock_ref(node)
        prefix, last = cache.match_prefix(key).indices, node
    assert_holds(cache, key[: len(prefix)], prefix)
    rest = len(key) - len(prefix)
    if cache.allocator.available_size() < rest:
        cache.evict(rest - cache.allocator.available_size())
    slots = cache.allocator.alloc(rest)
    assert slots is not None
    pool = cache.controller.device_pool
    values = kv_of(key)[len(prefix) :, None, None].expand(-1, HEADS, DIM)
    for layer in range(LAYERS):
        pool.set_kv(layer, slots, values, -values)
    all_slots = torch.cat([prefix, slots])
    cached = cache.insert(key, all_slots)
    cache.allocator.free(all_slots[len(prefix) : cached])
    cache.after_launch()
    cache.dec_lock_ref(last)


def assert_holds(cache: HiRadixCache, key: list[int], slots: torch.Tensor) -> None:
    pool = cache.controller.device_pool
    want = kv_of(key)
    for layer in range(LAYERS):
        k, v = pool.get_kv(layer)
        assert torch.equal(k[slots, 0, 0], want), "a matched prefix's slots hold another prefix's KV"
        assert torch.equal(v[slots, 0, 0], -want)


def assert_accounted(cache: HiRadixCache) -> None:
    nodes = cache._nodes()
    on_device = sum(len(n.key) for n in nodes if not n.evicted)
    assert cache.allocator.available_size() + on_device == cache.allocator.size
    assert cache.evictable_size() + cache.protected_size() == on_device
    assert cache.idle_problems() == []
    for n in nodes:  # the device nodes of a path come first
        assert n.evicted or n.parent is cache.root or not n.parent.evicted
        assert not n.evicted or n.host_value is not None


def test_an_evicted_prefix_is_held_by_the_host_tier_and_loaded_back_intact():
    cache = make_cache(device_tokens=16, host_tokens=64)
    compute(cache, [1, 2, 3, 4, 5, 6])
    assert cache.evict(6) == 6
    assert cache.allocator.available_size() == 16
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert len(match.indices) == 0 and match.host_hit_length == 6 and match.covered == 6
    compute(cache, [1, 2, 3, 4, 5, 6, 7])  # (asserts the loaded prefix holds its own KV)
    assert cache.host_hit_tokens == 6
    assert len(cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).indices) == 7
    assert_accounted(cache)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_each_write_policy_backs_a_prefix_up_when_it_says(policy):
    cache = make_cache(device_tokens=32, host_tokens=64, policy=policy)
    compute(cache, [1, 2, 3, 4])
    assert cache.host_size() == (4 if policy == "write_through" else 0)
    compute(cache, [1, 2, 3, 4, 5])  # a second request uses the prefix
    assert cache.host_size() == {"write_through": 5, "write_through_selective": 4, "write_back": 0}[policy]
    cache.evict(cache.evictable_size())
    assert cache.host_size() == 5  # every policy keeps what leaves the device
    compute(cache, [1, 2, 3, 4, 5, 9])
    assert_accounted(cache)


def test_a_full_host_tier_evicts_its_least_recently_used_leaves():
    cache = make_cache(device_tokens=8, host_tokens=12, policy="write_back")
    for first in (10, 20, 30):
        compute(cache, [first, first + 1, first + 2, first + 3])
        cache.evict(cache.evictable_size())
    assert cache.host_size() == 12  # three prefixes of 4 fill the host tier
    compute(cache, [40, 41, 42, 43])
    cache.evict(cache.evictable_size())
    assert cache.match_prefix([10, 11, 12, 13]).host_hit_length == 0  # the least recently used one went
    assert cache.match_prefix([40, 41, 42, 43]).host_hit_length == 4
    assert_accounted(cache)


def test_without_room_in_the_host_tier_an_evicted_prefix_is_dropped():
    cache = make_cache(device_tokens=12, host_tokens=8, policy="write_back")
    compute(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.evict(8)  # all 8 go to the host
    compute(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # loaded back (host copies kept) and one more token
    assert cache.host_size() == 8
    cache.evict(cache.evictable_size())  # the new token's node finds no host room: dropped
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).host_hit_length == 8
    assert_accounted(cache)


def test_computing_a_prefix_the_host_tier_holds_takes_the_new_slots_back_into_the_tree():
    cache = make_cache(device_tokens=16, host_tokens=32)
    compute(cache, [1, 2, 3, 4])
    cache.evict(4)
    slots = cache.allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots) == 0  # nothing was on the device: no slot is a duplicate
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).indices.tolist() == slots.tolist()
    assert_accounted(cache)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_random_requests_always_find_their_own_kv_and_leak_nothing(page_size, policy):
    rng = random.Random(f"{page_size}-{policy}")
    cache = make_cache(device_tokens=48, host_tokens=96, page_size=page_size, policy=policy)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 16))] for _ in range(8)]
    for _ in range(300):
        key = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        key = key[: len(key) - len(key) % page_size] or key[:page_size]
        if len(key) < page_size:
            continue
        compute(cache, key)
        assert_holds(cache, key, cache.match_prefix(key).indices)
        assert_accounted(cache)
    assert cache.host_hit_tokens > 0
    cache.evict_all()
    assert cache.host_size() == 0 and cache.total_size() == 0
