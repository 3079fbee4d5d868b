"""Paged causal attention through attention_cpu.c: float32 on CPU, the whole batch in one call per layer."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, CpuKernel, KernelLibrary, scratch

LIBRARY = KernelLibrary(
    "attention_cpu",
    {
        "attention_scratch_floats": (I64, I64),
        "paged_attention_f32": (
            None,
            PTR,
            PTR,
            PTR,
            PTR,
            I64,
            PTR,
            PTR,
            PTR,
            I64,
            I64,
            I64,
            I64,
            F32,
            PTR,
            I64,
            PTR,
            I64,
            PTR,
            I64,
            PTR,
            PTR,
            I32,
        ),
    },
)


def supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs this KV cache: float32, a head size a multiple of the vector width, and a
    kernel built."""
    if dtype != torch.float32:
        return False
    kernel = LIBRARY.get()
    return kernel is not None and head_dim % kernel.lanes == 0


@dataclass
class PagedBatch:
    """A batch's requests as the kernel reads them, made once per batch and read by every layer."""

    kernel: CpuKernel
    kv_slots: torch.Tensor  # (batch, >= max seq len) int32: request b's tokens are at kv_slots[b, :seq_lens[b]]
    seq_lens: torch.Tensor  # (batch,) int64: tokens per request, new ones included
    ext_lens: torch.Tensor  # (batch,) int64: new tokens per request (its last ones)
    q_starts: torch.Tensor  # (batch,) int64: each request's first row of q
    new_slots: torch.Tensor  # (new tokens,) int64: where their K/V go

    def work(self, head_dim: int) -> tuple[torch.Tensor, int]:
        """Scratch for the calling thread's OpenMP threads, and how many there are: torch's setting where
        the forward runs, not where the batch was made (under overlap the scheduler's thread runs with one)."""
        threads = torch.get_num_threads()
        return scratch(threads * _scratch_floats(self.kernel, head_dim), torch.float32), threads


def paged_batch(
    kv_slots: torch.Tensor, seq_lens: list[int], ext_lens: list[int], new_slots: torch.Tensor
) -> PagedBatch:
    """The PagedBatch of requests with `seq_lens` tokens each, the last `ext_lens` of them new (their K/V
    to be written at `new_slots`), their tokens' slots in the rows of kv_slots."""
    lens = torch.tensor([seq_lens, ext_lens, list(itertools.accumulate(ext_lens[:-1], initial=0))], dtype=torch.int64)
    slots = new_slots.to(torch.int64).contiguous()
    return PagedBatch(LIBRARY.get(), kv_slots.to(torch.int32), lens[0], lens[1], lens[2], slots)


@functools.cache
def _scratch_floats(kernel: CpuKernel, head_dim: int) -> int:
    return kernel.attention_scratch_floats(head_dim)


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim): the new tokens, request after request
    k_new: torch.Tensor,  # (tokens, kv_heads, head_dim): their K and V
    v_new: torch.Tensor,
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
) -> torch.Tensor:
    """Each new token's attention over its request's tokens up to itself, (tokens, heads, head_dim), with
    the new tokens' K/V written to the caches first (in the same call). k_new and v_new may be views
    whose token rows lie apart (v inside the qkv output)."""
    if not q.is_contiguous():
        q = q.contiguous()
    k_new, v_new = _rows_contiguous(k_new, k_cache.dtype), _rows_contiguous(v_new, v_cache.dtype)
    out = torch.empty_like(q)
    tokens, heads, head_dim = q.shape
    batch.kernel.paged_attention_f32(
        q,
        k_cache,
        v_cache,
        batch.kv_slots,
        batch.kv_slots.stride(0),
        batch.seq_lens,
        batch.ext_lens,
        batch.q_starts,
        batch.seq_lens.numel(),
        heads,
        k_cache.shape[1],
        head_dim,
        scale,
        k_new,
        k_new.stride(0),
        v_new,
        v_new.stride(0),
        batch.new_slots,
        tokens,
        out,
        *batch.work(head_dim),
    )
    return out


def _rows_contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (tokens, heads, head_dim) in `dtype`, each token's row contiguous (rows may lie apart)."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
