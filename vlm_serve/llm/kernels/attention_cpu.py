"""Paged causal attention through attention_cpu.c: float32 on CPU, the whole batch in one call per layer."""

from __future__ import annotations

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, KernelLibrary, scratch

LIBRARY = KernelLibrary(
    "attention_cpu",
    {
        "attention_scratch_floats": (I64, I64),
        "paged_attention_f32": (
            None, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64, I64, I64, I64, F32, PTR, I64, PTR, I64, PTR, I64, PTR,
            PTR, I32,
        ),  # fmt: skip
    },
)


def supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this KV cache: float32, a head size a multiple of the vector width, and a
    kernel built."""
    if dtype != torch.float32:
        return False
    kernel = LIBRARY.get()
    return kernel is not None and head_dim % kernel.lanes == 0


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim): the new tokens, request after request
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,  # (batch, >= max seq len) int32: request b's tokens are at kv_slots[b, :seq_lens[b]]
    seq_lens: torch.Tensor,  # (batch,) int64: tokens per request, new ones included
    ext_lens: torch.Tensor,  # (batch,) int64: new tokens per request (its last ones)
    q_starts: torch.Tensor,  # (batch,) int64: each request's first row of q
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each new token's attention over its request's tokens up to itself, (tokens, heads, head_dim).
    `new_kv`: the new tokens' (k, v, slots), each (tokens, kv_heads, head_dim) and (tokens,) int64, written to
    the caches first (in the same call)."""
    kernel = LIBRARY.get()
    q = q.contiguous()
    out = torch.empty_like(q)
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[1], q.shape[2]
    k_new = v_new = slots = None
    if new_kv is not None:
        k_new, v_new = (_rows_contiguous(part.to(k_cache.dtype)) for part in new_kv[:2])
        slots = new_kv[2].to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    work = scratch(threads * kernel.attention_scratch_floats(head_dim), torch.float32)
    kernel.paged_attention_f32(
        q, k_cache, v_cache, kv_slots, kv_slots.stride(0), seq_lens, ext_lens, q_starts, seq_lens.numel(), heads,
        kv_heads, head_dim, scale, k_new, 0 if k_new is None else k_new.stride(0), v_new,
        0 if v_new is None else v_new.stride(0), slots, 0 if slots is None else slots.numel(), out, work, threads,
    )  # fmt: skip
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x (tokens, heads, head_dim) with each token's row contiguous (rows may lie apart, as in a view of v
    inside the qkv output)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
