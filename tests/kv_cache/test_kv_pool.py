"""The paged KV slot allocator."""

from __future__ import annotations

import random

import pytest
import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator


def test_page_size_one_hands_out_distinct_slots_and_never_slot_zero():
    alloc = TokenToKVPoolAllocator(size=8, page_size=1, device=torch.device("cpu"))
    slots = alloc.alloc(8)
    assert sorted(slots.tolist()) == list(range(1, 9))
    assert alloc.alloc(1) is None
    alloc.free(slots[:3])
    assert alloc.available_size() == 3


def test_extend_fills_the_last_page_before_taking_a_new_one():
    alloc = TokenToKVPoolAllocator(size=64, page_size=4, device=torch.device("cpu"))
    first = alloc.alloc_extend([0], [6], [0])  # 6 tokens: one full page + 2 slots of the next
    assert first.tolist()[:4] == [first[0].item() + i for i in range(4)]
    assert first[0].item() % 4 == 0 and first[4].item() % 4 == 0
    more = alloc.alloc_extend([6], [11], [first[-1].item()])  # 2 slots finish page two, 3 open page three
    assert more.tolist()[:2] == [first[-1].item() + 1, first[-1].item() + 2]
    assert more[2].item() % 4 == 0
    assert alloc.available_size() == 64 - 3 * 4
    step = alloc.alloc_decode([12], [more[-1].item()])
    assert step.item() == more[-1].item() + 1
    assert alloc.available_size() == 64 - 3 * 4


def test_a_request_that_does_not_fit_takes_nothing():
    alloc = TokenToKVPoolAllocator(size=8, page_size=4, device=torch.device("cpu"))
    assert alloc.alloc_extend([0, 0], [4, 5], [0, 0]) is None
    assert alloc.available_size() == 8


def test_freeing_a_requests_slots_returns_its_pages():
    alloc = TokenToKVPoolAllocator(size=16, page_size=4, device=torch.device("cpu"))
    slots = alloc.alloc_extend([0, 0], [5, 3], [0, 0])
    alloc.free(slots[:5])
    assert alloc.available_size() == 16 - 4
    alloc.free(slots[5:])
    assert alloc.available_size() == 16


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extends_of_many_requests_get_their_own_slots_page_by_page(page_size):
    rng = random.Random(page_size)
    alloc = TokenToKVPoolAllocator(size=4096, page_size=page_size, device=torch.device("cpu"))
    held: dict[int, list[int]] = {}  # request -> its slots, position by position
    for _ in range(20):
        reqs = rng.sample(range(12), rng.randint(1, 5))
        prefix_lens = [len(held.get(r, [])) for r in reqs]
        seq_lens = [p + rng.choice([1, 2, page_size - 1, page_size + 3, 37]) for p in prefix_lens]
        last_locs = [held[r][-1] if held.get(r) else 0 for r in reqs]
        before = alloc.available_size()
        slots = alloc.alloc_extend(prefix_lens, seq_lens, last_locs).tolist()
        assert len(slots) == sum(s - p for p, s in zip(prefix_lens, seq_lens))
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            mine, slots = slots[: s - p], slots[s - p :]
            for position, slot in enumerate(mine, start=p):
                # a page's slots hold consecutive positions: a position starting a page starts a fresh one
                if position % page_size:
                    previous = held[r][-1] if position == p else mine[position - p - 1]
                    assert slot == previous + 1
                else:
                    assert slot % page_size == 0 and slot > 0
            held.setdefault(r, []).extend(mine)
        every = [slot for slots in held.values() for slot in slots]
        assert len(set(every)) == len(every)
        pages_opened = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens))
        assert alloc.available_size() == before - pages_opened * page_size
