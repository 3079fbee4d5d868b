"""LoRA on a linear layer: one base GEMM for the whole batch, and for the rows that go through an adapter that
adapter's low-rank product added to it (S-LoRA and Punica's idea): every run of rows in one call of a
segmented kernel (C on CPU, Triton on CUDA), or torch GEMMs with the rows grouped by adapter, one product
per adapter however its requests are spread.

A layer's adapters sit in slots: `A` (slots, parts x max_rank, in) and `B` (slots, out, parts x max_rank),
the adapter's scaling folded into `B`. A fused projection (q/k/v, gate/up) holds each part's adapter in its
own block of ranks, so its `B` is block-diagonal. Each tensor-parallel shard keeps its part, cut as the base
weight is: `B`'s rows on a column-parallel layer, `A`'s columns on a row-parallel one (whose partial
products the all-reduce then sums with the base's)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import lora_cpu, lora_triton


@dataclass(frozen=True)
class LoRABatch:
    """Which adapter slot each run of a forward's rows goes through: (first row, end row, slot); rows in
    no run use the base alone."""

    segments: tuple[tuple[int, int, int], ...]

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, slice | torch.Tensor], ...]:
        """Each slot's rows, for one product per adapter: a slice where they are one run, else their indices
        (worked out once per batch, on first use)."""
        runs: dict[int, list[tuple[int, int]]] = {}
        for start, end, slot in self.segments:
            runs.setdefault(slot, []).append((start, end))
        return tuple(
            (slot, slice(*spans[0]) if len(spans) == 1 else torch.cat([torch.arange(a, b) for a, b in spans]))
            for slot, spans in runs.items()
        )

    def row_slots(self, num_rows: int) -> torch.Tensor:
        """Each of the batch's `num_rows` rows' slot (-1: the base)."""
        slots = torch.full((num_rows,), -1, dtype=torch.long)
        for start, end, slot in self.segments:
            slots[start:end] = slot
        return slots

    @classmethod
    def of_runs(cls, lengths: list[int], slots: list[int]) -> LoRABatch | None:
        """From each request's rows in the batch (`lengths`, back to back) and its slot (-1: the base)."""
        segments, start = [], 0
        for n, slot in zip(lengths, slots, strict=True):
            if slot >= 0 and n:
                if segments and segments[-1][1] == start and segments[-1][2] == slot:
                    segments[-1] = (segments[-1][0], start + n, slot)
                else:
                    segments.append((start, start + n, slot))
            start += n
        return cls(tuple(segments)) if segments else None

    @classmethod
    def of_rows(cls, row_slots: list[int]) -> LoRABatch | None:
        """From each row's slot (-1: the base); None when every row uses the base."""
        segments, start = [], 0
        for i in range(1, len(row_slots) + 1):
            if i == len(row_slots) or row_slots[i] != row_slots[start]:
                if row_slots[start] >= 0:
                    segments.append((start, i, row_slots[start]))
                start = i
        return cls(tuple(segments)) if segments else None


LORA_BATCH: ContextVar[LoRABatch | None] = ContextVar("lora_batch", default=None)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """The adapters of the forward run inside (None: the base alone)."""
    token = LORA_BATCH.set(batch)
    try:
        yield
    finally:
        LORA_BATCH.reset(token)


PARTS = {"q": 0, "k": 1, "v": 2, None: 0}  # a fused projection's part -> its block of ranks (gate/up: 0, 1)


class LoRASlots:
    """A linear layer's adapters, one per slot (see the module's docstring)."""

    def __init__(self, linear, num_slots: int, max_rank: int, num_parts: int) -> None:
        """`linear`: the LinearBase it belongs to (not imported: it imports this module)."""
        self.linear = linear
        self.max_rank = max_rank
        dtype, device = torch.float32, linear.device
        self.A = torch.zeros(num_slots, num_parts * max_rank, linear.in_features, dtype=dtype, device=device)
        self.B = torch.zeros(num_slots, linear.out_features, num_parts * max_rank, dtype=dtype, device=device)

    def set(self, slot: int, shard_id: int | str | None, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """One part's adapter (checkpoint tensors: `a` (rank, in), `b` (out, rank)) into `slot`, this shard's
        cut of it."""
        rank, (rows, columns) = a.shape[0], self.linear.checkpoint_shape(shard_id)
        if a.shape[1] != columns or b.shape != (rows, rank):
            raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} for a ({rows}, {columns}) weight")
        first = shard_id if isinstance(shard_id, int) else PARTS[shard_id]
        ranks = slice(first * self.max_rank, first * self.max_rank + rank)
        here, count, there = self.linear.rows(shard_id)
        a = a.narrow(1, self.linear.columns(), self.linear.in_features)
        self.A[slot, ranks] = a.to(self.A.dtype)
        self.B[slot, here : here + count, ranks] = (b.narrow(0, there, count) * scaling).to(self.B.dtype)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[slot].zero_()

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """`y` (the base's output for `x`) with each run of rows' adapter product added (in place)."""
        if batch.segments[-1][1] > x.shape[0]:  # (counts that do not match the batch would adapt wrong rows)
            raise RuntimeError(f"LoRA runs cover rows up to {batch.segments[-1][1]}, the batch has {x.shape[0]}")
        add_products(x, y, self.A, self.B, batch)
        return y


def add_products(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, batch: LoRABatch) -> None:
    """y[rows] += (x[rows] @ A[slot].T) @ B[slot].T for each run of `batch`: through the C kernel on CPU, the
    Triton one on CUDA, else one pair of torch GEMMs per slot (its rows gathered where they are not one run)."""
    if x.is_cpu and x.dtype in lora_cpu.DTYPES and y.dtype == x.dtype and lora_cpu.available():
        lora_cpu.add_lora(x, y, A, B, batch.segments)
        return
    if x.is_cuda and y.dtype == x.dtype and lora_triton.available():
        lora_triton.add_lora(x, y, A, B, batch.segments)
        return
    for slot, rows in batch.groups:
        if isinstance(rows, slice):
            y[rows] += ((x[rows].to(A.dtype) @ A[slot].T) @ B[slot].T).to(y.dtype)
        else:
            rows = rows.to(x.device)
            delta = (x.index_select(0, rows).to(A.dtype) @ A[slot].T) @ B[slot].T
            y.index_add_(0, rows, delta.to(y.dtype))
