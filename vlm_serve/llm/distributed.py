"""Process groups for tensor and expert parallelism.

Layers ask this module for their rank and group size and call its collectives. With one rank (the
default) every collective is the identity, so the same model code runs single-process and sharded.
Expert parallel ranks are laid over the tensor parallel ranks: with TP 8 / EP 8 every rank holds its
attention shard and one eighth of the experts; with TP 8 / EP 2 each expert's intermediate dimension is
also split over 4 ranks. Every rank sees every token, so one all-reduce over the TP group combines both
the row-parallel partial sums and the experts' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    tp_group: dist.ProcessGroup | None = None  # the model's collectives (NCCL on GPU)
    # the scheduler's broadcasts, in groups of their own as a forward may run at the same time: objects
    # over gloo, and tensors (vision embeddings) over the device's backend (the same gloo group on CPU)
    tp_cpu_group: dist.ProcessGroup | None = None
    tp_broadcast_group: dist.ProcessGroup | None = None

    @property
    def moe_tp_size(self) -> int:
        """Ranks that share one expert's intermediate dimension."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size


_state = ParallelState()


def init_parallel_state(tp_size: int = 1, ep_size: int = 1) -> ParallelState:
    """Sets the groups from an already initialised default process group (or one rank when there is none)."""
    global _state
    if tp_size % ep_size != 0:
        raise ValueError(f"ep_size {ep_size} must divide tp_size {tp_size}")
    if tp_size == 1:
        _state = ParallelState()
        return _state
    if not dist.is_initialized():
        raise RuntimeError("tp_size > 1 needs torch.distributed to be initialised first")
    if dist.get_world_size() != tp_size:
        raise ValueError(f"world size {dist.get_world_size()} does not match tp_size {tp_size}")
    ranks = list(range(tp_size))
    cpu_group = dist.new_group(ranks, backend="gloo")
    broadcast_group = cpu_group if dist.get_backend() == "gloo" else dist.new_group(ranks)
    _state = ParallelState(dist.get_rank(), tp_size, ep_size, dist.new_group(ranks), cpu_group, broadcast_group)
    return _state


def get_parallel_state() -> ParallelState:
    return _state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every TP rank's `x` along `dim` (rank order)."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator
