"""The integer formats' packings, read into one form: a weight's unsigned codes (out, in) as uint8, its scales
(out, groups) and zero points (out, groups), so that W = (codes - zero) * scale per group of input columns
(`IntScheme`). What each checkpoint stores, for W [out, in] with b-bit codes (32 / b to an int32 word,
the first in the lowest bits):

- compressed-tensors `pack-quantized`: `weight_packed` (out, in * b / 32) int32, codes packed along `in`;
  `weight_scale` (out, groups); `weight_zero_point` (out * b / 32, groups) int32, packed along `out`
  (asymmetric only); `weight_shape` [out, in]; `weight_g_idx` (in) with actorder "group". The codes are
  the signed values offset by 2^(b-1), the zero points too. `int-quantized`: `weight` (out, in) int8
  (signed), `weight_scale` (out, 1).
- AutoAWQ GEMM: `qweight` (in, out / 8) int32, packed along `out` in the order 0, 2, 4, 6, 1, 3, 5, 7
  (the word's nibble i holds column AWQ_ORDER[i] of its 8); `qzeros` (groups, out / 8) the same way;
  `scales` (groups, out).
- GPTQ: `qweight` (in * b / 32, out) int32, packed along `in`; `qzeros` (groups, out * b / 32) packed
  along `out`, each zero point stored less one in the original format ("gptq"; "gptq_v2" stores it as
  is); `scales` (groups, out); `g_idx` (in), each input column's group.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of its 8 that nibble i of an AWQ word holds
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble of an AWQ word holding column j


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words (..., n) as their 32 / bits codes each, lowest bits first: uint8 (..., n * 32 / bits)."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed codes come in int32 words, not {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).to(torch.uint8)


def ct_codes(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """compressed-tensors' `weight_packed` (rows, words) as codes (rows, columns)."""
    return _columns(unpack_words(packed, bits), columns, "weight_packed")


def ct_zeros(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """compressed-tensors' `weight_zero_point` (rows * bits / 32, groups), packed along the rows, as (rows, groups)."""
    return _columns(unpack_words(packed.T, bits), rows, "weight_zero_point").T.to(torch.int16)


def int8_codes(weight: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `int-quantized` int8 weight as codes with zero point 128."""
    if weight.dtype != torch.int8:
        raise ValueError(f"an int-quantized weight is int8, not {weight.dtype}")
    return (weight.to(torch.int16) + 128).to(torch.uint8)


def awq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's `qweight` or `qzeros` (rows, out / 8) as codes (out, rows): the weight's (out, in) codes, or
    the zero points (out, groups) (`.to(torch.int16)`, as every format's zero points are)."""
    codes = unpack_words(qweight, 4).unflatten(-1, (-1, 8))[..., list(AWQ_COLUMN_NIBBLE)]
    return codes.flatten(-2).T


def gptq_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's `qweight` (in * bits / 32, out), packed along `in`, as codes (out, in)."""
    return unpack_words(qweight.T, bits)


def gptq_zeros(qzeros: torch.Tensor, bits: int, plus_one: bool) -> torch.Tensor:
    """GPTQ's `qzeros` (groups, out * bits / 32) as zero points (out, groups): one more than stored in the
    original format (`plus_one`), which stores z - 1 (so that z = 0 reads back as 2^bits)."""
    return unpack_words(qzeros, bits).T.to(torch.int16) + int(plus_one)


def _columns(codes: torch.Tensor, columns: int, name: str) -> torch.Tensor:
    if codes.shape[-1] < columns or codes.shape[-1] - columns >= 32:
        raise ValueError(f"{name} holds {codes.shape[-1]} codes a row, not the {columns} of the weight")
    return codes[..., :columns]


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | int, group_size: int | None, dtype=torch.float32
) -> torch.Tensor:
    """The real weight (..., out, in): (codes - zero) * scale, a scale and zero point (..., out, groups) per
    `group_size` columns (None: one per row; an int zero: the same for all), computed in float32."""
    columns = codes.shape[-1]
    if isinstance(zero, torch.Tensor):
        zero = _per_column(zero.float(), group_size, columns)
    return ((codes.float() - zero) * _per_column(scale.float(), group_size, columns)).to(dtype)


def _per_column(values: torch.Tensor, group_size: int | None, columns: int) -> torch.Tensor:
    if group_size is None:
        return values[..., :1]
    return values.repeat_interleave(group_size, dim=-1)[..., :columns]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (..., n), n even, two to a byte, the even column in the low nibble: (..., n / 2) uint8."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
