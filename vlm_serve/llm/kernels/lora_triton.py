"""Batched LoRA products on CUDA through Triton, the operation lora_cpu computes on CPU: each run of a batch's
rows gets its adapter slot's `(x @ A[slot].T) @ B[slot].T` added to y in place, every run in two launches.

A shrink kernel computes t = x @ A[slot].T for tiles of one segment's rows (all ranks at once, the `in`
dimension streamed), and an expand kernel adds t @ B[slot].T to y, a tile of rows by a block of outputs
each. The tiles (first row, end row, slot) are laid out on the host, where the segments are, and copied
over with the launch. Products are float32 throughout (`ieee` dots, not TF32), y rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlm_serve.llm.kernels.lora_cpu import check_operands

try:
    import triton
    import triton.language as tl
except ImportError:  # (no Triton: LoRA on CUDA goes through torch's GEMMs)
    triton = None

if triton is not None:

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        t_ptr,
        tiles_ptr,
        K,
        rank,
        stride_xm,
        stride_as,
        stride_ar,
        stride_tm,
        BM: tl.constexpr,
        BR: tl.constexpr,
        BK: tl.constexpr,
    ):
        # t[rows, :BR] = x[rows] @ A[slot, :rank].T for the tile's rows (ranks past `rank` 0)
        row0 = tl.load(tiles_ptr + 3 * tl.program_id(0))
        end = tl.load(tiles_ptr + 3 * tl.program_id(0) + 1)
        slot = tl.load(tiles_ptr + 3 * tl.program_id(0) + 2).to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        ranks = tl.arange(0, BR)
        acc = tl.zeros((BM, BR), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                mask=(rows[:, None] < end) & (ks[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            a = tl.load(
                a_ptr + slot * stride_as + ranks[None, :] * stride_ar + ks[:, None],
                mask=(ranks[None, :] < rank) & (ks[:, None] < K),
                other=0.0,
            )
            acc += tl.dot(x, a, input_precision="ieee")
        tl.store(t_ptr + rows[:, None].to(tl.int64) * stride_tm + ranks[None, :], acc, mask=rows[:, None] < end)

    @triton.jit
    def _expand_kernel(
        t_ptr,
        b_ptr,
        y_ptr,
        tiles_ptr,
        N,
        rank,
        stride_tm,
        stride_bs,
        stride_bn,
        stride_ym,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BR: tl.constexpr,
    ):
        # y[rows, cols] += t[rows] @ B[slot, cols, :rank].T, summed in float32 and rounded once
        row0 = tl.load(tiles_ptr + 3 * tl.program_id(0))
        end = tl.load(tiles_ptr + 3 * tl.program_id(0) + 1)
        slot = tl.load(tiles_ptr + 3 * tl.program_id(0) + 2).to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ranks = tl.arange(0, BR)
        t = tl.load(
            t_ptr + rows[:, None].to(tl.int64) * stride_tm + ranks[None, :], mask=rows[:, None] < end, other=0.0
        )
        b = tl.load(
            b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
            mask=(ranks[:, None] < rank) & (cols[None, :] < N),
            other=0.0,
        )
        delta = tl.dot(t, b, input_precision="ieee")
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        y_at = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


BN, BK = 64, 64


def available() -> bool:
    """Whether Triton is installed and torch sees a CUDA device."""
    return triton is not None and torch.cuda.is_available()


def add_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    rank: int | None = None,
) -> None:
    """y[start:end] += (x[start:end] @ A[slot, :rank].T) @ B[slot, :, :rank].T for each (start, end, slot) of
    `segments` (non-overlapping), summed in float32 and rounded once into y's dtype; other rows of y are left
    alone. x (rows, in) and y (rows, out): float32 or bfloat16, the same, on one CUDA device with A (slots, R,
    in) and B (slots, out, R), float32; `rank`: the leading ranks of R used (all of them if None)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    rows, inp, out, rank = check_operands(x, y, A, B, rank, "cuda")
    if rank == 0:
        return
    longest = _check_segments(segments, rows, A.shape[0])
    if longest == 0:
        return
    bm = 16 if longest <= 16 else 64
    tiles = torch.tensor(
        [(r0, end, slot) for start, end, slot in segments for r0 in range(start, end, bm)], dtype=torch.int32
    ).to(x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    target = y if y.stride(-1) == 1 else y.contiguous()
    A, B = A.contiguous(), B.contiguous()
    br = max(16, triton.next_power_of_2(rank))
    t = torch.empty(rows, br, dtype=torch.float32, device=x.device)
    count = tiles.shape[0]
    _shrink_kernel[(count,)](
        x, A, t, tiles, inp, rank, x.stride(0), A.stride(0), A.stride(1), t.stride(0), BM=bm, BR=br, BK=BK
    )
    _expand_kernel[(count, triton.cdiv(out, BN))](
        t, B, target, tiles, out, rank, t.stride(0), B.stride(0), B.stride(1), target.stride(0), BM=bm, BN=BN, BR=br
    )
    if target is not y:
        y.copy_(target)


def _check_segments(segments: Sequence[tuple[int, int, int]], rows: int, slots: int) -> int:
    """The most rows of a segment; ValueError where one is outside the rows or slots, or two overlap."""
    longest, last_end = 0, 0
    for start, end, slot in sorted(segments):
        if not (0 <= start <= end <= rows and 0 <= slot < slots) or start < last_end:
            raise ValueError(
                f"LoRA segments must lie in the {rows} rows, name slots below {slots} and not overlap: "
                f"{list(segments)[:8]}"
            )
        longest, last_end = max(longest, end - start), end
    return longest
