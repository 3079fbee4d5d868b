"""RMSNorm as Qwen3 computes it (in float32, scaled after casting back)."""

from __future__ import annotations

import torch
from torch import nn

from vlm_serve.llm.kernels import CpuKernel, rowwise_cpu, rowwise_triton
from vlm_serve.llm.layers.rotary import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.rowwise: CpuKernel | bool | None = None  # the C kernel, from the first float32 CPU input (False: none)

    def kernel_for(self, x: torch.Tensor) -> CpuKernel | None:
        """The C kernel where it norms x (float32 on CPU); looked up once, at the first such x."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if self.rowwise is None:
            self.rowwise = rowwise_cpu.kernel_for(x) or False
        return self.rowwise or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel_for(x)
        if kernel is not None:
            return rowwise_cpu.rms_norm(kernel, x, self.weight, self.eps)
        if rowwise_triton.handles(x):
            return rowwise_triton.rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, residual: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it): the residual stream after a sublayer's output x is added, and
        the next sublayer's input. No residual: x is the stream."""
        if residual is None:
            return x, self(x)
        kernel = self.kernel_for(x)
        if kernel is not None and residual.dtype == x.dtype:
            return rowwise_cpu.add_rms_norm(kernel, residual, x, self.weight, self.eps)
        if rowwise_triton.handles(x) and rowwise_triton.handles(residual) and residual.dtype == x.dtype:
            normed, stream = rowwise_triton.rms_norm(x, self.weight, self.eps, residual)
            return stream, normed
        residual = residual + x
        return residual, self(residual)

    def with_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The normed heads of q or k, (tokens, heads, head_dim), rotated by their tokens' cos and sin."""
        kernel = self.kernel_for(x)
        if kernel is not None:
            return rowwise_cpu.rms_norm(kernel, x, self.weight, self.eps, cos, sin)
        return apply_rotary(self(x), cos, sin)


def qkv_heads(
    qkv: torch.Tensor, heads: int, kv_heads: int, q_norm: RMSNorm, k_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of the qkv projection's output (tokens, (heads + 2 kv_heads) * head_dim) as (tokens,
    heads or kv_heads, head_dim), q and k normed by their norms and rotated (Qwen3's QK norm): on CPU in
    one kernel call for both (on CUDA in one Triton launch)."""
    tokens, d = qkv.shape[0], q_norm.weight.shape[0]
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    kernel = q_norm.kernel_for(qkv)
    if kernel is not None and q_norm.eps == k_norm.eps:
        q, k = rowwise_cpu.qk_norm_rope(
            kernel, qkv, heads, kv_heads, q_norm.weight, k_norm.weight, q_norm.eps, cos, sin
        )
        return q, k, v
    if rowwise_triton.qk_norm_rope_handles(qkv, d, cos, sin) and q_norm.eps == k_norm.eps:
        q, k = rowwise_triton.qk_norm_rope(qkv, heads, kv_heads, q_norm.weight, k_norm.weight, q_norm.eps, cos, sin)
        return q, k, v
    q = q_norm.with_rotary(qkv[:, : heads * d].view(tokens, heads, d), cos, sin)
    k = k_norm.with_rotary(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d), cos, sin)
    return q, k, v
