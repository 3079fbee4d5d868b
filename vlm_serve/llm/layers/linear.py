"""Tensor-parallel linear layers.

Each layer holds only its rank's shard and knows how to cut that shard out of a full checkpoint tensor
(`weight_loader`), so weights are sharded while they load and a full copy never sits on a device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.checkpoint import weight_format
from vlm_serve.llm.distributed import divide, get_parallel_state, tp_all_reduce
from vlm_serve.llm.kernels import gemm_triton, linear_cpu
from vlm_serve.llm.layers.quantized import IntWeight, Pieces, quantize_per_token
from vlm_serve.llm.lora.layer import LORA_BATCH, LoRASlots
from vlm_serve.quantization import FP8_DTYPE, dequantize_rows, shard_scales


class LinearBase(nn.Module):
    """A linear layer's shard: its weight as the checkpoint stores it (float32, bfloat16, FP8 with block
    scales, or 4- and 8-bit integer codes with group scales: `int_weight`), cut out of the full checkpoint
    tensor row by row (`rows`) and column by column (`columns`) as it loads."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # (this shard's: the weight may be packed)
        weights = weight_format()
        # of a quantized checkpoint, the weight takes its storage when it loads: FP8 (with
        # `weight_scale_inv`) or integer codes (`load_int`) where the checkpoint stores it so, the weights'
        # dtype where it does not (routers, ...)
        self.fp8, self.int_config = weights.fp8, weights.int_weights
        device = "meta" if weights.quantization is not None else None
        self.weight = frozen_parameter(
            torch.empty(out_features, in_features, dtype=weights.weight_dtype, device=device)
        )
        self.weight.weight_loader = self.load
        self.device = torch.empty(0).device
        self.weight_scale_inv: torch.Tensor | None = None  # FP8: per row, per block of columns (`shard_scales`)
        self.scale_offset = 0  # FP8: where the first column sits in its block of columns
        if bias:
            self.bias = frozen_parameter(torch.empty(out_features))
            self.bias.weight_loader = self.load
        else:
            self.register_parameter("bias", None)
        # the weight as `prepack` leaves it on CPU: the C kernel's panels (in the weight's dtype), else
        # oneDNN's blocked layout (float32)
        self.panels: linear_cpu.Panels | None = None
        self.packed: torch.Tensor | None = None
        self.lora: LoRASlots | None = None  # LoRA adapters' weights, where one targets this layer
        self.int_weight: IntWeight | None = None  # an integer-quantized checkpoint's codes (`load_int`)
        self.pieces: dict[int | str | None, Pieces] = {}  # its tensors that came, by shard, until each is whole

    def rows(self, shard_id: int | str | None) -> tuple[int, int, int]:
        """Where the shard's rows of checkpoint tensor `shard_id` go: (first row here, rows, first row there)."""
        return 0, self.out_features, 0

    def columns(self) -> int:
        """The checkpoint column where this shard's columns start."""
        return 0

    def checkpoint_shape(self, shard_id: int | str | None) -> tuple[int, int]:
        """The (rows, columns) of checkpoint tensor `shard_id`, whole."""
        return self.out_features, self.in_features

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """Copies this shard's part of a checkpoint tensor (the weight, or the bias) into `param`."""
        if param is not self.bias:
            if self.int_weight is not None:
                raise ValueError("an unquantized weight for a layer whose other parts are quantized")
            if self.weight.is_meta:  # (the checkpoint's first piece of it)
                dtype = loaded.dtype if loaded.dtype == FP8_DTYPE else self.weight.dtype
                self.weight = frozen_parameter(torch.empty(self.weight.shape, dtype=dtype, device=self.device))
                self.weight.weight_loader = self.load
            param = self.weight
        self.weight_loader(param, loaded, shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        here, count, there = self.rows(shard_id)
        part = loaded.narrow(0, there, count)
        if param.dim() == 2:
            part = part.narrow(1, self.columns(), param.shape[1])
        param.data.narrow(0, here, count).copy_(part)

    def load_scale(self, scale_inv: torch.Tensor, shard_id: int | str | None = None) -> None:
        """An FP8 weight's `weight_scale_inv` (one scale per block of the checkpoint tensor), as this
        shard's scales per row."""
        if self.fp8 is None:
            raise ValueError("a weight_scale_inv for a layer of a checkpoint that is not FP8")
        here, count, there = self.rows(shard_id)
        scales, self.scale_offset = shard_scales(
            scale_inv, self.fp8.weight_block_size, (there, count), (self.columns(), self.weight.shape[1])
        )
        if self.weight_scale_inv is None:
            self.weight_scale_inv = torch.empty(self.weight.shape[0], scales.shape[1], device=self.device)
        self.weight_scale_inv[here : here + count] = scales

    def load_int(self, module: str, piece: str, tensor: torch.Tensor, shard_id: int | str | None = None) -> None:
        """One tensor of an integer-quantized checkpoint's module `module` (the weight of shard `shard_id`):
        kept until the module's others have come, then read into this shard's codes."""
        found = None if self.int_config is None else self.int_config.layout_of(module)
        if found is None:
            raise ValueError(f"{module}.{piece}: a quantized tensor for a layer the quantization_config keeps as is")
        if not self.weight.is_meta and self.int_weight is None:
            raise ValueError(f"{module}.{piece}: quantized, beside an unquantized weight of the same layer")
        scheme, layout = found
        if shard_id not in self.pieces:
            self.pieces[shard_id] = Pieces(module, scheme, layout, self.checkpoint_shape(shard_id))
        part = self.pieces[shard_id].add(piece, tensor)
        if part is None:
            return
        if self.int_weight is None:
            self.int_weight = IntWeight.empty(scheme, (), self.out_features, self.in_features, self.device)
            self.weight = frozen_parameter(torch.empty(0, device=self.device))  # (the codes hold it)
        elif self.int_weight.scheme != scheme:
            raise ValueError(f"{module}: quantized otherwise than the projections it is fused with")
        here, count, there = self.rows(shard_id)
        columns = (self.columns(), self.columns() + self.in_features)
        self.int_weight.store((), slice(here, here + count), part.rows(there, count), columns, module)

    def fusable(self) -> bool:
        """Whether the kernels' fused decoder layer computes this layer as its forward does: not where its
        input's columns are reordered first (act order)."""
        return self.int_weight is None or self.int_weight.perm is None

    def missing_pieces(self) -> list[str]:
        """The tensors of quantized modules that came in part: those not there."""
        return [name for pieces in self.pieces.values() for name in pieces.missing()]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a plain matrix in `dtype` (an FP8 or integer one dequantized)."""
        if self.int_weight is not None:
            return self.int_weight.dense(dtype)
        if self.weight.dtype == FP8_DTYPE:
            return dequantize_rows(
                self.weight, self.weight_scale_inv, self.fp8.weight_block_size[1], self.scale_offset, dtype
            )
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        if self.lora is not None and (batch := LORA_BATCH.get()) is not None:
            y = self.lora.add_delta(x, y, batch)
        return y

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.int_weight
        if held is not None and x.is_cuda and gemm_triton.available():
            scheme = held.scheme
            return gemm_triton.int_linear(
                held.permuted(x), held.codes, held.scale, held.zero, scheme.bits, scheme.group_size,
                scheme.int8_activations, self.bias,
            )  # fmt: skip
        if self.panels is None and held is not None and held.scheme.int8_activations:
            x = quantize_per_token(x)  # (as W8A8 computes: x rounded to int8 per row; the kernels do it themselves)
        if self.panels is not None:
            if self.int_weight is not None:
                x = self.int_weight.permuted(x)  # (the codes' order: act order's)
            return linear_cpu.linear(x, self.panels, self.bias)
        if self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        if x.is_cuda and self.weight.dtype == FP8_DTYPE and gemm_triton.available():
            block_cols = self.fp8.weight_block_size[1]
            return gemm_triton.fp8_linear(
                x, self.weight, self.weight_scale_inv, block_cols, self.scale_offset, self.bias
            )
        return F.linear(x, self.dense_weight(x.dtype), self.bias)  # (a format no kernel reads: converted per call)

    def prepack(self) -> None:
        if self.int_weight is not None:
            held, scheme = self.int_weight, self.int_weight.scheme
            self.panels = linear_cpu.pack_int(
                held.codes, scheme.bits, held.scale, held.zero, scheme.group_size, scheme.int8_activations
            )
            if self.panels is not None:
                held.free()
            return
        if self.weight.dtype == FP8_DTYPE:
            if self.weight_scale_inv is None:
                raise ValueError("an FP8 weight came without its weight_scale_inv")
            block = (1, self.fp8.weight_block_size[1])  # (scales per row)
            self.panels = linear_cpu.pack(self.weight, self.weight_scale_inv, block, (0, self.scale_offset))
        else:
            self.panels = linear_cpu.pack(self.weight)
            if self.panels is None:
                self.packed = onednn_weight(self.weight)
        if self.panels is not None or self.packed is not None:
            self.weight.data = self.weight.data.new_empty(0)  # (not held twice)


def frozen_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """A weight (never trained here)."""
    return nn.Parameter(tensor, requires_grad=False)


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A loaded (out, in) weight in oneDNN's blocked layout, where matmuls with it are faster: float32 on
    CPU. As vLLM's CPU backend does; on 2 cores, 4096x4096, `F.linear` (MKL) reads 12.7 GB/s of weights
    at 1 row, 5.9 at 16 and 0.4 at 512, oneDNN 16.6, 14.6 and 0.8."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None) if packable(weight) else None


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_weights(model: nn.Module) -> None:
    """Once a model's weights are loaded: every layer that can keeps its weights in the layout its
    matmuls run fastest with (`prepack`), its parts before it."""
    for module in reversed(list(model.modules())):
        if hasattr(module, "prepack"):
            module.prepack()


class ReplicatedLinear(LinearBase):
    """A full copy on every rank (the vision tower, the MoE router)."""


class ColumnParallelLinear(LinearBase):
    """Output features split over the TP ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        super().__init__(in_features, divide(out_features, self.tp_size), bias)

    def rows(self, shard_id: int | str | None) -> tuple[int, int, int]:
        size = self.out_features
        return 0, size, self.tp_rank * size

    def checkpoint_shape(self, shard_id: int | str | None) -> tuple[int, int]:
        return self.rows(shard_id)[1] * self.tp_size, self.in_features


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); each part is split separately."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def rows(self, shard_id: int | str | None) -> tuple[int, int, int]:
        assert isinstance(shard_id, int)
        shard = self.out_sizes[shard_id] // self.tp_size
        return sum(self.out_sizes[:shard_id]) // self.tp_size, shard, self.tp_rank * shard


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul, heads split over the TP ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on the ranks that share it.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp_size = get_parallel_state().tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        total = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, total, bias)

    def rows(self, shard_id: int | str | None) -> tuple[int, int, int]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size, self.tp_rank * q_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        return offset, kv_size, (self.tp_rank // self.kv_replicas) * kv_size

    def checkpoint_shape(self, shard_id: int | str | None) -> tuple[int, int]:
        rows, replicas = self.rows(shard_id)[1], 1 if shard_id == "q" else self.kv_replicas
        return rows * self.tp_size // replicas, self.in_features


class RowParallelLinear(LinearBase):
    """Input features split over the TP ranks; the partial outputs are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        super().__init__(divide(in_features, self.tp_size), out_features, bias)
        self.reduce_results = reduce_results

    def columns(self) -> int:
        return self.tp_rank * self.in_features

    def checkpoint_shape(self, shard_id: int | str | None) -> tuple[int, int]:
        return self.out_features, self.in_features * self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return tp_all_reduce(y) if self.reduce_results else y
