"""FP8 weights as the published block-quantized checkpoints hold them, and back to float32: the oracle for
the kernels that read them; and x as the kernels multiply it by bfloat16 weights."""

from __future__ import annotations

import torch

from vlm_serve.llm.kernels import CpuKernel

E4M3 = torch.float8_e4m3fn


def quantize_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., out, in) float32 weights as e4m3 values and a float32 scale per block x block block
    (weight_scale_inv: (..., ceil(out / block), ceil(in / block)), the block's largest magnitude / 448;
    the last blocks partial where out or in is not a multiple of the block)."""
    *stack, out, inp = weight.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = weight.new_zeros(*stack, rows * block, cols * block)
    padded[..., :out, :inp] = weight
    blocks = padded.unflatten(-2, (rows, block)).unflatten(-1, (cols, block))
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448
    q = (blocks / scale[..., :, None, :, None]).to(E4M3).flatten(-4, -3).flatten(-2, -1)
    return q[..., :out, :inp].contiguous(), scale


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
    offset: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """The float32 weight: FP8 values times their block's scale, the weight starting at `offset` in its
    first block (as `linear_cpu.pack` takes them)."""
    if scale is None:
        return weight.float()
    *_, out, inp = weight.shape
    per = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return weight.float() * per[..., offset[0] : offset[0] + out, offset[1] : offset[1] + inp]


def every_value(dtype: torch.dtype, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, cols) weights in `dtype` holding every finite value of e4m3 (subnormals, zeros of both
    signs and the largest included; rows * cols >= 254), or those of bfloat16 and float16's values
    that fit (the extremes and subnormals first, then random finite ones), shuffled."""
    bits = torch.iinfo(torch.int16 if dtype.itemsize == 2 else torch.uint8)
    codes = torch.arange(bits.min, bits.max + 1, dtype=torch.int32)
    finite = torch.isfinite(codes.to(torch.int16 if dtype.itemsize == 2 else torch.uint8).view(dtype).float())
    codes = codes[finite]
    if dtype.itemsize == 2:  # the extremes and subnormals first
        magnitude = codes & 0x7FFF
        exponent = magnitude >> (7 if dtype == torch.bfloat16 else 10)
        edges = (exponent == 0) | (magnitude == magnitude.max()) | (exponent == 1)
        codes = torch.cat([codes[edges][torch.randperm(int(edges.sum()), generator=generator)], codes[~edges]])
    picks = codes[torch.randint(len(codes), (rows * cols,), generator=generator)]
    n = min(len(codes), rows * cols)
    picks[:n] = codes[:n]
    store = torch.int16 if dtype.itemsize == 2 else torch.uint8
    return picks[torch.randperm(rows * cols, generator=generator)].to(store).view(dtype).reshape(rows, cols)


def as_multiplied(x: torch.Tensor, dtype: torch.dtype, kernel: CpuKernel) -> torch.Tensor:
    """x as `kernel` multiplies it by weights of `dtype`: rounded to bfloat16 (to nearest even) for
    bfloat16 weights where the kernel has AVX-512-BF16's dot products (tiles.h's BF16_DOT), else as it is."""
    return x.to(torch.bfloat16).to(x.dtype) if dtype == torch.bfloat16 and kernel.bf16_dot else x


def within_bfloat16_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y = x @ weight.T to within what rounding x to bfloat16 may change: each term by 2^-9 of its
    magnitude, the sum by 2^-9 of |x| @ |weight|.T (here 2^-8, for float32's rounding on top)."""
    exact = x.double() @ weight.double().T
    assert ((y.double() - exact).abs() <= 2**-8 * (x.double().abs() @ weight.double().abs().T)).all()
