"""The gated MLP's activation: silu(gate) * up for x = [gate, up] along its last dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_serve.llm.kernels import rowwise_cpu, rowwise_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    kernel = rowwise_cpu.kernel_for(x)
    if kernel is not None:
        return rowwise_cpu.silu_and_mul(kernel, x)
    if rowwise_triton.handles(x):
        return rowwise_triton.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
