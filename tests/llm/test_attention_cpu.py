"""The CPU attention kernel (attention_cpu.c) computes, for every new token of every request, what SDPA
computes over that request's K/V gathered out of the paged pool with a causal mask: decode (one new
token), prefill on top of a cached prefix, and both in one batch; for every grouping of query heads over
KV heads and head size the Qwen3-VL family uses; on every ISA the kernel is built for (cpu_targets.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_serve.kv_cache.memory_pool import KVPoolLayout, ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.kernels import attention_cpu
from vlm_serve.llm.layers.attention import CpuAttnBackend, TorchAttnBackend, create_attention_backend


def reference(q, k_cache, v_cache, kv_slots, seq_lens, ext_lens, scale):
    out, start = torch.empty_like(q), 0
    for slots, n, e in zip(kv_slots, seq_lens.tolist(), ext_lens.tolist()):
        keys = k_cache[slots[:n].long()].transpose(0, 1)[None]
        values = v_cache[slots[:n].long()].transpose(0, 1)[None]
        query = q[start : start + e].transpose(0, 1)[None]
        causal = torch.arange(n)[None, :] <= torch.arange(n - e, n)[:, None]
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=causal, scale=scale, enable_gqa=True)
        out[start : start + e] = o[0].transpose(0, 1)
        start += e
    return out


def attend(heads, kv_heads, head_dim, seq_lens, ext_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_total = 4 * sum(seq_lens) + 64
    k_cache = torch.randn(slots_total, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(slots_total, kv_heads, head_dim, generator=g)
    # scattered slots, rows longer than the sequences (as req_to_token rows are)
    kv_slots = torch.stack([torch.randperm(slots_total, generator=g)[: max(seq_lens) + 5] for _ in seq_lens]).int()
    seq, ext = torch.tensor(seq_lens), torch.tensor(ext_lens)
    q = torch.randn(int(ext.sum()), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    want = reference(q, k_cache, v_cache, kv_slots, seq, ext, scale)
    return run(q, k_cache, v_cache, kv_slots, seq_lens, ext_lens, scale), want


def run(q, k_cache, v_cache, kv_slots, seq_lens, ext_lens, scale):
    """The kernel, with the new tokens' K/V (written first) the values their slots already hold."""
    new_slots = torch.cat([row[n - e : n] for row, n, e in zip(kv_slots, seq_lens, ext_lens)]).long()
    batch = attention_cpu.paged_batch(kv_slots, seq_lens, ext_lens, new_slots)
    return attention_cpu.paged_attention(q, k_cache[new_slots], v_cache[new_slots], k_cache, v_cache, batch, scale)


GEOMETRIES = [(4, 2, 32), (8, 2, 64), (16, 4, 64), (32, 4, 128), (64, 4, 128), (4, 4, 16)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", GEOMETRIES)
def test_decode_attends_over_each_requests_whole_sequence(heads, kv_heads, head_dim, kernel_target):
    got, want = attend(heads, kv_heads, head_dim, seq_lens=[1, 7, 64, 65, 300], ext_lens=[1] * 5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads,head_dim", GEOMETRIES)
def test_prefill_on_a_cached_prefix_is_causal(heads, kv_heads, head_dim, kernel_target):
    # no prefix, a prefix ending inside a key block, prefill and decode rows in one batch (mixed chunks)
    got, want = attend(heads, kv_heads, head_dim, seq_lens=[130, 200, 9, 77], ext_lens=[130, 70, 1, 1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_head_size_of_whole_vectors_but_not_whole_panels(kernel_target):
    """V then goes through panels one vector wide."""
    kernel = attention_cpu.LIBRARY.get()
    head_dim = kernel.panel + kernel.lanes
    got, want = attend(8, 2, head_dim, seq_lens=[70, 9, 40], ext_lens=[70, 1, 12])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_large_scores_do_not_overflow(kernel_target):
    """Scores in the hundreds (softmax of exp(s - max), never exp(s))."""
    g = torch.Generator().manual_seed(3)
    k_cache = 30 * torch.randn(50, 2, 64, generator=g)
    q = 30 * torch.randn(40, 8, 64, generator=g)
    kv_slots = torch.arange(50, dtype=torch.int32)[None]
    seq, ext = torch.tensor([50]), torch.tensor([40])
    want = reference(q, k_cache, k_cache, kv_slots, seq, ext, 1.0)
    got = run(q, k_cache, k_cache, kv_slots, [50], [40], 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def pools(dtype=torch.float32, head_dim=64):
    cpu = torch.device("cpu")
    return ReqToTokenPool(4, 128, cpu), TokenToKVPool(256, KVPoolLayout(1, 2, head_dim, 1, dtype), cpu)


def test_auto_picks_the_kernel_for_float32_on_cpu_and_torch_where_it_cannot_run(native_kernels):
    assert isinstance(create_attention_backend("auto", *pools(), 8, 2, 64, 0.125), CpuAttnBackend)
    assert isinstance(create_attention_backend("auto", *pools(torch.bfloat16), 8, 2, 64, 0.125), TorchAttnBackend)
    # (42: not a whole number of vectors on any ISA)
    assert isinstance(create_attention_backend("auto", *pools(head_dim=42), 8, 2, 42, 0.125), TorchAttnBackend)
    with pytest.raises(ValueError, match="head size 42"):
        create_attention_backend("cpu", *pools(head_dim=42), 8, 2, 42, 0.125)


def test_the_new_tokens_kv_is_written_to_the_pool_in_the_same_call(kernel_target):
    """What the backend hands the kernel: the new tokens' k (contiguous) and v (a view inside the qkv
    output), stored at their slots before the attention reads them."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, tokens = 8, 2, 64, 5
    k_cache, v_cache = torch.randn(64, kv_heads, d, generator=g), torch.randn(64, kv_heads, d, generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = (part.view(tokens, -1, d) for part in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1))
    k = k.contiguous()
    kv_slots = torch.tensor([[7, 3, 40, 12, 9, 30, 31, 50]], dtype=torch.int32)  # the last 5 are new
    seq, ext = torch.tensor([8]), torch.tensor([tokens])
    new_slots = kv_slots[0, 3:].long()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[new_slots], want_v[new_slots] = k, v
    want = reference(q, want_k, want_v, kv_slots, seq, ext, d**-0.5)
    batch = attention_cpu.paged_batch(kv_slots, [8], [tokens], new_slots)
    got = attention_cpu.paged_attention(q, k, v, k_cache, v_cache, batch, d**-0.5)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
