"""Block-wise FP8 weights, as Qwen's FP8 checkpoints store them (`Qwen/Qwen3-VL-235B-A22B-Instruct-FP8`, the
dense `Qwen/Qwen3-VL-8B-Instruct-FP8`, ...): the checkpoint's `quantization_config` and the block arithmetic.

A quantized Linear weight `W [out, in]` is stored as `<name>.weight` in `float8_e4m3fn` plus
`<name>.weight_scale_inv`, float32 `[ceil(out / 128), ceil(in / 128)]`: one scale per 128 x 128 block, the
last row and column of blocks partial where a dimension is not a multiple of 128. The real weight is the
FP8 value times its block's scale; the quantizer picks the scale as `amax(|block|) / 448` (448 is e4m3's
largest value), so every block uses the whole e4m3 range. This is the "fine-grained FP8" format of
DeepSeek-V3 and Qwen; transformers reads it with `FineGrainedFP8Config`, vLLM and SGLang with `Fp8Config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's `quantization_config` with `quant_method: "fp8"` (block-wise e4m3, dynamic activations).

    `modules_to_not_convert` lists the Linear modules the checkpoint keeps unquantized (bf16), by name.
    """

    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, config: dict) -> Fp8Config:
        """Reads `config.json`'s `quantization_config`; refuses what this project cannot serve, by name."""
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported (supported: 'e4m3')")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"activation_scheme {scheme!r} is not supported (supported: 'dynamic')")
        scale_fmt = config.get("scale_fmt")
        if scale_fmt not in (None, "float"):
            raise ValueError(f"scale_fmt {scale_fmt!r} is not supported (float32 scales only)")
        block = config.get("weight_block_size")
        if block is None:
            raise ValueError("FP8 without weight_block_size (per-tensor scales) is not supported")
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
        return cls(tuple(block), tuple(config.get("modules_to_not_convert") or ()))

    def to_dict(self) -> dict:
        """The `quantization_config` as Qwen's FP8 checkpoints write it (keys sorted, as transformers does)."""
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "quant_method": "fp8",
            "weight_block_size": list(self.weight_block_size),
        }

    def is_quantized(self, module_name: str) -> bool:
        """Whether the Linear module `module_name` (checkpoint name, without `.weight`) is stored in FP8.

        An entry of `modules_to_not_convert` names a module exactly (Qwen lists every one:
        `model.visual.blocks.0.attn.qkv`, `model.language_model.layers.0.mlp.gate`, `lm_head`), the modules
        under it (`model.visual`), or, without its leading path, every module whose name ends with it
        (`mlp.gate`). Matches are whole name components, never substrings: `mlp.gate` leaves `mlp.gate_proj`
        quantized and `layers.1` leaves `layers.11` quantized. (vLLM matches exact names or substrings,
        by method and version; SGLang module-path boundaries; transformers module-path prefixes, regexes
        and plain suffixes: on the exact names the published checkpoints list, all agree.) Norms and
        embeddings are never FP8.
        """
        return not any(
            module_name == entry or module_name.startswith(entry + ".") or module_name.endswith("." + entry)
            for entry in self.modules_to_not_convert
        )

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """Shape of `weight_scale_inv` for a `[out_features, in_features]` weight (partial blocks count)."""
        rows, cols = self.weight_block_size
        return math.ceil(out_features / rows), math.ceil(in_features / cols)


def quantize_fp8_blocks(
    weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(fp8 weight, float32 weight_scale_inv)` of `weight [..., out, in]`, one scale per block.

    Leading dimensions (a stack of experts) are quantized independently. A block of zeros gets scale 1.
    """
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block_size
    n_rows, n_cols = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = weight.float()
    if (n_rows * block_rows, n_cols * block_cols) != (rows, cols):
        # Zero padding completes the partial blocks without changing their amax.
        padded = F.pad(padded, (0, n_cols * block_cols - cols, 0, n_rows * block_rows - rows))
    blocks = padded.unflatten(-1, (n_cols, block_cols)).unflatten(-3, (n_rows, block_rows))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., n_rows, n_cols]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.reshape(*weight.shape[:-2], n_rows * block_rows, n_cols * block_cols)
    return quantized[..., :rows, :cols].contiguous(), scale


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The real weight: each FP8 value times its block's scale, computed in float32, returned in `dtype`."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block_size
    expected = (*weight.shape[:-2], math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected}")
    scale = scale_inv.float().repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return (weight.float() * scale[..., :rows, :cols]).to(dtype)


def row_scales(scale: torch.Tensor, rows: int, block_rows: int = 128, offset: int = 0) -> torch.Tensor:
    """Block scales (..., row blocks, column blocks) per row of a shard of `rows` rows starting at
    `offset` in its first block: (..., rows, column blocks), for `linear_cpu.pack` with block (1, block
    columns)."""
    return scale.repeat_interleave(block_rows, dim=-2)[..., offset : offset + rows, :]


def shard_scale(
    scale: torch.Tensor, rows: tuple[int, int], columns: tuple[int, int], block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, tuple[int, int]]:
    """For the shard weight[..., rows[0] : rows[1], columns[0] : columns[1]] of a checkpoint tensor whose
    block scales are `scale` (..., row blocks, column blocks): the scales that cover the shard and its
    offset into its first block, as `linear_cpu.pack` takes them."""
    (r0, r1), (c0, c1) = rows, columns
    cut = scale[..., r0 // block[0] : -(-r1 // block[0]), c0 // block[1] : -(-c1 // block[1])]
    return cut, (r0 % block[0], c0 % block[1])


def shard_scales(
    scale_inv: torch.Tensor, block_size: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]
) -> tuple[torch.Tensor, int]:
    """A shard's scales, rows `[start, start + size)` and columns `[start, start + size)` of a checkpoint
    weight whose `weight_scale_inv` is `scale_inv`: one scale per row of the shard (a shard, or gate and
    up stacked, may start inside a block of rows) for each block of columns the shard touches, and where
    the shard's first column sits in its block. (`[..., rows, blocks]`, offset)"""
    (row0, nrows), (col0, ncols) = rows, cols
    cut, (row_offset, col_offset) = shard_scale(
        scale_inv.float(), (row0, row0 + nrows), (col0, col0 + ncols), block_size
    )
    return row_scales(cut, nrows, block_size[0], row_offset).contiguous(), col_offset


def dequantize_rows(
    weight: torch.Tensor, row_scales: torch.Tensor, block_cols: int, offset: int, dtype: torch.dtype
) -> torch.Tensor:
    """The real weight of an FP8 shard whose scales `shard_scales` gave (`[..., rows, blocks]`, `offset`)."""
    scale = row_scales.repeat_interleave(block_cols, dim=-1)[..., offset : offset + weight.shape[-1]]
    return (weight.float() * scale).to(dtype)
