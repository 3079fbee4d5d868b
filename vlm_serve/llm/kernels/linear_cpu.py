"""Linear layers through linear_cpu.c on CPU: the weight packed once into column panels in its own format
(float32, bfloat16, float16, FP8 e4m3 with block scales, or 4- and 8-bit integer codes with a scale and zero
point per group: `pack_int`), read as stored and summed in float32.

FP8 weights come as the published block-quantized checkpoints hold them: float8_e4m3fn (out, in) and a
float32 `weight_scale_inv` with one scale per `block` (128 x 128): the weight is the fp8 value times its
block's scale. A tensor-parallel shard is a slice of such a weight that may start inside a block: `pack`
takes the scale rows and columns that cover the shard, ceil((offset + size) / block) of each, and the
shard's offset into its first block (its first row and column modulo the block size):
`quantization.shard_scale` cuts them out of the checkpoint's. A weight made of several shards side by
side (q, k and v; gate and up) gives its scales per row (`quantization.row_scales`), concatenated, with
block (1, block columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import I32, I64, PTR, STR, CpuKernel, KernelLibrary
from vlm_serve.quantization import row_scales

WEIGHT = (PTR, PTR, I64, I64, I64, I32)  # tiles.h's WEIGHT_ARGS: the panels, then their Layout's args
LIBRARY = KernelLibrary(
    "linear_cpu",
    {
        "linear_forward": (None, PTR, I64, I64, I64, I32, *WEIGHT, I64, I32, PTR, PTR, I32),
        "kernel_int8_dot": (STR,),  # W8A8's products: the instructions int8.h took
    },
)

FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}  # tiles.h's W_*
INT_FORMATS = {4: 4, 8: 5}  # integer codes by their bits: tiles.h's W_U4, W_U8
W_I8 = 6  # int8 weights times int8 activations (W8A8): int8.h
E4M3_SHIFT = 2.0**120  # e4m3's bits placed in a float32 read as its value / 2^120 (tiles.h)
BLOCK = (128, 128)  # the published FP8 checkpoints' weight_block_size


@dataclass
class Layout:
    """How a weight, or a stack of them, lies in panels (tiles.h's Weights, less the data)."""

    width: int  # output columns per panel
    # FP8: (..., out / width, k blocks) float32, each panel's block scales * 2^120; integer codes: bytes,
    # (..., out / width, k blocks, width * (scale bytes + 1)), each panel's scales, then zero points
    scale: torch.Tensor | None
    first: int  # input rows (k) of the first scale block; all of them (rounded up to groups) without scales
    block: int  # input rows of each later block
    lead: int  # zero rows before the first (the first block ends on a group of 4 rows)
    scale_format: int = 0  # integer codes: their scales' format (FORMATS: float32, bfloat16, float16)

    def args(self) -> tuple:
        return self.scale, self.first, self.block, self.lead, self.scale_format


@dataclass
class Panels:
    """An (out, in) weight in a kernel library's column panels, and that library."""

    kernel: CpuKernel
    weight: torch.Tensor  # (out / width, groups of k, width, G), the weight's dtype (CpuKernel.panels)
    inp: int
    layout: Layout
    features: int  # the weight's outputs: `out` less the zero rows that make it whole vectors
    format: int | None = None  # tiles.h's W_*; None: the weight's dtype's (FORMATS)

    def __post_init__(self) -> None:
        count, _, width, *_ = self.weight.shape
        self.out = count * width
        if self.format is None:
            self.format = FORMATS[self.weight.dtype]
        # the kernel's arguments after x's: read once, not at every call
        self.args = (self.format, self.weight, *self.layout.args(), self.out, width)


def pack(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] = BLOCK,
    offset: tuple[int, int] = (0, 0),
) -> Panels | None:
    """An (out, in) weight in column panels in its own dtype (float32, bfloat16, float16 or
    float8_e4m3fn); None where the kernel cannot run it (another dtype or device, FP8 panels that would
    straddle scale blocks or an FP8 `out` not a multiple of the vector width, no kernel built). Other
    weights get zero rows up to whole vectors (a router of 8 experts): their products are the kernel's
    too, each row's the same whatever the rows around it, where oneDNN's change with the batch's size.

    FP8: `scale` (the checkpoint's weight_scale_inv, float32) has one scale per block of `block` (rows,
    columns) weights, ceil((offset + out or in) / block) of them each way, and `offset` is where the
    weight starts in its first block (a shard's first row and column modulo the block size); no `scale`
    is scale 1. Other dtypes take no scale."""
    check_scale(weight, scale, block, offset)
    if weight.device.type != "cpu" or weight.dtype not in FORMATS or weight.dim() != 2:
        return None
    kernel = LIBRARY.get()
    if kernel is None:
        return None
    features = weight.shape[0]
    if features % kernel.lanes and weight.dtype != torch.float8_e4m3fn:
        weight = torch.cat([weight.detach(), weight.new_zeros(-features % kernel.lanes, weight.shape[1])])
    layout = panel_layout(kernel, weight, scale, block, offset)
    if layout is None:
        return None
    return Panels(kernel, kernel.panels(weight, layout.width, layout.lead), weight.shape[1], layout, features)


