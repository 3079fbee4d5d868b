"""The store of a step's K and V rows into their KV-pool slots on CUDA (kv_cache/store_triton.py) writes
those slots and no others, for float32 and bfloat16 rows, rows that are views of wider ones, and no rows.
Compiled on a GPU, else under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest

from helpers import run_triton_script

pytestmark = pytest.mark.server  # its kernel runs in a process of its own

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")

STORE = """
import torch
from vlm_serve.kv_cache import store_triton

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for tokens, heads, d in ((1, 2, 32), (7, 8, 128), (0, 2, 32)):
        k_buffer, v_buffer = torch.randn(20, heads, d).to(dtype), torch.randn(20, heads, d).to(dtype)
        want_k, want_v = k_buffer.clone(), v_buffer.clone()
        slots = torch.randperm(19)[:tokens] + 1
        k = torch.randn(tokens, heads, d).to(dtype)
        v = torch.randn(tokens, heads * d + 24).to(dtype)[:, 5 : 5 + heads * d].view(tokens, heads, d)  # (qkv rows)
        want_k[slots], want_v[slots] = k, v
        store_triton.store_kv(k_buffer, v_buffer, slots, k, v)
        assert torch.equal(k_buffer, want_k) and torch.equal(v_buffer, want_v)
print("ok")
"""


def test_a_steps_k_and_v_rows_go_to_their_slots_and_nowhere_else():
    run_triton_script(STORE)
