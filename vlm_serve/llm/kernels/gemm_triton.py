"""Weights times activations on CUDA as Triton GEMMs that read the weights as stored: block-scaled FP8
weights (one byte each, scaled in registers, multiplied in the activations' dtype with float32 sums),
4- and 8-bit integer codes with a scale and zero point per group (W4A16, W8A16: dequantized in registers;
W8A8: int8 times the activations rounded to int8 per row, summed in int32), and a grouped GEMM of experts,
each expert's rows by its weights (FP8, integer or half precision).

FP8 is a weight-only ("W8A16") product: the activations stay bfloat16 rather than being quantized per token
group as vLLM's and SGLang's W8A8 FP8 GEMMs do. At decode batch sizes, where reading the weights bounds
the step, it reads what those read; at prefill sizes it runs at bfloat16's tensor-core rate instead of
FP8's. It takes the scales as `LinearBase` keeps them: one per row per block of `block_cols` columns,
the shard's first column `offset` columns into its block (`quantization.shard_scales`).

Selected automatically for FP8 layers on CUDA; on CPU the C kernels read FP8 instead. The grouped GEMM of
half-precision experts (`grouped_linear`, tiles of 16 rows at decode sizes, as fused MoE kernels take) is
measured against torch's grouped GEMM by the GPU kit before either is chosen over the other. The tests run
the kernels through Triton's interpreter (`TRITON_INTERPRET=1`) on CPU, which checks their arithmetic, not
their speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # (no Triton: FP8 layers on CUDA dequantize per call)
    triton = None

if triton is not None:

    @triton.jit
    def _gemm_kernel(
        x_ptr,
        xs_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        tile_expert_ptr,
        tile_row0_ptr,
        ends_ptr,
        M,
        N,
        K,
        offset,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ym,
        GROUPED: tl.constexpr,
        SCALED: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        ZERO: tl.constexpr,
        HAS_ZERO: tl.constexpr,
        I8: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        # a tile of BM rows of x: of one expert's rows where GROUPED (tile t: expert tile_expert[t], rows
        # from tile_row0[t] up to that expert's end), else rows t * BM ... of the one weight. The weights:
        # as stored (BITS 0; FP8 with its block scales where SCALED), or integer codes (BITS 4 or 8: (N, K *
        # BITS / 8) bytes, 4-bit ones two to a byte, the even column low) with scales and zero points (N,
        # groups) of GROUP columns; I8 (W8A8): x holds int8 rows and xs their scales, the weights symmetric
        # int8 (codes - 128) with one scale a row, summed in int32
        k_end = K
        if GROUPED:
            expert = tl.load(tile_expert_ptr + tl.program_id(0))
            rows = tl.load(tile_row0_ptr + tl.program_id(0)) + tl.arange(0, BM)
            # a tile past the last expert's rows (expert -1): no loads, no stores
            end = tl.where(expert >= 0, tl.load(ends_ptr + tl.maximum(expert, 0)), 0)
            k_end = tl.where(expert >= 0, K, 0)
            e = tl.maximum(expert, 0).to(tl.int64)
            w_ptr += e * stride_we
            if SCALED or BITS > 0:
                s_ptr += e * stride_se
            if HAS_ZERO:
                z_ptr += e * stride_se
        else:
            rows = tl.program_id(0) * BM + tl.arange(0, BM)
            end = M
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if I8:
            acc = tl.zeros((BM, BN), dtype=tl.int32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k_end, BK):
            ks = k0 + tl.arange(0, BK)
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=(rows[:, None] < end) & (ks[None, :] < K),
                other=0,
            )
            w_mask = (cols[:, None] < N) & (ks[None, :] < K)
            if BITS == 0:
                w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
                if SCALED:  # (FP8: each weight times its row's scale of its block of columns)
                    block = (ks + offset) // BLOCK_COLS
                    s = tl.load(s_ptr + cols[:, None] * stride_sn + block[None, :], mask=w_mask, other=0.0)
                    w = w.to(tl.float32) * s
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
            else:
                if BITS == 4:
                    byte = tl.load(w_ptr + cols[:, None] * stride_wn + (ks // 2)[None, :], mask=w_mask, other=0)
                    q = (byte.to(tl.int32) >> ((ks % 2) * 4)[None, :]) & 0xF
                else:
                    q = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0).to(tl.int32)
                if I8:
                    acc += tl.dot(x, tl.trans((q - 128).to(tl.int8)))
                else:
                    g = ks // GROUP
                    s = tl.load(s_ptr + cols[:, None] * stride_sn + g[None, :], mask=w_mask, other=0.0)
                    if HAS_ZERO:
                        z = tl.load(z_ptr + cols[:, None] * stride_sn + g[None, :], mask=w_mask, other=0)
                        w = (q.to(tl.float32) - z.to(tl.float32)) * s
                    else:
                        w = (q.to(tl.float32) - ZERO) * s
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if I8:  # (one scale per row of x and per weight row)
            sx = tl.load(xs_ptr + rows, mask=rows < end, other=0.0)
            sw = tl.load(s_ptr + cols * stride_sn, mask=cols < N, other=0.0)
            out = acc.to(tl.float32) * sx[:, None] * sw[None, :]
        else:
            out = acc
        tl.store(
            y_ptr + rows[:, None] * stride_ym + cols[None, :],
            out.to(y_ptr.dtype.element_ty),
            mask=(rows[:, None] < end) & (cols[None, :] < N),
        )


def available() -> bool:
    return triton is not None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_scales: torch.Tensor,
    block_cols: int,
    offset: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., K) @ the real weight (N, K).T + bias, in x's dtype: `weight` float8_e4m3fn, its real value
    `weight * row_scales[n, (k + offset) // block_cols]`."""
    lead, (n, k) = x.shape[:-1], weight.shape
    y = _gemm(_rows(x.reshape(-1, k)), weight.unsqueeze(0), row_scales.unsqueeze(0), None, None, k, offset, block_cols)
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)


