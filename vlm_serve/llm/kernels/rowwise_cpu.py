"""The decoder layer's row-by-row ops through rowwise_cpu.c: float32 on CPU, every row in one call."""

from __future__ import annotations

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, CpuKernel, KernelLibrary

LIBRARY = KernelLibrary(
    "rowwise_cpu",
    {
        "rms_norm_f32": (None, PTR, I64, I64, I64, I64, PTR, F32, PTR, PTR, PTR, I32),
        "add_rms_norm_f32": (None, PTR, PTR, I64, I64, PTR, F32, PTR, PTR, I32),
        "qk_norm_rope_f32": (None, PTR, I64, I64, I64, I64, I64, PTR, PTR, F32, PTR, PTR, PTR, PTR, I32),
        "silu_and_mul_f32": (None, PTR, I64, I64, PTR, I32),
        "rotate_halves_f32": (None, PTR, I64, I64, I64, I64, PTR, PTR, PTR, I32),
    },
)


def kernel_for(x: torch.Tensor) -> CpuKernel | None:
    """The library, where it runs x's rows: float32 on CPU, and built."""
    return LIBRARY.get() if x.dtype == torch.float32 and x.device.type == "cpu" else None


def rms_norm(
    kernel: CpuKernel,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, then rotated by cos and sin (tokens,
    n) where given; x: (tokens, n) or (tokens, heads, n), read in place where its rows are contiguous (a
    view of q or k inside the qkv output)."""
    shape, n = x.shape, x.shape[-1]
    if x.dim() == 3:  # (tokens, heads, n)
        if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(1) != n):
            x = x.contiguous()
        rows, per, stride = x.shape[0] * x.shape[1], x.shape[1], x.stride(0)
    else:
        x = x.reshape(-1, n)
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, per, stride = x.shape[0], 1, x.stride(0)
    y = torch.empty(shape, dtype=x.dtype)
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    kernel.rms_norm_f32(x, rows, per, stride, n, weight, eps, cos, sin, y, torch.get_num_threads())
    return y


def add_rms_norm(
    kernel: CpuKernel, x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + add, rms_norm(x + add)) in one pass; x and add: (..., n)."""
    x, add = x.contiguous(), add.contiguous()
    total, y = torch.empty_like(x), torch.empty_like(x)
    n = x.shape[-1]
    kernel.add_rms_norm_f32(x, add, x.numel() // n, n, weight, eps, total, y, torch.get_num_threads())
    return total, y


def qk_norm_rope(
    kernel: CpuKernel,
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the qkv output (tokens, (heads + 2 kv_heads) * n), read in place, each head normed with
    its weight and rotated by its token's cos and sin (tokens, n): (tokens, heads, n), (tokens, kv_heads, n)."""
    n, tokens = q_weight.shape[0], qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q, k = torch.empty(tokens, heads, n), torch.empty(tokens, kv_heads, n)
    kernel.qk_norm_rope_f32(
        qkv,
        tokens,
        qkv.stride(0),
        heads,
        kv_heads,
        n,
        q_weight,
        k_weight,
        eps,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k,
        torch.get_num_threads(),
    )
    return q, k


def silu_and_mul(kernel: CpuKernel, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along its last dimension."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    kernel.silu_and_mul_f32(x, x.numel() // (2 * n), n, y, torch.get_num_threads())
    return y


def rotate_halves(
    kernel: CpuKernel, x: torch.Tensor, heads: int, n: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The first `heads` heads of n floats of each row of x (tokens, >= heads * n), read in place, each
    turned by its token's angles (cos and sin: (tokens, n / 2)), dimension j with dimension j + n / 2:
    (tokens, heads, n)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens = x.shape[0]
    y = torch.empty(tokens, heads, n)
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel.rotate_halves_f32(x, tokens, x.stride(0), heads, n, cos, sin, y, torch.get_num_threads())
    return y
