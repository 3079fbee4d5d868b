"""The store of a step's K and V rows into their KV-pool slots on CUDA, in one Triton launch for both
(in torch, an index_put per buffer and a copy per dtype change)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (no Triton: torch's index_put)
    triton = None

if triton is not None:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, k_buf_ptr, v_buf_ptr, slots_ptr, width, stride_k, stride_v, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        slot = tl.load(slots_ptr + token).to(tl.int64)
        tl.store(k_buf_ptr + slot * width + cols, tl.load(k_ptr + token * stride_k + cols, mask=mask), mask=mask)
        tl.store(v_buf_ptr + slot * width + cols, tl.load(v_ptr + token * stride_v + cols, mask=mask), mask=mask)


def store_kv_handles(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether `store_kv` takes these: (tokens, heads, d) rows on CUDA whose heads lie one after another, of
    the buffer's dtype, Triton installed."""
    return (
        triton is not None
        and all(
            t.is_cuda and t.dtype == k_buffer.dtype and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
            for t in (k, v)
        )
        and k_buffer.is_contiguous()
    )


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """k_buffer[slots] = k and v_buffer[slots] = v in one launch; the buffers (slots, heads, d) contiguous."""
    tokens, width = k.shape[0], k.shape[1] * k.shape[2]
    if tokens:
        block = min(triton.next_power_of_2(width), 4096)
        grid = (tokens, triton.cdiv(width, block))
        _store_kv_kernel[grid](k, v, k_buffer, v_buffer, slots, width, k.stride(0), v.stride(0), BLOCK=block)
