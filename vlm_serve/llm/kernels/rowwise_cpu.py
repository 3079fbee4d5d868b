"""The decoder layer's row-by-row ops through rowwise_cpu.c: float32 on CPU, every row in one call."""

from __future__ import annotations

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, KernelLibrary

LIBRARY = KernelLibrary(
    "rowwise_cpu",
    {
        "rms_norm_f32": (None, PTR, I64, I64, I64, I64, PTR, F32, PTR, PTR, PTR, I32),
        "silu_and_mul_f32": (None, PTR, I64, I64, PTR, I32),
    },
)


def supported(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and LIBRARY.get() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, then rotated by cos and sin (tokens,
    n) where given; x: (tokens, n) or (tokens, heads, n), read in place where its rows are contiguous (a
    view of q or k inside the qkv output)."""
    shape, n = x.shape, x.shape[-1]
    x = x.unsqueeze(1) if x.dim() == 2 else x.reshape(-1, 1, n) if x.dim() != 3 else x  # (tokens, rows, n)
    if x.stride(-1) != 1 or (x.shape[1] > 1 and x.stride(1) != n):
        x = x.contiguous()
    y = torch.empty(shape, dtype=x.dtype)
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    LIBRARY.get().rms_norm_f32(
        x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), n, weight, eps, cos, sin, y, torch.get_num_threads()
    )
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along its last dimension (contiguous)."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    LIBRARY.get().silu_and_mul_f32(x, x.numel() // (2 * n), n, y, torch.get_num_threads())
    return y

