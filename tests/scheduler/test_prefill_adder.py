"""Admission into a prefill (`PrefillAdder`: its three budgets, chunking, locks) and the order of the
waiting queue (`SchedulePolicy`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch
from vlm_serve.scheduler.schedule_policy import (
    CLIP_MAX_NEW_TOKENS,
    LPM_FALLBACK_QUEUE_LEN,
    AddReqResult,
    PrefillAdder,
    SchedulePolicy,
)

CPU = torch.device("cpu")
_rids = itertools.count()


def make_cache(size: int = 256, page_size: int = 1, disable: bool = False) -> RadixCache:
    req_to_token_pool = ReqToTokenPool(size=8, max_context_len=128, device=CPU)
    return RadixCache(req_to_token_pool, TokenToKVPoolAllocator(size, page_size, CPU), disable)


@pytest.fixture
def cache() -> RadixCache:
    return make_cache()


def cache_key(cache: RadixCache, key: list[int]) -> None:
    """Puts `key` into the tree as if a finished request had computed it."""
    slots = cache.allocator.alloc(len(key))
    cache.allocator.free(slots[: cache.insert(key, slots)])


def waiting(cache: RadixCache, ids: list[int] | int, max_new_tokens: int = 16, **kw) -> Req:
    """A waiting request (`ids` or that many fresh tokens) whose prefix has been matched."""
    ids = list(range(1000, 1000 + ids)) if isinstance(ids, int) else ids
    priority = kw.pop("priority", 0)
    params = SamplingParams(max_new_tokens=max_new_tokens, **kw)
    req = Req(f"req-{next(_rids)}", ids, params, priority=priority)
    req.match_prefix(cache)
    return req


def running(reqs: list[Req], cache: RadixCache) -> ScheduleBatch:
    return ScheduleBatch(reqs, cache.req_to_token_pool, cache.allocator, cache)


def make_adder(
    cache: RadixCache,
    running_reqs: list[Req] = (),
    new_token_ratio: float = 1.0,
    max_prefill_tokens: int = 1000,
    chunked_prefill_size: int | None = None,
    mixed_decode_tokens: int = 0,
) -> PrefillAdder:
    return PrefillAdder(
        cache,
        running(list(running_reqs), cache),
        new_token_ratio,
        max_prefill_tokens,
        chunked_prefill_size,
        mixed_decode_tokens,
    )


def decoding(max_new_tokens: int, generated: int, ignore_eos: bool = False) -> Req:
    req = Req("running", [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))
    req.output_ids = [7] * generated
    return req


# ---- budgets -------------------------------------------------------------------------------------------


def test_with_nothing_running_the_total_budget_is_free_plus_evictable_kv(cache):
    cache_key(cache, list(range(10)))
    cache.allocator.alloc(30)  # held by someone else
    adder = make_adder(cache)
    assert cache.evictable_size() == 10
    assert adder.rem_total_tokens == cache.allocator.available_size() + 10 == 256 - 30


def test_running_requests_reserve_their_clipped_remaining_tokens(cache):
    free = make_adder(cache).rem_total_tokens
    reqs = [
        decoding(max_new_tokens=100, generated=40),  # 60 left
        decoding(max_new_tokens=100_000, generated=10),  # clipped to CLIP_MAX_NEW_TOKENS
        decoding(max_new_tokens=100_000, generated=10, ignore_eos=True),  # all 99_990, unclipped
        decoding(max_new_tokens=10, generated=10),  # nothing left
    ]
    adder = make_adder(cache, reqs, new_token_ratio=0.5)
    assert [adder.reserved_tokens(r) for r in reqs] == [30, CLIP_MAX_NEW_TOKENS // 2, 99_990, 0]
    assert adder.rem_total_tokens == free - (30 + CLIP_MAX_NEW_TOKENS // 2 + 99_990)


def test_mixed_decode_tokens_come_off_every_budget(cache):
    plain = make_adder(cache, max_prefill_tokens=100, chunked_prefill_size=64)
    mixed = make_adder(cache, max_prefill_tokens=100, chunked_prefill_size=64, mixed_decode_tokens=3)
    assert mixed.rem_input_tokens == plain.rem_input_tokens - 3 == 97
    assert mixed.rem_chunk_tokens == plain.rem_chunk_tokens - 3 == 61
    assert mixed.rem_total_tokens == plain.rem_total_tokens - 3


# ---- admission -----------------------------------------------------------------------------------------


def test_a_request_that_fits_is_admitted_whole_and_spends_its_extend_length(cache):
    adder = make_adder(cache, max_prefill_tokens=100, chunked_prefill_size=64)
    total, chunk = adder.rem_total_tokens, adder.rem_chunk_tokens
    req = waiting(cache, 10, max_new_tokens=20)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert adder.can_run_list == [req] and adder.new_chunked_req is None
    assert req.extend_len == 10
    assert adder.rem_input_tokens == 90
    assert adder.rem_chunk_tokens == chunk - 10
    assert adder.rem_total_tokens == total - (10 + 20 + 1)  # prompt, expected outputs, a page


def test_an_admitted_request_locks_its_cached_prefix(cache):
    cache_key(cache, [1, 2, 3, 4, 5, 6])
    req = waiting(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(req.prefix_indices) == 6 and req.extend_len == 2
    adder = make_adder(cache)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    assert req.last_node.lock_ref == 1


def test_a_request_needing_more_than_the_total_budget_gets_no_token_and_no_lock():
    cache = make_cache(size=32)
    cache_key(cache, [1, 2, 3, 4])
    req = waiting(cache, [1, 2, 3, 4] + list(range(10, 30)), max_new_tokens=16)  # 20 + 16 + 1 > 32 - 4
    adder = make_adder(cache)
    assert adder.add_one_req(req) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []
    assert cache.lock_counts() == [0] and cache.protected_size() == 0 and cache.evictable_size() == 4


def test_once_the_input_budget_is_spent_the_next_request_waits_with_other(cache):
    cache_key(cache, [1, 2, 3, 4])
    adder = make_adder(cache, max_prefill_tokens=16)
    first = waiting(cache, 12)
    assert adder.add_one_req(first) == AddReqResult.CONTINUE
    second = waiting(cache, [1, 2, 3, 4] + list(range(10, 18)))  # 8 new tokens > the 4 left
    assert adder.add_one_req(second) == AddReqResult.OTHER
    assert adder.can_run_list == [first]
    assert cache.lock_counts() == [0]  # second's prefix was not locked


def test_a_request_using_up_the_input_budget_ends_the_round(cache):
    adder = make_adder(cache, max_prefill_tokens=16)
    assert adder.add_one_req(waiting(cache, 16)) == AddReqResult.OTHER
    assert len(adder.can_run_list) == 1


def test_the_first_request_is_admitted_even_when_longer_than_max_prefill_tokens(cache):
    adder = make_adder(cache, max_prefill_tokens=8)
    req = waiting(cache, 20)
    assert adder.add_one_req(req) == AddReqResult.OTHER  # admitted; the input budget is spent
    assert adder.can_run_list == [req] and req.extend_len == 20
    assert adder.new_chunked_req is None


def test_a_request_far_above_the_clip_is_admitted_when_the_clip_fits():
    cache = make_cache(size=CLIP_MAX_NEW_TOKENS + 64)
    req = waiting(cache, 10, max_new_tokens=100 * CLIP_MAX_NEW_TOKENS)
    adder = make_adder(cache)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert adder.can_run_list == [req]
    # the same request with ignore_eos will surely generate everything: it does not fit
    eager = waiting(cache, 10, max_new_tokens=100 * CLIP_MAX_NEW_TOKENS, ignore_eos=True)
    assert make_adder(cache).add_one_req(eager) == AddReqResult.NO_TOKEN


# ---- chunked prefill -----------------------------------------------------------------------------------


def test_a_request_longer_than_the_chunk_is_cut_to_whole_pages():
    cache = make_cache(page_size=4)
    adder = make_adder(cache, chunked_prefill_size=11)
    req = waiting(cache, 30)
    assert adder.add_one_req(req) != AddReqResult.NO_TOKEN
    assert adder.can_run_list == [req] and adder.new_chunked_req is req
    assert req.extend_len == 8  # 11 rounded down to whole pages
    assert adder.rem_chunk_tokens == 3


def test_a_request_that_cannot_get_a_whole_page_of_the_chunk_waits_unlocked():
    cache = make_cache(page_size=4)
    cache_key(cache, [1, 2, 3, 4])
    adder = make_adder(cache, chunked_prefill_size=11)
    assert adder.add_one_req(waiting(cache, 8)) == AddReqResult.CONTINUE  # 3 chunk tokens left
    late = waiting(cache, [1, 2, 3, 4] + list(range(10, 20)))
    assert adder.add_one_req(late) == AddReqResult.OTHER
    assert late not in adder.can_run_list and adder.new_chunked_req is None
    assert cache.lock_counts() == [0]


def test_add_chunked_req_returns_the_request_while_chunks_remain():
    cache = make_cache(page_size=4)
    req = waiting(cache, 30)
    make_adder(cache, chunked_prefill_size=11).add_one_req(req)
    chunks, returned = [req.extend_len], []
    while req.kv_len + req.extend_len < req.seq_len:
        req.kv_len += req.extend_len  # the chunk ran
        req.extend_len = req.seq_len - req.kv_len
        adder = make_adder(cache, chunked_prefill_size=11)
        returned.append(adder.add_chunked_req(req))
        chunks.append(req.extend_len)
        assert adder.can_run_list == [req]
    assert chunks == [8, 8, 8, 6]
    assert returned == [req, req, None]  # None once the last chunk is admitted


# ---- policies ------------------------------------------------------------------------------------------


def test_lpm_orders_by_longest_cached_prefix(cache):
    cache_key(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    none = waiting(cache, [50, 51, 52])
    some = waiting(cache, [1, 2, 3, 4, 60, 61])
    most = waiting(cache, [1, 2, 3, 4, 5, 6, 7, 8, 70])
    queue = [none, some, most]
    SchedulePolicy("lpm", cache, enable_priority=False).calc_priority(queue)
    assert queue == [most, some, none]


def test_lpm_falls_back_to_fcfs_for_a_long_queue(cache):
    cache_key(cache, [1, 2, 3, 4])
    queue = [waiting(cache, [90 + i, 1, 2]) for i in range(LPM_FALLBACK_QUEUE_LEN)]
    queue.append(waiting(cache, [1, 2, 3, 4, 5]))
    original = list(queue)
    SchedulePolicy("lpm", cache, enable_priority=False).calc_priority(queue)
    assert queue == original
    del queue[0]  # one request fewer: lpm applies again
    SchedulePolicy("lpm", cache, enable_priority=False).calc_priority(queue)
    assert queue[0] is original[-1]


def test_lof_orders_by_max_new_tokens_descending(cache):
    a, b, c, d = (waiting(cache, 4, max_new_tokens=n) for n in (10, 300, 50, 300))
    queue = [a, b, c, d]
    SchedulePolicy("lof", cache, enable_priority=False).calc_priority(queue)
    assert queue == [b, d, c, a]


def test_random_is_a_permutation(cache):
    queue = [waiting(cache, [i, i + 1]) for i in range(20)]
    original = list(queue)
    SchedulePolicy("random", cache, enable_priority=False, seed=0).calc_priority(queue)
    assert sorted(map(id, queue)) == sorted(map(id, original))
    assert queue != original


@pytest.mark.parametrize("heavy", ["first-cached", "second-cached"])
def test_dfs_weight_groups_requests_sharing_a_prefix_heavier_subtree_first(cache, heavy):
    cache_key(cache, [1, 2, 3, 4])
    cache_key(cache, [5, 6, 7, 8])
    light_prefix, heavy_prefix = (
        ([5, 6, 7, 8], [1, 2, 3, 4]) if heavy == "first-cached" else ([1, 2, 3, 4], [5, 6, 7, 8])
    )
    l1 = waiting(cache, light_prefix + [10, 11])
    h1 = waiting(cache, heavy_prefix + [12, 13])
    fresh = waiting(cache, [40, 41])
    h2 = waiting(cache, heavy_prefix + [14, 15])
    l2 = waiting(cache, light_prefix + [16, 17])
    h3 = waiting(cache, heavy_prefix + [18, 19])
    queue = [l1, h1, fresh, h2, l2, h3]
    SchedulePolicy("dfs-weight", cache, enable_priority=False).calc_priority(queue)
    assert sorted(map(id, queue)) == sorted(map(id, [l1, h1, fresh, h2, l2, h3]))
    # three waiting requests below one cached prefix, two below the other; FCFS within a group
    assert [r for r in queue if r is not fresh] == [h1, h2, h3, l1, l2]


def test_priority_goes_first_and_ties_keep_the_policy_order(cache):
    a, b, c, d = (waiting(cache, 4, max_new_tokens=n, priority=p) for n, p in ((10, 0), (20, 5), (30, 0), (40, 5)))
    queue = [a, b, c, d]
    SchedulePolicy("fcfs", cache, enable_priority=True).calc_priority(queue)
    assert queue == [b, d, a, c]
    SchedulePolicy("lof", cache, enable_priority=True).calc_priority(queue)
    assert queue == [d, b, c, a]


# ---- priority preemption -------------------------------------------------------------------------------


def holding(cache: RadixCache, prompt_len: int, max_new_tokens: int, priority: int) -> Req:
    """A running request whose prompt's KV is allocated (a request row and its slots)."""
    req = waiting(cache, prompt_len, max_new_tokens=max_new_tokens, priority=priority)
    req.req_pool_idx = cache.req_to_token_pool.alloc(1)[0]
    cache.req_to_token_pool.write(req.req_pool_idx, 0, cache.allocator.alloc(prompt_len))
    req.kv_len = prompt_len
    return req


