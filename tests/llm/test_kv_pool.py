"""The paged KV slot allocator."""

from __future__ import annotations

import torch

from vlm_serve.llm.mem_cache.allocator import TokenToKVPoolAllocator


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