def pack_int(
    codes: torch.Tensor,
    bits: int,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int | None,
    int8_activations: bool = False,
) -> Panels | None:
    """Integer codes as `layers.quantized.IntWeight` holds them (out, in * bits / 8) uint8, 4-bit ones two to a
    byte (the even column low), with their scales (out, groups) and zero points (out, groups; None: 2^(bits - 1))
    per `group_size` input columns (None: per row), in column panels (`int_panels`); None where the kernel
    is not built, the weight is not on CPU or a zero point does not fit the kernel's byte (`fits_bytes`).
    With `int8_activations` (W8A8: symmetric 8-bit codes per channel) the kernel rounds each row of x to int8
    and sums in int32 (int8.h)."""
    if codes.device.type != "cpu" or codes.dim() != 2 or not fits_bytes(zero):
        return None
    kernel = LIBRARY.get()
    if kernel is None:
        return None
    features = codes.shape[0]
    codes, scale, zero = pad_rows(kernel, codes, scale, zero)
    weight, layout = int_panels(kernel, codes, bits, scale, zero, group_size, int8_activations)
    form = W_I8 if int8_activations else INT_FORMATS[bits]
    return Panels(kernel, weight, codes.shape[1] * 8 // bits, layout, features, form)


def pad_rows(
    kernel: CpuKernel, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Integer codes, scales and zero points with zero rows up to whole vectors (weights of 0)."""
    missing = -codes.shape[-2] % kernel.lanes
    if not missing:
        return codes, scale, zero
    pad = torch.nn.functional.pad
    return (
        pad(codes, (0, 0, 0, missing)),
        pad(scale, (0, 0, 0, missing)),
        None if zero is None else pad(zero, (0, 0, 0, missing)),
    )


def fits_bytes(zero: torch.Tensor | None) -> bool:
    """Whether zero points are bytes, as the kernels hold them (GPTQ's first format can store an 8-bit zero point
    of 256)."""
    return zero is None or bool(((zero >= 0) & (zero <= 255)).all())


SCALE_FORMATS = {torch.bfloat16: 1, torch.float16: 2}  # integer scales held as stored (tiles.h); others: float32


def int_panels(
    kernel: CpuKernel,
    codes: torch.Tensor,
    bits: int,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int | None,
    int8_activations: bool = False,
) -> tuple[torch.Tensor, Layout]:
    """Integer weights (..., out, in * bits / 8) as tiles.h's W_U4 / W_U8 panels (..., out / width, groups
    of k, width) of 32-bit lanes, each a column's 32 / bits consecutive rows of k (what the packed bytes
    already hold: 4 of them side by side), and their layout: per panel and block of k (a group, or all of
    k), the columns' scales in their own dtype where it is 16-bit (else float32), then their zero points, a
    byte each. For W8A8 (`int8_activations`: symmetric 8-bit codes per channel) the lanes hold the signed
    weights, codes - 128, and each panel's float32 scales are followed by its columns' sums of weights
    (int32), as int8.h reads them."""
    *stack, out, nbytes = codes.shape
    width = kernel.int_panel if out % kernel.int_panel == 0 else kernel.lanes
    rows = 32 // bits  # rows of k to a lane
    if int8_activations:
        codes = codes ^ 0x80  # (the signed weights' bytes)
    lanes = torch.nn.functional.pad(codes, (0, -nbytes % 4)).view(torch.int32)  # (..., out, groups of k)
    if bits == 4 and kernel.bf16_dot:  # (rows 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high: tiles.h)
        lanes = dot_lanes(lanes)
    weight = lanes.unflatten(-2, (out // width, width)).transpose(-2, -1).contiguous()
    k = nbytes * 8 // bits
    block = group_size or -(-k // rows) * rows
    if int8_activations:
        sums = codes.view(torch.int8).sum(-1, dtype=torch.int32, keepdim=True).view(torch.float32)
        per_block = torch.stack([scale.float(), sums], dim=-2)  # (..., out, 2, blocks)
        per_panel = per_block.unflatten(-3, (out // width, width)).permute(*range(len(stack)), -4, -1, -2, -3)
        return weight, Layout(width, per_panel.contiguous(), block, block, 0)
    scale_format = SCALE_FORMATS.get(scale.dtype, 0)
    scale = scale if scale_format else scale.float()
    zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.uint8) if zero is None else zero.to(torch.uint8)

    def by_panel(values: torch.Tensor) -> torch.Tensor:  # (..., out, blocks) -> bytes (..., panels, blocks, width *)
        values = values.unflatten(-2, (out // width, width)).transpose(-2, -1).contiguous()
        return values.view(torch.uint8)

    per_panel = torch.cat([by_panel(scale), by_panel(zero)], dim=-1)
    return weight, Layout(width, per_panel.contiguous(), block, block, 0, scale_format)


def dot_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """int32 lanes of 8 nibbles, row j in nibble j, with the even rows' nibbles in the low half in turn and the
    odd rows' in the high half, as tiles.h's tile_int4_dot reads them."""
    words = lanes.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for j in range(8):
        out |= ((words >> (4 * j)) & 0xF) << (4 * (j // 2) + 16 * (j % 2))
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for the weight `pack` made `panels` of; x: (..., in), summed in float32 and
    returned in x's dtype."""
    dtype, inp = x.dtype, panels.inp
    rows = x.reshape(-1, inp)
    if dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    if bias is not None:
        bias = padded_bias(bias, panels)
    y = torch.empty(*x.shape[:-1], panels.out, dtype=torch.float32)
    panels.kernel.linear_forward(
        rows, rows.shape[0], inp, rows.stride(0), *panels.args, bias, y, torch.get_num_threads()
    )
    if panels.features != panels.out:
        y = y[..., : panels.features]
    return y if dtype == torch.float32 else y.to(dtype)


