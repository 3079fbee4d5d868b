"""The gated MLP of the Qwen decoders (and of the EAGLE-3 draft head): down(silu(gate) * up), gate and up
fused into one column-parallel projection."""

from __future__ import annotations

import torch
from torch import nn

from vlm_serve.llm.layers.activation import silu_and_mul
from vlm_serve.llm.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