def test_a_high_priority_request_that_does_not_fit_preempts_lower_ones_and_is_admitted_once(cache):
    low = holding(cache, 100, max_new_tokens=50, priority=0)
    batch = running([low], cache)
    adder = PrefillAdder(cache, batch, 1.0, 1000, None, 0)
    high = waiting(cache, 120, max_new_tokens=20, priority=10)  # 141 of the 256 - 100 - 50 left
    result, victims = adder.add_one_req_preempting(high, batch, threshold=0)
    assert victims == [low] and batch.reqs == []
    assert low.req_pool_idx is None and low.kv_len == 0  # its KV went back to the pool
    assert adder.can_run_list == [high] and result == AddReqResult.CONTINUE


def test_a_request_admitted_with_the_last_tokens_of_the_budget_preempts_nobody(cache):
    """Taking the budget's last token answers NO_TOKEN (nothing more fits), though the request was admitted:
    it is not admitted a second time (its KV would be allocated twice), and no one is preempted for it."""
    low = holding(cache, 100, max_new_tokens=50, priority=0)
    batch = running([low], cache)
    adder = PrefillAdder(cache, batch, 1.0, 1000, None, 0)
    high = waiting(cache, adder.rem_total_tokens - 21, max_new_tokens=20, priority=10)  # prompt + outputs + a page
    result, victims = adder.add_one_req_preempting(high, batch, threshold=0)
    assert result == AddReqResult.NO_TOKEN and adder.rem_total_tokens == 0
    assert adder.can_run_list == [high] and victims == [] and batch.reqs == [low]


def test_requests_within_the_threshold_are_not_preempted(cache):
    low = holding(cache, 100, max_new_tokens=50, priority=5)
    batch = running([low], cache)
    adder = PrefillAdder(cache, batch, 1.0, 1000, None, 0)
    high = waiting(cache, 120, max_new_tokens=20, priority=10)
    result, victims = adder.add_one_req_preempting(high, batch, threshold=5)
    assert result == AddReqResult.NO_TOKEN and victims == [] and adder.can_run_list == [] and batch.reqs == [low]


def test_an_unknown_policy_is_rejected(cache):
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulePolicy("shortest-first", cache, enable_priority=False)
