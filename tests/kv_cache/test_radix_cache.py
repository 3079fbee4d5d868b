"""The radix prefix cache: matching, insertion, node splits, locks, LRU eviction, pages, pad values and
the hand-over of a request's KV, on real (small, CPU) pools."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.mm_cache.hashing import pad_value
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.padding import pad_input_ids
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.schedule_batch import Req

CPU = torch.device("cpu")
POOL_SIZE = 64


def make_cache(page_size: int = 1, size: int = POOL_SIZE, disable: bool = False) -> RadixCache:
    req_to_token_pool = ReqToTokenPool(size=4, max_context_len=32, device=CPU)
    allocator = TokenToKVPoolAllocator(size, page_size, CPU)
    return RadixCache(req_to_token_pool, allocator, disable=disable)


@pytest.fixture
def cache() -> RadixCache:
    return make_cache()


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Allocates slots for `key`, inserts it (freeing the duplicates of what was cached), and returns
    the allocated slots."""
    slots = cache.allocator.alloc(len(key))
    cache.allocator.free(slots[: cache.insert(key, slots)])
    return slots


def slots_of(cache: RadixCache, key: list[int]) -> list[int]:
    return cache.match_prefix(key).indices.tolist()


def assert_every_slot_accounted_for(cache: RadixCache) -> None:
    assert cache.allocator.available_size() + cache.total_size() == cache.allocator.size


# ---- match and insert ---------------------------------------------------------------------------------


def test_match_on_an_empty_tree_is_empty(cache):
    match = cache.match_prefix([1, 2, 3])
    assert match.indices.numel() == 0
    assert match.last_node is cache.root


def test_insert_then_match_returns_exactly_the_inserted_slots(cache):
    slots = put(cache, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.indices.tolist() == slots.tolist()
    assert match.indices.dtype == torch.int64
    assert cache.evictable_size() == 4 and cache.protected_size() == 0


def test_a_longer_query_matches_only_the_cached_prefix(cache):
    slots = put(cache, [1, 2, 3])
    assert slots_of(cache, [1, 2, 3, 4, 5]) == slots.tolist()
    assert slots_of(cache, [9, 1, 2, 3]) == []


def test_insert_returns_the_length_already_cached_and_keeps_the_first_slots(cache):
    first = cache.allocator.alloc(3)
    assert cache.insert([1, 2, 3], first) == 0
    second = cache.allocator.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], second) == 3
    # the tree keeps its own slots for the cached part and takes only the new tail of `second`
    assert slots_of(cache, [1, 2, 3, 4, 5]) == first.tolist() + second[3:].tolist()
    assert cache.insert([1, 2, 3, 4, 5], cache.allocator.alloc(5)) == 5
    assert cache.evictable_size() == 5


def test_insert_diverging_inside_a_node_splits_it(cache):
    a = put(cache, [1, 2, 3, 4, 5, 6])
    b = cache.allocator.alloc(5)
    assert cache.insert([1, 2, 3, 7, 8], b) == 3
    (shared,) = cache.root.children.values()
    assert shared.key == [1, 2, 3]
    assert shared.value.tolist() == a[:3].tolist()  # the shared part keeps its slots
    assert sorted(child.key for child in shared.children.values()) == [[4, 5, 6], [7, 8]]
    assert slots_of(cache, [1, 2, 3, 4, 5, 6]) == a.tolist()
    assert slots_of(cache, [1, 2, 3, 7, 8]) == a[:3].tolist() + b[3:].tolist()
    assert cache.evictable_size() == 8  # distinct cached tokens: 1..8