def fp8_grouped_linear(
    xs: torch.Tensor, weights: torch.Tensor, row_scales: torch.Tensor, ends: torch.Tensor, block_cols: int, offset: int
) -> torch.Tensor:
    """Rows of xs (R, K) grouped by expert, rows ends[e - 1] ... ends[e] (int32 cumulative counts, on the
    device) times expert e's real weight (N, K).T: `weights` (E, N, K) float8_e4m3fn, `row_scales` (E, N,
    K blocks) as `fp8_linear` takes them. Rows past ends[-1] are left unwritten. No host sync: the tiles
    are laid out on the device, as many launched as the most the rows could need."""
    return _gemm(_rows(xs), weights, row_scales, None, ends, weights.shape[2], offset, block_cols)


def grouped_linear(xs: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`fp8_grouped_linear` of weights (E, N, K) in a half-precision dtype, read as they are."""
    return _gemm(_rows(xs), weights, None, None, ends, weights.shape[2])


def int_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    int8_activations: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., K) @ the real weight (N, K).T + bias, in x's dtype, of integer codes as `layers.quantized.IntWeight`
    holds them: codes (N, K * bits / 8) uint8 (4-bit: two to a byte), scales and zero points (N, groups) of
    `group_size` columns (None: per row; zero None: 2^(bits - 1)). `int8_activations` (W8A8): each row of
    x rounded to int8 first, the product summed in int32."""
    lead, n, k = x.shape[:-1], codes.shape[0], codes.shape[1] * 8 // bits
    zero = None if zero is None else zero.unsqueeze(0)
    form = IntForm(bits, group_size or k, int8_activations)
    y = _gemm(_rows(x.reshape(-1, k)), codes.unsqueeze(0), scale.unsqueeze(0), zero, None, k, form=form)
    if bias is not None:
        y += bias
    return y.reshape(*lead, n)


def int_grouped_linear(
    xs: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    ends: torch.Tensor,
    int8_activations: bool = False,
) -> torch.Tensor:
    """`fp8_grouped_linear` of integer experts: codes (E, N, K * bits / 8), scales and zero points (E, N,
    groups), as `int_linear` takes one expert's."""
    k = codes.shape[2] * 8 // bits
    return _gemm(_rows(xs), codes, scale, zero, ends, k, form=IntForm(bits, group_size or k, int8_activations))


@dataclass(frozen=True)
class IntForm:
    """Integer weights as `_gemm_kernel` reads them."""

    bits: int
    group: int  # columns per scale
    int8_activations: bool


def _gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None,
    ends: torch.Tensor | None,
    k: int,
    offset: int = 0,
    block_cols: int = 1,
    form: IntForm | None = None,
) -> torch.Tensor:
    """x (M, K) times weights (E, N, ...): expert 0's (E = 1, `ends` None) or, grouped by `ends`, each
    expert's rows by its own."""
    experts, n = weights.shape[:2]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    row_scales = None
    if form is not None and form.int8_activations:  # (dynamic, symmetric, per row: compressed-tensors' `token`)
        row_scales = x.float().abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        x = torch.round(x.float() / row_scales[:, None]).clamp(-128, 127).to(torch.int8)
    bm = _tile_rows(x.shape[0])
    tile_expert = tile_row0 = None
    tiles = triton.cdiv(x.shape[0], bm)
    if ends is not None:
        tile_expert, tile_row0 = _expert_tiles(ends, bm, tiles + experts)
        tiles = tile_expert.shape[0]
    _gemm_kernel[(tiles, triton.cdiv(n, BN))](
        x,
        row_scales,
        weights,
        scales,
        zeros,
        y,
        tile_expert,
        tile_row0,
        ends,
        x.shape[0],
        n,
        k,
        offset,
        x.stride(0),
        weights.stride(0),
        weights.stride(1),
        scales.stride(0) if scales is not None else 0,
        scales.stride(1) if scales is not None else 0,
        y.stride(0),
        GROUPED=ends is not None,
        SCALED=scales is not None and form is None,
        BLOCK_COLS=block_cols,
        BITS=0 if form is None else form.bits,
        GROUP=1 if form is None else form.group,
        ZERO=0 if form is None else 1 << (form.bits - 1),
        HAS_ZERO=zeros is not None,
        I8=form is not None and form.int8_activations,
        BM=bm,
        BN=BN,
        BK=BK,
    )
    return y


BN, BK = 64, 64


def _tile_rows(rows: int) -> int:
    return 16 if rows <= 16 else 64


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _expert_tiles(ends: torch.Tensor, bm: int, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `most` tiles of bm rows: each one's expert (-1 past the last expert's rows) and first row, every
    expert's rows cut into tiles of their own."""
    ends = ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + bm - 1) // bm
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(most, device=ends.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    inside = expert < ends.shape[0]
    expert = torch.where(inside, expert, 0)
    row0 = starts[expert] + (t - (tile_ends - tiles)[expert]) * bm
    return torch.where(inside, expert, -1).to(torch.int32), row0.to(torch.int32)
