"""Batched LoRA products on CPU through lora_cpu.c: each run of a batch's rows gets its adapter slot's
`(x @ A[slot].T) @ B[slot].T` added to y in place, every run in one call, with x and y float32 or bfloat16
and the slots' A and B float32 (as `LoRASlots` keeps them)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch

from vlm_serve.llm.kernels import I32, I64, PTR, CpuKernel, KernelLibrary, scratch

LIBRARY = KernelLibrary(
    "lora_cpu",
    {
        "lora_add": (I32, PTR, I64, PTR, I64, I32, I64, I64, I64, PTR, PTR, I64, I64, I64, PTR, I64, PTR, PTR, I32),
        "lora_scratch_floats": (I64, I64, I64, I32),
    },
)
DTYPES = (torch.float32, torch.bfloat16)
_tables = threading.local()  # the last segments passed (a tuple, by identity) and their table


@functools.cache
def kernel() -> CpuKernel | None:
    """The library for this machine (`KernelLibrary.get`), looked up once: a decode step makes a call per
    adapted layer, and the lookup reads the environment."""
    return LIBRARY.get()


def available() -> bool:
    """Whether the kernel is built for this machine."""
    return kernel() is not None


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
    alone. x (rows, in) and y (rows, out): float32 or bfloat16, the same; A (slots, R, in) and B (slots, out,
    R): float32; `rank`: the leading ranks of R used (all of them if None)."""
    lib = kernel()
    if lib is None:
        raise RuntimeError("the lora_cpu kernel is not built here (see the warning logged on loading it)")
    rows, inp, out, rank = check_operands(x, y, A, B, rank, "cpu")
    if not segments or rank == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    target = y if y.stride(-1) == 1 else y.contiguous()
    A, B = A.contiguous(), B.contiguous()
    bf16, threads = int(x.dtype == torch.bfloat16), torch.get_num_threads()
    t = scratch(rows * rank, torch.float32, "lora_t")
    work = scratch(threads * _scratch_floats(lib, inp, rank, bf16), torch.float32, "lora_work")
    args = (target, target.stride(0), bf16, rows, inp, out, A, B, A.shape[0], A.shape[1], rank)
    table = _table(segments)
    code = lib.lora_add(x, x.stride(0), *args, table, len(segments), t, work, threads)
    if code == 2:  # (not in row order: sorted, they must not overlap)
        table = table[table[:, 0].argsort()].contiguous()
        code = lib.lora_add(x, x.stride(0), *args, table, len(segments), t, work, threads)
    if code:
        raise ValueError(
            f"LoRA segments must lie in the {rows} rows, name slots below {A.shape[0]} and not overlap: "
            f"{list(segments)[:8]}"
        )
    if target is not y:
        y.copy_(target)


@functools.lru_cache(maxsize=64)
def _scratch_floats(lib: CpuKernel, inp: int, rank: int, bf16: int) -> int:
    return lib.lora_scratch_floats(inp, rank, bf16)


def _table(segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The segments as an int64 tensor (count, 3); a tuple's kept for the next call with the same tuple."""
    last = getattr(_tables, "last", None)
    if last is not None and last[0] is segments:
        return last[1]
    table = torch.tensor(segments, dtype=torch.int64)
    if isinstance(segments, tuple):
        _tables.last = (segments, table)
    return table


def check_operands(
    x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, rank: int | None, device_type: str
) -> tuple[int, int, int, int]:
    """(rows, in, out, rank) of a segmented product's operands (this kernel's, or lora_triton's on
    `device_type` "cuda"), or ValueError where they do not fit together."""
    if x.dtype not in DTYPES or y.dtype != x.dtype or A.dtype != torch.float32 or B.dtype != torch.float32:
        raise ValueError(
            f"x and y float32 or bfloat16 alike, A and B float32: not {x.dtype, y.dtype, A.dtype, B.dtype}"
        )
    if x.device.type != device_type or not x.device == y.device == A.device == B.device:
        raise ValueError(
            f"the LoRA kernel computes tensors on one {device_type} device: not {x.device, y.device, A.device, B.device}"
        )
    if x.dim() != 2 or y.dim() != 2 or A.dim() != 3 or B.dim() != 3:
        raise ValueError("x and y: (rows, in) and (rows, out); A and B: (slots, R, in) and (slots, out, R)")
    (rows, inp), (slots, ranks, a_in), (b_slots, out, b_ranks) = x.shape, A.shape, B.shape
    if y.shape != (rows, out) or a_in != inp or b_slots != slots or b_ranks != ranks:
        raise ValueError(f"shapes x {tuple(x.shape)}, y {tuple(y.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}")
    rank = ranks if rank is None else rank
    if not 0 <= rank <= ranks:
        raise ValueError(f"rank {rank} of A and B's {ranks}")
    return rows, inp, out, rank
