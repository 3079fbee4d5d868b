"""Tensor-parallel linear layers.

Each layer holds only its rank's shard and knows how to cut that shard out of a full checkpoint tensor
(`weight_loader`), so weights are sharded while they load and a full copy never sits on a device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.llm.distributed import divide, get_parallel_state, tp_all_reduce
from vlm_serve.llm.kernels import linear_cpu


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # the weight as `prepack` leaves it on CPU: the C kernel's panels (in the weight's dtype), else
        # oneDNN's blocked layout (float32)
        self.panels: linear_cpu.Panels | None = None
        self.packed: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return linear_cpu.linear(x, self.panels, self.bias)
        if self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def prepack(self) -> None:
        self.panels = linear_cpu.pack(self.weight)
        if self.panels is None:
            self.packed = onednn_weight(self.weight)
        if self.panels is not None or self.packed is not None:
            self.weight.data = self.weight.data.new_empty(0)  # (not held twice)


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A loaded (out, in) weight in oneDNN's blocked layout, where matmuls with it are faster: float32 on
    CPU. As vLLM's CPU backend does; on 2 cores, 4096x4096, `F.linear` (MKL) reads 12.7 GB/s of weights
    at 1 row, 5.9 at 16 and 0.4 at 512, oneDNN 16.6, 14.6 and 0.8."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None) if packable(weight) else None


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_weights(model: nn.Module) -> None:
    """Once a model's weights are loaded: every layer that can keeps its weights in the layout its
    matmuls run fastest with (`prepack`)."""
    for module in model.modules():
        if hasattr(module, "prepack"):
            module.prepack()


class ReplicatedLinear(LinearBase):
    """A full copy on every rank (the vision tower, the MoE router)."""


class ColumnParallelLinear(LinearBase):
    """Output features split over the TP ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        super().__init__(in_features, divide(out_features, self.tp_size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); each part is split separately."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        assert isinstance(shard_id, int)
        shard = self.out_sizes[shard_id] // self.tp_size
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, shard).copy_(loaded.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, heads split over the TP ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on the ranks that share it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp_size = get_parallel_state().tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        total = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, total, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp_rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split over the TP ranks; the partial outputs are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        super().__init__(divide(in_features, self.tp_size), out_features, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return tp_all_reduce(y) if self.reduce_results else y