def test_a_match_ending_inside_a_node_splits_it_so_last_node_covers_exactly_the_match(cache):
    slots = put(cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.last_node.key == [1, 2, 3]
    assert match.last_node.value.tolist() == slots[:3].tolist()
    assert match.last_node.parent is cache.root
    (rest,) = match.last_node.children.values()
    assert rest.key == [4, 5, 6] and rest.value.tolist() == slots[3:].tolist()
    assert cache.evictable_size() == 6  # a split moves no tokens
    assert slots_of(cache, [1, 2, 3, 4, 5, 6]) == slots.tolist()


# ---- locks ---------------------------------------------------------------------------------------------


def test_locking_a_node_protects_its_whole_path_from_eviction(cache):
    put(cache, [1, 2, 3, 4, 5, 6])
    b = put(cache, [1, 2, 3, 7, 8])
    leaf = cache.match_prefix([1, 2, 3, 7, 8]).last_node
    cache.inc_lock_ref(leaf)
    assert cache.protected_size() == 5  # [1, 2, 3] and [7, 8]
    assert cache.evictable_size() == 3  # [4, 5, 6]
    free_before = cache.allocator.available_size()
    assert cache.evict(100) == 3
    assert cache.allocator.available_size() == free_before + 3
    assert cache.evictable_size() == 0 and cache.protected_size() == 5
    assert slots_of(cache, [1, 2, 3, 7, 8])[3:] == b[3:].tolist()
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    assert cache.evict(100) == 5
    assert cache.total_size() == 0
    assert_every_slot_accounted_for(cache)


def test_lock_counts_add_up_along_the_path(cache):
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    left = cache.match_prefix([1, 2, 3, 4]).last_node
    right = cache.match_prefix([1, 2, 5, 6]).last_node
    cache.inc_lock_ref(left)
    cache.inc_lock_ref(right)
    assert left.parent is right.parent
    assert left.parent.lock_ref == 2 and left.lock_ref == 1 and right.lock_ref == 1
    assert cache.protected_size() == 6
    cache.dec_lock_ref(left)
    assert left.parent.lock_ref == 1 and cache.protected_size() == 4 and cache.evictable_size() == 2
    cache.dec_lock_ref(right)
    assert cache.lock_counts() == [0, 0, 0]
    assert cache.protected_size() == 0 and cache.evictable_size() == 6


def test_splitting_a_locked_node_keeps_both_parts_locked(cache):
    put(cache, [1, 2, 3, 4, 5, 6])
    leaf = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    cache.inc_lock_ref(leaf)
    upper = cache.match_prefix([1, 2, 3]).last_node  # splits the locked node
    assert upper is leaf.parent and upper.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.protected_size() == 6
    cache.dec_lock_ref(leaf)  # the holder of the old node releases the whole path
    assert cache.lock_counts() == [0, 0]
    assert cache.evictable_size() == 6 and cache.protected_size() == 0


# ---- eviction ------------------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_used_leaf_first(cache):
    put(cache, [1, 1])
    b = put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])  # a match refreshes [1, 1]: [2, 2] is now the oldest
    free_before = cache.allocator.available_size()
    assert cache.evict(2) == 2
    assert slots_of(cache, [2, 2]) == []
    assert len(slots_of(cache, [1, 1])) == 2 and len(slots_of(cache, [3, 3])) == 2
    assert cache.allocator.available_size() == free_before + 2
    assert set(b.tolist()) <= set(cache.allocator.free_pages)  # its slots went back (page_size 1: page == slot)


def test_evict_frees_whole_leaves_at_least_the_tokens_asked_for(cache):
    put(cache, [1, 2, 3])
    free_before = cache.allocator.available_size()
    assert cache.evict(1) == 3
    assert cache.allocator.available_size() == free_before + 3
    assert cache.total_size() == 0


def test_a_parent_becomes_evictable_after_its_children_are_gone(cache):
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    cache.match_prefix([1, 2])  # the shared parent is the most recently used node
    free_before = cache.allocator.available_size()
    assert cache.evict(4) == 4  # both children, not the parent, go first
    assert len(slots_of(cache, [1, 2, 3, 4])) == 2  # the parent [1, 2] is still cached
    assert cache.evictable_size() == 2
    assert cache.evict(1) == 2  # now a leaf itself
    assert cache.total_size() == 0 and cache.root.children == {}
    assert cache.allocator.available_size() == free_before + 6
    assert_every_slot_accounted_for(cache)


def test_evict_on_an_empty_tree_frees_nothing(cache):
    assert cache.evict(10) == 0
    assert cache.allocator.available_size() == POOL_SIZE


# ---- pages ---------------------------------------------------------------------------------------------


def test_paged_match_rounds_the_query_down_to_whole_pages():
    cache = make_cache(page_size=4)
    slots = put(cache, list(range(1, 9)))
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])  # 6 tokens: one whole page
    assert match.indices.tolist() == slots[:4].tolist()
    assert match.last_node.key == [1, 2, 3, 4]
    assert slots_of(cache, [1, 2, 3, 4, 5, 6, 99, 8]) == slots[:4].tolist()  # mismatch inside page two
    assert slots_of(cache, [1, 2, 3]) == []  # less than a page
    assert slots_of(cache, list(range(1, 9)) + [9, 10]) == slots.tolist()


def test_paged_insert_shares_only_whole_pages():
    cache = make_cache(page_size=4)
    a = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    b = cache.allocator.alloc(8)
    assert cache.insert([1, 2, 3, 4, 5, 6, 70, 80], b) == 4  # 6 equal tokens, but only one whole page
    assert slots_of(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == a.tolist()
    assert slots_of(cache, [1, 2, 3, 4, 5, 6, 70, 80]) == a[:4].tolist() + b[4:].tolist()
    assert cache.evictable_size() == 12
    cache.allocator.free(b[:4])  # the caller's duplicate page
    assert_every_slot_accounted_for(cache)
    assert cache.evict(100) == 12
    assert cache.allocator.available_size() == cache.allocator.size


# ---- image pad values ----------------------------------------------------------------------------------

VOCAB = 1000
IMAGE_TOKEN = 999


def image(seed: int) -> MultimodalItem:
    pixels = torch.randn(16, 12, generator=torch.Generator().manual_seed(seed))
    return MultimodalItem("image", pixels, (1, 4, 4), spans=[(3, 7)])


def prompt_with_image(item: MultimodalItem, tail: list[int]) -> list[int]:
    return pad_input_ids([1, 2, 3] + [IMAGE_TOKEN] * 4 + tail, [item], VOCAB)


def test_two_different_images_match_only_the_text_before_them(cache):
    put(cache, prompt_with_image(image(0), [4, 5]))
    assert len(slots_of(cache, prompt_with_image(image(1), [4, 5]))) == 3


def test_the_same_image_in_two_prompts_matches_through_the_whole_image(cache):
    put(cache, prompt_with_image(image(0), [4, 5]))
    assert len(slots_of(cache, prompt_with_image(image(0), [6, 7]))) == 7


def test_pad_values_lie_above_the_vocabulary_and_fit_in_int64():
    ids_a, ids_b = prompt_with_image(image(0), []), prompt_with_image(image(1), [])
    for ids in (ids_a, ids_b):
        assert ids[:3] == [1, 2, 3]
        assert len(set(ids[3:7])) == 1 and VOCAB <= ids[3] < 2**63
    assert ids_a[3] != ids_b[3]
    for content_hash in (0, 2**62 - 1, 2**62, 2**128 - 1):
        assert 151936 <= pad_value(content_hash, 151936) < 2**63
    torch.tensor(ids_a, dtype=torch.int64)  # usable as a key tensor


# ---- disabled ------------------------------------------------------------------------------------------


def test_a_disabled_cache_matches_nothing_and_keeps_nothing():
    cache = make_cache(disable=True)
    assert cache.insert([1, 2, 3], cache.allocator.alloc(3)) == 0
    match = cache.match_prefix([1, 2, 3])
    assert match.indices.numel() == 0 and match.last_node is cache.root
    assert cache.total_size() == 0 and cache.root.children == {}


# ---- requests ------------------------------------------------------------------------------------------


def computed_req(cache: RadixCache, rid: str, ids: list[int], output_ids: list[int] = ()) -> Req:
    """A request whose prompt (and all outputs but the last) were computed into its own fresh slots,
    with no prefix taken from the cache."""
    req = Req(rid, list(ids), SamplingParams(), output_ids=list(output_ids))
    (req.req_pool_idx,) = cache.req_to_token_pool.alloc(1)
    req.kv_len = req.seq_len - (1 if output_ids else 0)
    cache.req_to_token_pool.write(req.req_pool_idx, 0, cache.allocator.alloc(req.kv_len))
    req.last_node = cache.root
    return req


def row_slots(cache: RadixCache, req: Req) -> list[int]:
    return cache.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()


def test_a_finished_request_hands_its_kv_to_the_tree_and_frees_its_row(cache):
    req = computed_req(cache, "a", [1, 2, 3, 4, 5])
    slots = row_slots(cache, req)
    rows_before = cache.req_to_token_pool.available_size()
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 5 and cache.protected_size() == 0
    assert slots_of(cache, [1, 2, 3, 4, 5]) == slots
    assert cache.req_to_token_pool.available_size() == rows_before + 1
    assert req.req_pool_idx is None and req.last_node is None and req.kv_len == 0
    assert_every_slot_accounted_for(cache)


def test_a_finished_request_caches_only_computed_tokens(cache):
    req = computed_req(cache, "a", [1, 2, 3], output_ids=[4, 5])  # token 5 was sampled, not computed
    cache.cache_finished_req(req)
    assert cache.total_size() == 4
    assert len(slots_of(cache, [1, 2, 3, 4, 5])) == 4
    assert_every_slot_accounted_for(cache)


def test_a_finished_request_frees_its_duplicates_of_a_prefix_cached_first(cache):
    first = computed_req(cache, "first", [1, 2, 3, 4, 5, 6])
    first_slots = row_slots(cache, first)
    second = computed_req(cache, "second", [1, 2, 3, 4, 5, 6, 7, 8])  # computed the same prefix again
    second_slots = row_slots(cache, second)
    cache.cache_finished_req(first)
    cache.cache_finished_req(second)
    assert slots_of(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == first_slots + second_slots[6:]
    assert cache.total_size() == 8
    assert_every_slot_accounted_for(cache)  # the six duplicate slots went back to the allocator


def test_a_finished_request_with_a_partial_last_page_frees_that_page():
    cache = make_cache(page_size=4)
    req = computed_req(cache, "a", [1, 2, 3, 4, 5, 6])
    cache.cache_finished_req(req)
    assert cache.total_size() == 4
    assert_every_slot_accounted_for(cache)


def test_an_unfinished_request_shares_and_locks_its_prefix(cache):
    req = computed_req(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    own = row_slots(cache, req)
    other = computed_req(cache, "other", [1, 2, 3, 4])  # cached the same start while `req` ran
    other_slots = row_slots(cache, other)
    cache.cache_finished_req(other)
    cache.cache_unfinished_req(req)
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert req.prefix_indices.tolist() == other_slots + own[4:]
    assert row_slots(cache, req) == req.prefix_indices.tolist()  # its row now points at the tree's slots
    assert req.last_node.key == [5, 6, 7, 8] and req.last_node.lock_ref == 1
    assert req.req_pool_idx is not None
    assert_every_slot_accounted_for(cache)  # its duplicate of [1, 2, 3, 4] was freed
    assert cache.evict(100) == 0  # locked: nothing can go


def test_an_unfinished_request_then_finishing_releases_every_lock(cache):
    req = computed_req(cache, "a", [1, 2, 3, 4, 5])
    cache.cache_unfinished_req(req)
    # decode one token: its KV goes into a fresh slot of the request's row
    req.output_ids.append(6)
    cache.req_to_token_pool.write(req.req_pool_idx, req.kv_len, cache.allocator.alloc(1))
    req.kv_len += 1
    req.output_ids.append(7)  # sampled, not computed yet
    cache.cache_finished_req(req)
    assert all(n == 0 for n in cache.lock_counts())
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    assert len(slots_of(cache, [1, 2, 3, 4, 5, 6, 7])) == 6
    assert_every_slot_accounted_for(cache)


def test_a_disabled_cache_frees_a_finished_requests_kv():
    cache = make_cache(disable=True)
    req = computed_req(cache, "a", [1, 2, 3, 4])
    cache.cache_unfinished_req(req)
    assert cache.total_size() == 0 and req.prefix_indices.numel() == 0
    cache.cache_finished_req(req)
    assert cache.allocator.available_size() == cache.allocator.size
    assert cache.req_to_token_pool.available_size() == 4