def padded_bias(bias: torch.Tensor, panels: Panels) -> torch.Tensor:
    """A bias as the kernel reads it: float32, one value for each of the panels' outputs (0 past the weight's)."""
    bias = bias.float()
    return bias if panels.out == panels.features else torch.nn.functional.pad(bias, (0, panels.out - panels.features))


def check_scale(
    weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int], offset: tuple[int, int]
) -> None:
    """Raises ValueError where `scale` does not fit `weight` (see `pack`)."""
    if scale is None:
        return
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block scales go with float8_e4m3fn weights, not {weight.dtype}")
    *stack, out, inp = weight.shape
    if not all(0 <= o < b for o, b in zip(offset, block, strict=True)):
        raise ValueError(f"offset {offset} is not inside a block of {block}")
    blocks = [-(-(o + n) // b) for o, n, b in zip(offset, (out, inp), block, strict=True)]
    if list(scale.shape) != [*stack, *blocks]:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} for a weight {tuple(weight.shape)} in blocks of "
            f"{block} from {offset}: expected {tuple([*stack, *blocks])}"
        )


def panel_layout(
    kernel: CpuKernel,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
    offset: tuple[int, int],
) -> Layout | None:
    """The panels' layout for weights (..., out, in) with their block scales (checked), or None where the
    kernel cannot take them: every panel's columns must share their scales, so the panel width (the
    kernel's panel, else one vector) must not cross a row block, and column blocks must be whole groups
    of 4 rows."""
    *_, out, inp = weight.shape
    widths = [w for w in (kernel.panel, kernel.lanes) if out % w == 0]
    if not widths:
        return None
    if weight.dtype != torch.float8_e4m3fn or scale is None:
        g = 4 // weight.element_size()
        whole = -(-inp // g) * g  # one block: all of k
        ones = None
        if weight.dtype == torch.float8_e4m3fn:
            ones = torch.full((*weight.shape[:-2], out // widths[0], 1), E4M3_SHIFT)
        return Layout(widths[0], ones, whole, whole, 0)
    (rows, columns), (row0, column0) = block, offset
    if columns % 4:
        return None
    per_row = row_scales(scale.detach().float(), out, rows, row0)
    for width in widths:
        panels = per_row.unflatten(-2, (out // width, width))
        if torch.equal(panels, panels[..., :1, :].expand_as(panels)):
            break
    else:
        return None
    multipliers = (panels[..., 0, :] * E4M3_SHIFT).contiguous()
    if not torch.isfinite(multipliers).all():  # (a scale of 2^8 or more)
        return None
    first = columns - column0
    return Layout(width, multipliers, first, columns, -first % 4)
