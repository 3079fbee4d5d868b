"""Sparse mixture-of-experts block: top-k router and experts sharded over the EP ranks.

Each rank holds `num_experts / ep_size` experts, each with its `1 / moe_tp_size` slice of the
intermediate dimension. Every rank sees every token, computes what its experts owe to the tokens routed
to them, and one all-reduce over the TP group sums the pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.checkpoint import weight_format
from vlm_serve.llm.distributed import divide, get_parallel_state, tp_all_reduce
from vlm_serve.llm.kernels import gemm_triton
from vlm_serve.llm.kernels.moe_cpu import PackedExperts, moe_forward, pack_experts, pack_int_experts
from vlm_serve.llm.layers.activation import silu_and_mul
from vlm_serve.llm.layers.linear import ReplicatedLinear, frozen_parameter
from vlm_serve.llm.layers.quantized import IntWeight, Pieces, quantize_per_token
from vlm_serve.llm.lora.experts import ExpertLoRASlots
from vlm_serve.llm.lora.layer import LORA_BATCH
from vlm_serve.quantization import FP8_DTYPE, dequantize_rows, shard_scales


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        state = get_parallel_state()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_local_experts = divide(num_experts, state.ep_size)
        self.expert_start = state.ep_rank * self.num_local_experts
        self.intermediate = divide(intermediate_size, state.moe_tp_size)
        self.moe_tp_rank, self.moe_tp_size = state.moe_tp_rank, state.moe_tp_size
        self.hidden_size = hidden_size
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        # (experts, out, in) like nn.Linear weights: gate and up stacked in w13. Of a quantized checkpoint
        # they take their storage when they load (FP8 with scales per row, `shard_scales`; or integer codes)
        weights = weight_format()
        self.fp8, self.int_config = weights.fp8, weights.int_weights
        device = "meta" if weights.quantization is not None else None
        shape13, shape2 = (
            (self.num_local_experts, 2 * self.intermediate, hidden_size),
            (self.num_local_experts, hidden_size, self.intermediate),
        )
        self.w13 = frozen_parameter(torch.empty(shape13, dtype=weights.weight_dtype, device=device))
        self.w2 = frozen_parameter(torch.empty(shape2, dtype=weights.weight_dtype, device=device))
        self.device = torch.empty(0).device
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.w2_scale_offset = 0  # where this rank's slice of the intermediate starts in its block
        self.packed: PackedExperts | None = None  # for the CPU kernel, by `prepack`
        # an integer-quantized checkpoint's experts: w13's and w2's codes, and each projection's tensors
        # that came, until it is whole
        self.w13_int: IntWeight | None = None
        self.w2_int: IntWeight | None = None
        self.pieces: dict[tuple[int, str], Pieces] = {}
        self.lora: ExpertLoRASlots | None = None  # LoRA adapters of the experts, where one targets them
        # whether `prepack` keeps the weights as they are too: a LoRA server's batches through an adapter of
        # the experts run them module by module (their delta goes between the two products)
        self.keep_dense = False

    def _materialize(self, dtype: torch.dtype) -> None:
        """An FP8 checkpoint's experts get their storage with the first tensor of them: FP8 if it is."""
        if self.w13.is_meta:
            dtype = dtype if dtype == FP8_DTYPE else self.w13.dtype
            self.w13 = frozen_parameter(torch.empty(self.w13.shape, dtype=dtype, device=self.device))
            self.w2 = frozen_parameter(torch.empty(self.w2.shape, dtype=dtype, device=self.device))

    def load_expert(self, expert: int, proj: str, loaded: torch.Tensor) -> None:
        """One expert's `gate_proj` / `up_proj` (intermediate, hidden) or `down_proj` (hidden, intermediate),
        as checkpoints that store experts one by one (Qwen's FP8 ones) have them."""
        e, cols = expert - self.expert_start, self.intermediate_slice()
        if not 0 <= e < self.num_local_experts:
            return
        self._materialize(loaded.dtype)
        if proj == "down_proj":
            self.w2.data[e].copy_(loaded[:, cols])
        else:
            half = self._half(proj)
            self.w13.data[e, half].copy_(loaded[cols])

    def load_expert_scale(self, expert: int, proj: str, scale_inv: torch.Tensor) -> None:
        """The `weight_scale_inv` of one expert's FP8 projection, as scales per row (`shard_scales`)."""
        e, cols = expert - self.expert_start, self.intermediate_slice()
        if not 0 <= e < self.num_local_experts:
            return
        if self.fp8 is None:
            raise ValueError("a weight_scale_inv for experts of a checkpoint that is not FP8")
        block, hidden = self.fp8.weight_block_size, self.hidden_size
        if proj == "down_proj":
            scales, self.w2_scale_offset = shard_scales(scale_inv, block, (0, hidden), (cols.start, self.intermediate))
            if self.w2_scale is None:
                self.w2_scale = torch.empty(self.num_local_experts, hidden, scales.shape[-1], device=self.device)
            self.w2_scale[e] = scales
        else:
            scales, _ = shard_scales(scale_inv, block, (cols.start, self.intermediate), (0, hidden))
            if self.w13_scale is None:
                self.w13_scale = torch.empty(
                    self.num_local_experts, 2 * self.intermediate, scales.shape[-1], device=self.device
                )
            self.w13_scale[e, self._half(proj)] = scales

    def load_expert_int(self, expert: int, proj: str, module: str, piece: str, tensor: torch.Tensor) -> None:
        """One tensor of an integer-quantized expert's projection `module` (`gate_proj`, `up_proj` or
        `down_proj`, as Linear layers one by one): kept until the projection's others have come."""
        e = expert - self.expert_start
        if not 0 <= e < self.num_local_experts:
            return
        found = None if self.int_config is None else self.int_config.layout_of(module)
        if found is None:
            raise ValueError(f"{module}.{piece}: a quantized tensor for experts the quantization_config keeps as is")
        scheme, layout = found
        inter, hidden = self.intermediate * self.moe_tp_size, self.hidden_size
        key = (expert, proj)
        if key not in self.pieces:
            shape = (hidden, inter) if proj == "down_proj" else (inter, hidden)
            self.pieces[key] = Pieces(module, scheme, layout, shape)
        part = self.pieces[key].add(piece, tensor)
        if part is None:
            return
        if self.w13_int is None:
            stack = (self.num_local_experts,)
            self.w13_int = IntWeight.empty(scheme, stack, 2 * self.intermediate, hidden, self.device)
            self.w2_int = IntWeight.empty(scheme, stack, hidden, self.intermediate, self.device)
            self.w13 = frozen_parameter(torch.empty(0, device=self.device))  # (the codes hold them)
            self.w2 = frozen_parameter(torch.empty(0, device=self.device))
        elif self.w13_int.scheme != scheme:
            raise ValueError(f"{module}: quantized otherwise than the other experts")
        cols = self.intermediate_slice()
        if proj == "down_proj":
            self.w2_int.store((e,), slice(0, hidden), part, (cols.start, cols.stop), module)
        else:
            self.w13_int.store((e,), self._half(proj), part.rows(cols.start, self.intermediate), (0, hidden), module)

    @property
    def int8_activations(self) -> bool:
        """W8A8 experts: each product's input rounded to int8 per row."""
        return self.w13_int is not None and self.w13_int.scheme.int8_activations

    def fusable(self) -> bool:
        """Whether the kernels' fused decoder layer computes these experts as their forward does (see
        `LinearBase.fusable`)."""
        return self.w13_int is None or (self.w13_int.perm is None and self.w2_int.perm is None)

    def missing_pieces(self) -> list[str]:
        """The tensors of quantized experts that came in part: those not there."""
        return [name for pieces in self.pieces.values() for name in pieces.missing()]

    def intermediate_slice(self) -> slice:
        """This rank's slice of an expert's intermediate dimension."""
        return slice(self.moe_tp_rank * self.intermediate, (self.moe_tp_rank + 1) * self.intermediate)

    def _half(self, proj: str) -> slice:
        """Where gate_proj's or up_proj's rows go in w13."""
        return slice(0, self.intermediate) if proj == "gate_proj" else slice(self.intermediate, 2 * self.intermediate)

    def expert_weights(self, which: int, dtype: torch.dtype) -> torch.Tensor:
        """w13 (`which` 0) or w2 (1) of every local expert as plain matrices in `dtype` (FP8 dequantized)."""
        if self.w13_int is not None:
            return (self.w13_int, self.w2_int)[which].dense(dtype)
        weights = (self.w13, self.w2)[which]
        if weights.dtype != FP8_DTYPE:
            return weights.to(dtype)
        scales, offset = ((self.w13_scale, 0), (self.w2_scale, self.w2_scale_offset))[which]
        return dequantize_rows(weights, scales, self.fp8.weight_block_size[1], offset, dtype)

    def load_gate_up(self, loaded: torch.Tensor) -> None:
        """Loads fused experts as (experts, 2 * intermediate, hidden): gate rows first, then up rows."""
        self._materialize(loaded.dtype)
        local = loaded[self.expert_start : self.expert_start + self.num_local_experts]
        gate, up = local.chunk(2, dim=1)
        rows = slice(self.moe_tp_rank * self.intermediate, (self.moe_tp_rank + 1) * self.intermediate)
        self.w13.data.copy_(torch.cat([gate[:, rows], up[:, rows]], dim=1))

    def load_down(self, loaded: torch.Tensor) -> None:
        """Loads fused experts as (experts, hidden, intermediate)."""
        self._materialize(loaded.dtype)
        local = loaded[self.expert_start : self.expert_start + self.num_local_experts]
        cols = slice(self.moe_tp_rank * self.intermediate, (self.moe_tp_rank + 1) * self.intermediate)
        self.w2.data.copy_(local[:, :, cols])

    def prepack(self) -> None:
        """The experts in the CPU kernel's layout, in their dtype (float32, bfloat16, float16, or FP8 with
        its scales, on CPU, where the kernel builds). At decode batch sizes it reads the weights 3-4x faster
        than a matmul per expert."""
        if self.w13_int is not None:
            w13, w2, scheme = self.w13_int, self.w2_int, self.w13_int.scheme
            if w13.perm is not None or w2.perm is not None:  # (act order: each expert's own; module by module)
                return
            self.packed = pack_int_experts(
                (w13.codes, w13.scale, w13.zero),
                (w2.codes, w2.scale, w2.zero),
                scheme.bits,
                scheme.group_size,
                scheme.int8_activations,
            )
            if self.packed is not None and not self.keep_dense:
                self.w13_int.free(), self.w2_int.free()
            return
        if self.w13.dtype == FP8_DTYPE:
            if self.w13_scale is None or self.w2_scale is None:
                raise ValueError("FP8 experts came without their weight_scale_inv")
            rows = (1, self.fp8.weight_block_size[1])  # (scales per row)
            self.packed = pack_experts(
                self.w13, self.w2, self.w13_scale, self.w2_scale, rows, rows, (0, 0), (0, self.w2_scale_offset)
            )
        else:
            self.packed = pack_experts(self.w13, self.w2)
        if self.packed is not None and not self.keep_dense:
            self.w13.data, self.w2.data = self.w13.data.new_empty(0), self.w2.data.new_empty(0)  # (not held twice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        lora = LORA_BATCH.get() if self.lora is not None else None
        if self.packed is not None and lora is None:
            out = moe_forward(x, logits, self.top_k, self.norm_topk_prob, self.expert_start, self.packed)
            return tp_all_reduce(out)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # each (token, k) pair, grouped by local expert: rows of the pairs routed elsewhere come last
        local = experts.flatten() - self.expert_start
        local = torch.where((local >= 0) & (local < self.num_local_experts), local, self.num_local_experts)
        order = torch.argsort(local, stable=True)
        grouped = local[order]
        # where each expert's rows end (no bincount: on CUDA it reads the indices' range on the host, which a
        # captured CUDA graph cannot)
        ends = torch.searchsorted(grouped, torch.arange(self.num_local_experts, device=x.device), right=True)
        tokens = order // self.top_k
        if lora is not None:  # (each pair's adapter: its token's)
            ys = self._expert_loop(x[tokens], ends, lora.row_slots(x.shape[0]).to(x.device)[tokens])
        else:
            ys = (self._grouped_mm if x.is_cuda else self._expert_loop)(x[tokens], ends)
        ys = ys * (weights.flatten()[order] * (grouped < self.num_local_experts)).to(x.dtype)[:, None]
        # each token's top-k rows summed in a fixed order: on CUDA an index_add_ sums them by atomics, in an
        # order that changes from run to run, and so do the rounding and, in a random model, greedy tokens
        pairs = torch.empty_like(ys)
        pairs[order] = ys
        return tp_all_reduce(pairs.view(-1, self.top_k, x.shape[-1]).sum(1))

    def _expert_loop(self, xs: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One matmul each way per expert that has pairs, and one activation over all rows; `slots`: each
        row's LoRA adapter slot (-1: the base), whose products are added to each matmul's."""
        starts = [0, *ends.tolist()]
        active = [(e, starts[e], starts[e + 1]) for e in range(self.num_local_experts) if starts[e + 1] > starts[e]]
        gate_up = self._per_expert(xs, active, 0, slots)
        act = silu_and_mul(gate_up)
        ys = xs.new_zeros(xs.shape)  # (pairs routed to other ranks' experts stay zero)
        ys[: starts[-1]] = self._per_expert(act, active, 1, slots)
        return ys

    def _per_expert(
        self, rows: torch.Tensor, active: list[tuple[int, int, int]], which: int, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows lo:hi times expert e's w13 (`which` 0) or w2 (1), for each (e, lo, hi) of `active`."""
        weights = self.expert_weights(which, rows.dtype)  # (converted per call where no kernel reads them)
        inputs = quantize_per_token(rows) if self.int8_activations else rows  # (W8A8; an adapter's delta: not)
        parts = [F.linear(inputs[lo:hi], weights[e]) for e, lo, hi in active]
        if slots is not None:
            for part, (e, lo, hi) in zip(parts, active):
                self.lora.add_delta(part, rows[lo:hi], which, e, slots[lo:hi])
        out = (2 * self.intermediate, self.hidden_size)[which]
        return torch.cat(parts) if parts else rows.new_empty(0, out)

    def _grouped_mm(self, xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Every expert in one grouped GEMM each way, with no host sync (CUDA): FP8 experts through the
        block-scaled Triton GEMM, which reads them as stored; others through torch's grouped GEMM."""
        ends = ends.to(torch.int32)
        if self.w13_int is not None and gemm_triton.available() and self.w13_int.perm is None:
            w13, w2, scheme = self.w13_int, self.w2_int, self.w13_int.scheme
            form = (scheme.bits, scheme.group_size)
            i8 = scheme.int8_activations
            gate_up = gemm_triton.int_grouped_linear(xs, w13.codes, w13.scale, w13.zero, *form, ends, i8)
            ys = gemm_triton.int_grouped_linear(silu_and_mul(gate_up), w2.codes, w2.scale, w2.zero, *form, ends, i8)
        elif self.w13.dtype == FP8_DTYPE and gemm_triton.available():
            block = self.fp8.weight_block_size[1]
            gate_up = gemm_triton.fp8_grouped_linear(xs, self.w13, self.w13_scale, ends, block, 0)
            ys = gemm_triton.fp8_grouped_linear(
                silu_and_mul(gate_up), self.w2, self.w2_scale, ends, block, self.w2_scale_offset
            )
        else:
            gate_up = torch._grouped_mm(xs, self.expert_weights(0, xs.dtype).transpose(1, 2), offs=ends)
            ys = torch._grouped_mm(silu_and_mul(gate_up), self.expert_weights(1, xs.dtype).transpose(1, 2), offs=ends)
        rows = torch.arange(xs.shape[0], device=xs.device)
        return torch.where((rows < ends[-1])[:, None], ys, 0)  # rows past the last group are not written
