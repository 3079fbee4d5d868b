"""Block-scaled FP8 weights times activations on CUDA: a Triton GEMM that reads the e4m3 weights as stored
(one byte each), scales them in registers and multiplies in the activations' dtype with float32 sums.

A weight-only ("W8A16") product: the activations stay bfloat16 rather than being quantized per token
group as vLLM's and SGLang's W8A8 FP8 GEMMs do. At decode batch sizes, where reading the weights bounds
the step, it reads what those read; at prefill sizes it runs at bfloat16's tensor-core rate instead of
FP8's. It takes the scales as `LinearBase` keeps them: one per row per block of `block_cols` columns,
the shard's first column `offset` columns into its block (`quantization.shard_scales`).

Selected automatically for FP8 layers on CUDA; on CPU the C kernels read FP8 instead. The tests run it
through Triton's interpreter (`TRITON_INTERPRET=1`) on CPU, which checks its arithmetic, not its speed.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (no Triton: FP8 layers on CUDA dequantize per call)
    triton = None

if triton is not None:

    @triton.jit
    def _fp8_linear_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, offset, stride_xm, stride_wn, stride_sn, stride_ym,
        BLOCK_COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
            block = (ks + offset) // BLOCK_COLS
            s = tl.load(s_ptr + cols[:, None] * stride_sn + block[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(x, tl.trans((w * s).to(x.dtype)))
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def available() -> bool:
    return triton is not None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor, block_cols: int, offset: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x (..., K) @ the real weight (N, K).T + bias, in x's dtype: `weight` float8_e4m3fn, its real value
    `weight * row_scales[n, (k + offset) // block_cols]`."""
    lead, (n, k) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    bm = 16 if x2.shape[0] <= 16 else 64
    grid = (triton.cdiv(x2.shape[0], bm), triton.cdiv(n, 64))
    _fp8_linear_kernel[grid](
        x2, weight, row_scales, y, x2.shape[0], n, k, offset, x2.stride(0), weight.stride(0), row_scales.stride(0),
        y.stride(0), BLOCK_COLS=block_cols, BM=bm, BN=64, BK=64,
    )  # fmt: skip
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)
