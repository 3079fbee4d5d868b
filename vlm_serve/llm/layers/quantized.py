"""Integer-quantized weights in a layer: a checkpoint's packed tensors of one module gathered as they stream
in (`Pieces`), read into codes, scales and zero points (`quantization.int_packing`), and a layer's (or a
stack of experts') shard of them kept packed (`IntWeight`): 4-bit codes two to a byte, 8-bit ones a byte
each, until the kernels take them in their own layout (`linear_cpu.pack_int`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_serve.quantization import IntScheme
from vlm_serve.quantization.int_packing import (
    awq_codes,
    ct_codes,
    ct_zeros,
    dequantize,
    gptq_codes,
    gptq_zeros,
    int8_codes,
    pack_nibbles,
    unpack_nibbles,
)

# the tensors of one module, by layout: those it must have, and those it may
PIECES = {
    "pack-quantized": ({"weight_packed", "weight_scale"}, {"weight_shape", "weight_zero_point"}),
    "int-quantized": ({"weight", "weight_scale"}, set()),
    "awq": ({"qweight", "qzeros", "scales"}, set()),
    "gptq": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
    "gptq_v2": ({"qweight", "qzeros", "scales"}, {"g_idx"}),
}
# every name a quantized module's tensors end with (`<module>.<piece>`)
PIECE_NAMES = frozenset().union(*(required | optional for required, optional in PIECES.values()), {"weight_g_idx"}) - {
    "weight"
}


def is_int_piece(piece: str, tensor: torch.Tensor) -> bool:
    """Whether checkpoint tensor `<module>.<piece>` is part of an integer-quantized weight."""
    return piece in PIECE_NAMES or (piece == "weight" and tensor.dtype == torch.int8)


@dataclass
class IntTensor:
    """One checkpoint weight, read: codes (out, in) uint8, scale (out, groups) in the checkpoint's dtype, zero
    (out, groups) int16 or None (symmetric), and each input column's group (in) where the checkpoint orders
    them so."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    g_idx: torch.Tensor | None = None

    def rows(self, start: int, count: int) -> IntTensor:
        """Rows [start, start + count) of the weight (a column-parallel shard's, or one of a fused layer's)."""
        cut = slice(start, start + count)
        return IntTensor(self.codes[cut], self.scale[cut], None if self.zero is None else self.zero[cut], self.g_idx)


def quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """x as W8A8 multiplies it: each row rounded to int8 with its own scale (largest magnitude / 127),
    dynamic and symmetric as compressed-tensors' `token` strategy, and scaled back, in float32."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)


class Pieces:
    """A quantized module's checkpoint tensors as they arrive, read into an `IntTensor` once all are there."""

    def __init__(self, module: str, scheme: IntScheme, layout: str, shape: tuple[int, int]) -> None:
        self.module, self.scheme, self.layout, self.shape = module, scheme, layout, shape
        self.held: dict[str, torch.Tensor] = {}  # (until the weight is read)
        self.came: set[str] = set()
        self.done = False
        required, optional = PIECES[layout]
        self.required = set(required)
        if layout == "pack-quantized" and not scheme.symmetric:
            self.required.add("weight_zero_point")
        if layout == "pack-quantized" and scheme.act_order:  # (actorder "group": each column's group)
            self.required.add("weight_g_idx")
        if layout.startswith("gptq") and scheme.act_order:
            self.required.add("g_idx")
        self.allowed = self.required | optional

    def add(self, piece: str, tensor: torch.Tensor) -> IntTensor | None:
        """Keeps `tensor`; the module's weight, read, once every piece it needs has come. A piece it may do
        without that comes after that (`weight_shape`, GPTQ's `g_idx` in column order) is checked alone."""
        if piece not in self.allowed:
            raise ValueError(
                f"{self.module}.{piece}: no such tensor in a {self.layout} checkpoint ({self.scheme.describe()})"
            )
        if piece in self.came:
            raise ValueError(f"{self.module}.{piece} comes twice in the checkpoint")
        self.came.add(piece)
        self.held[piece] = tensor
        if self.done:
            self._check_late(piece)
            return None
        if not self.required <= set(self.held):
            return None
        part, self.done, self.held = self.read(), True, {}
        return part

    def missing(self) -> list[str]:
        return [] if self.done else sorted(f"{self.module}.{piece}" for piece in self.required - self.came)

    def _check_late(self, piece: str) -> None:
        rows, columns = self.shape
        if piece == "weight_shape":
            self._weight_shape()
        elif self._g_idx(self.held[piece], columns, self.scheme.groups(columns)) is not None:
            raise ValueError(
                f"{self.module}.{piece}: its columns' groups come after the weight, which was read in order"
            )
        del self.held[piece]

    def _weight_shape(self) -> None:
        shape = self.held["weight_shape"].tolist()
        if shape != list(self.shape):
            raise ValueError(f"{self.module}.weight_shape {shape}, the model's {list(self.shape)}")

    def read(self) -> IntTensor:
        rows, columns = self.shape
        scheme, held = self.scheme, self.held
        groups = scheme.groups(columns)
        if self.layout == "pack-quantized":
            if "weight_shape" in held:
                self._weight_shape()
            self._shape("weight_packed", (rows, -(-columns * scheme.bits // 32)))
            codes = ct_codes(held["weight_packed"], scheme.bits, columns)
            zero = None
            if not scheme.symmetric:
                self._shape("weight_zero_point", (-(-rows * scheme.bits // 32), groups))
                zero = ct_zeros(held["weight_zero_point"], scheme.bits, rows)
            scale, g_idx = self._scale("weight_scale", (rows, groups)), held.get("weight_g_idx")
        elif self.layout == "int-quantized":
            self._shape("weight", (rows, columns))
            codes, zero, g_idx = int8_codes(held["weight"]), None, None
            scale = self._scale("weight_scale", (rows, 1))
        elif self.layout == "awq":
            self._shape("qweight", (columns, rows // 8))
            self._shape("qzeros", (groups, rows // 8))
            codes, zero, g_idx = awq_codes(held["qweight"]), awq_codes(held["qzeros"]).to(torch.int16), None
            scale = self._scale("scales", (groups, rows)).T
        else:  # GPTQ
            bits = scheme.bits
            self._shape("qweight", (columns * bits // 32, rows))
            self._shape("qzeros", (groups, rows * bits // 32))
            codes = gptq_codes(held["qweight"], bits)
            zero = gptq_zeros(held["qzeros"], bits, plus_one=self.layout == "gptq")
            scale, g_idx = self._scale("scales", (groups, rows)).T, held.get("g_idx")
        if g_idx is not None:
            g_idx = self._g_idx(g_idx, columns, groups)
        if scheme.symmetric and zero is not None and not (zero == scheme.zero).all():
            raise ValueError(
                f"{self.module}: a symmetric {self.layout} checkpoint with zero points other than {scheme.zero}"
            )
        return IntTensor(codes.contiguous(), scale.contiguous(), None if scheme.symmetric else zero.contiguous(), g_idx)

    def _shape(self, piece: str, shape: tuple[int, int]) -> None:
        tensor = self.held[piece]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.module}.{piece} has shape {tuple(tensor.shape)}, expected {shape} for a {self.shape[0]} x "
                f"{self.shape[1]} weight ({self.scheme.describe()})"
            )

    def _scale(self, piece: str, shape: tuple[int, int]) -> torch.Tensor:
        self._shape(piece, shape)
        scale = self.held[piece]
        if not scale.is_floating_point():
            raise ValueError(f"{self.module}.{piece} is {scale.dtype}, not floating point")
        return scale

    def _g_idx(self, g_idx: torch.Tensor, columns: int, groups: int) -> torch.Tensor | None:
        """Each column's group, or None where they are the runs of columns the groups are anyway."""
        if tuple(g_idx.shape) != (columns,) or g_idx.is_floating_point():
            raise ValueError(
                f"{self.module}: g_idx has shape {tuple(g_idx.shape)} ({g_idx.dtype}), expected ({columns},) integers"
            )
        g_idx = g_idx.long()
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"{self.module}: g_idx names groups outside 0 ... {groups - 1}")
        runs = torch.arange(columns) // self.scheme.group_size if self.scheme.group_size else torch.zeros(columns)
        return None if torch.equal(g_idx, runs.long()) else g_idx


@dataclass
class IntWeight:
    """A layer's (or a stack of experts', with leading dimensions) integer weight shard, packed:
    `codes` uint8 (..., out, in * bits / 8), two 4-bit codes to a byte (`pack_nibbles`); `scale` (..., out,
    groups) in the checkpoint's dtype (the first part's; float32 where parts differ); `zero` int16 (..., out, groups), None where symmetric; `perm` (..., in): each matrix's
    input columns in the order its codes hold them (act order: the columns sorted by group), None where all
    are in order."""

    scheme: IntScheme
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    perm: torch.Tensor | None = None
    orders: dict = field(default_factory=dict)  # each matrix's order as its first part gave it (None: in order)

    @classmethod
    def empty(cls, scheme: IntScheme, stack: tuple[int, ...], out: int, inp: int, device) -> IntWeight:
        per_byte = 8 // scheme.bits
        if inp % per_byte:
            raise ValueError(f"{inp} input columns do not pack {per_byte} to a byte")
        groups = scheme.groups(inp)
        codes = torch.zeros(*stack, out, inp // per_byte, dtype=torch.uint8, device=device)
        scale = torch.zeros(*stack, out, groups, device=device)
        zero = None if scheme.symmetric else torch.zeros(*stack, out, groups, dtype=torch.int16, device=device)
        return cls(scheme, codes, scale, zero)

    @property
    def in_features(self) -> int:
        return self.codes.shape[-1] * 8 // self.scheme.bits

    def store(self, index: tuple, rows: slice, part: IntTensor, columns: tuple[int, int], module: str) -> None:
        """Rows `rows` of matrix `index` (of the stack) from the checkpoint weight `part`: its rows as they
        are, its columns [start, end) (a row-parallel shard's), which must begin and end on a group."""
        start, end = columns
        if self.scale.dtype != part.scale.dtype:
            self.scale = self.scale.to(part.scale.dtype if not self.orders else torch.float32)
        group = self.scheme.group_size or 1  # (per channel: a row's one scale, wherever it is cut)
        if start % group or (end % group and end != part.codes.shape[1]):
            raise ValueError(
                f"{module}: the shard's input columns {start} ... {end - 1} cut groups of {group} (tensor "
                "parallelism must split a quantized weight between groups)"
            )
        codes = part.codes[:, start:end]
        order = None if part.g_idx is None else self._order(part.g_idx, (start, end), module)
        if index in self.orders:
            known = self.orders[index]
            if (known is None) != (order is None) or (order is not None and not torch.equal(known, order)):
                raise ValueError(f"{module}: the fused projections order their input columns differently (g_idx)")
        self.orders[index] = order
        if order is not None:
            if self.perm is None:
                self.perm = torch.arange(end - start).expand(*self.codes.shape[:-2], end - start).clone()
            self.perm[index], codes = order, codes[:, order]
        g0, g1 = (0, 1) if self.scheme.group_size is None else (start // group, -(-end // group))
        self.codes[index][rows] = pack_nibbles(codes) if self.scheme.bits == 4 else codes
        self.scale[index][rows] = part.scale[:, g0:g1]
        if self.zero is not None:
            self.zero[index][rows] = part.zero[:, g0:g1]

    def _order(self, g_idx: torch.Tensor, columns: tuple[int, int], module: str) -> torch.Tensor:
        """The columns sorted by their groups (act order), which must then be runs of `group_size`."""
        if columns != (0, g_idx.numel()):
            raise ValueError(f"{module}: act order (g_idx) with its input columns split over TP ranks is not supported")
        g_idx, order = torch.sort(g_idx, stable=True)
        if not torch.equal(g_idx, torch.arange(g_idx.numel()) // self.scheme.group_size):
            raise ValueError(f"{module}: g_idx gives groups of other sizes than group_size {self.scheme.group_size}")
        return order

    def free(self) -> None:
        """Lets the codes go once the kernels hold them in their own layout (the scheme and order stay)."""
        self.codes = self.codes.new_empty(0)
        self.scale = self.scale.new_empty(0)
        self.zero = None if self.zero is None else self.zero.new_empty(0)

    def unpacked(self) -> torch.Tensor:
        """The codes (..., out, in), a byte each."""
        return unpack_nibbles(self.codes) if self.scheme.bits == 4 else self.codes

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The real weight (..., out, in) in `dtype`, its columns in their own order."""
        zero = self.zero if self.zero is not None else self.scheme.zero
        weight = dequantize(self.unpacked(), self.scale, zero, self.scheme.group_size, dtype)
        if self.perm is None:
            return weight
        inverse = torch.argsort(self.perm, dim=-1).to(weight.device)
        return torch.gather(weight, -1, inverse.unsqueeze(-2).expand_as(weight))

    def permuted(self, x: torch.Tensor) -> torch.Tensor:
        """x's input columns in the codes' order (one matrix's), as the kernels read them."""
        return x if self.perm is None else x.index_select(-1, self.perm.to(x.device))

    def nbytes(self) -> int:
        held = [self.codes, self.scale, self.zero, self.perm]
        return sum(t.numel() * t.element_size() for t in held if t is not None)
