"""RMSNorm as Qwen3 computes it (in float32, scaled after casting back)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_serve.llm.kernels import rowwise_cpu
from vlm_serve.llm.layers.rotary import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rowwise_cpu.supported(x):
            return rowwise_cpu.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def with_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The normed heads of q or k, (tokens, heads, head_dim), rotated by their tokens' cos and sin."""
        if rowwise_cpu.supported(x):
            return rowwise_cpu.rms_norm(x, self.weight, self.eps, cos, sin)
        return apply_rotary(self(x), cos, sin)
