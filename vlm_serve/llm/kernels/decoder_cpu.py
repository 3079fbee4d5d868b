"""A Qwen3 decoder layer through decoder_cpu.c in two calls: its attention half and its MLP (or MoE) half,
each one parallel region running the separate kernels' loops back to back, with results equal to theirs
bit for bit. Float32 activations and KV cache on CPU, weights in their kernel layouts (`linear_cpu.pack`,
`moe_cpu.pack_experts`).

What a call passes is made C values as early as it is known: a layer's weights once (`DecoderLayerCalls`),
a forward's batch and scratch once for all its layers (`DecoderStep`); a layer's call converts only its
own inputs."""

from __future__ import annotations

from typing import NamedTuple

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, CpuKernel, KernelLibrary, scratch
from vlm_serve.llm.kernels.attention_cpu import PagedBatch
from vlm_serve.llm.kernels.linear_cpu import WEIGHT, Panels, padded_bias
from vlm_serve.llm.kernels.moe_cpu import CHUNK, EXPERTS, PackedExperts

LINEAR = (I32, *WEIGHT, I64, I32, PTR)  # decoder_cpu.c's LINEAR: panels' args, then a bias
OUTPUTS = len(LINEAR) - 3  # where a LINEAR's count of outputs is
LIBRARY = KernelLibrary(
    "decoder_cpu",
    {  # (the layer's weights; the call's own tensors; the step's)
        "attention_block_f32": (
            None,
            PTR,
            PTR,
            PTR,
            PTR,
            F32,
            *LINEAR,
            *LINEAR,
            I64,
            I64,
            I64,
            I64,
            F32,
            PTR,
            PTR,
            PTR,
            PTR,
            I32,
            I64,
            PTR,
            PTR,
            PTR,
            I64,
            PTR,
            PTR,
            PTR,
            I64,
            PTR,
            *[PTR] * 7,
            I32,
        ),
        "mlp_block_f32": (None, *LINEAR, *LINEAR, I64, I64, PTR, PTR, PTR, PTR, I32),
        "moe_block_f32": (None, *LINEAR, I64, I64, I32, I64, I64, *EXPERTS, I64, *[PTR] * 12, I32),
    },
)


def linear_args(panels: Panels, bias: torch.Tensor | None) -> tuple:
    """A linear layer as decoder_cpu.c's LINEAR takes it."""
    return (*panels.args, None if bias is None else padded_bias(bias, panels).contiguous())


class AttentionShape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int


class DecoderLayerCalls:
    """A layer's two halves with its weights bound to them once: the attention half (the four norms' weights,
    one eps; the qkv and output projections as linear_args; its shape; the softmax scale) and either the
    gated MLP (`mlp`: gate_up and down as linear_args) or the MoE (`moe`: the router as linear_args, how
    many experts it chooses from, top_k, renormalize, expert_start and the packed experts)."""

    def __init__(
        self,
        kernel: CpuKernel,
        norms: list[torch.Tensor],
        eps: float,
        qkv: tuple,
        o: tuple,
        shape: AttentionShape,
        scale: float,
        mlp: tuple[tuple, tuple] | None = None,
        moe: tuple[tuple, int, int, bool, int, PackedExperts] | None = None,
    ) -> None:
        self.kernel, self.shape = kernel, shape
        self.attention_call = kernel.bind("attention_block_f32", *norms, eps, *qkv, *o, *shape, scale)
        self.intermediate, self.experts = 0, None
        if mlp is not None:
            gate_up, down = mlp
            self.intermediate = gate_up[OUTPUTS] // 2
            self.mlp_call = kernel.bind("mlp_block_f32", *gate_up, *down, shape.hidden)
            return
        router, num_experts, self.top_k, renormalize, expert_start, self.experts = moe
        self.router_n = router[OUTPUTS]  # (its outputs: the experts, and zero rows up to whole vectors)
        self.mlp_call = kernel.bind(
            "moe_block_f32",
            *router,
            num_experts,
            self.top_k,
            renormalize,
            expert_start,
            self.experts.w13.shape[0],
            *self.experts.args,
        )


class DecoderStep:
    """One forward's batch and scratch as every layer's calls take them, made C values once: `layer` runs a
    layer's two halves on them."""

    def __init__(self, kernel: CpuKernel, tokens: int, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch) -> None:
        self.kernel, self.tokens, self.cos, self.sin, self.batch = kernel, tokens, cos, sin, batch
        self.attention_args: tuple | None = None
        self.mlp_args: dict[int, tuple] = {}  # by the layers' kind (their intermediate size; 0: MoE)

    def layer(
        self,
        calls: DecoderLayerCalls,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream `residual + x` (x alone where residual is None), as its modules
        compute it one by one: (MLP output, residual stream after attention). Both are this step's scratch,
        good until its next layer."""
        if self.attention_args is None:
            self._attention_args(calls.shape)
        if residual is not None and residual is not self.residual:
            self.residual.copy_(residual)
        self._mlp_args(calls)
        calls.attention_call(k_cache, v_cache, x, self.residual, residual is not None, *self.attention_args)
        calls.mlp_call(*self.mlp_args[calls.intermediate])
        return self.out, self.residual

    def _attention_args(self, shape: AttentionShape) -> None:
        tokens, batch = self.tokens, self.batch
        hidden, heads, kv_heads, head_dim = shape
        self.h, self.out, self.residual = (
            _scratch(tokens * hidden, name, (tokens, hidden)) for name in ("h", "out", "residual")
        )
        args = (
            tokens,
            self.cos,
            self.sin,
            batch.kv_slots,
            batch.kv_slots.stride(0),
            batch.seq_lens,
            batch.ext_lens,
            batch.q_starts,
            batch.seq_lens.numel(),
            batch.new_slots,
            self.h,
            _scratch(tokens * (heads + 2 * kv_heads) * head_dim, "qkv"),
            _scratch(tokens * heads * head_dim, "q"),
            _scratch(tokens * kv_heads * head_dim, "k"),
            _scratch(tokens * heads * head_dim, "attn"),
            _scratch(tokens * hidden, "o"),
            *batch.work(head_dim),
        )
        # (after the norms and eps, qkv and o, the shape, and the call's five)
        self.attention_args = self.kernel.c_values("attention_block_f32", 15 + 2 * len(LINEAR), args)

    def _mlp_args(self, calls: DecoderLayerCalls) -> None:
        if calls.intermediate in self.mlp_args:
            return
        tokens, threads = self.tokens, torch.get_num_threads()
        if calls.experts is None:
            gate_up = _scratch(tokens * 2 * calls.intermediate, "gate_up")
            act = _scratch(tokens * calls.intermediate, "act")
            step = 2 * len(LINEAR) + 1  # (after gate_up, down and the hidden size)
            args = self.kernel.c_values("mlp_block_f32", step, (tokens, self.h, gate_up, act, self.out, threads))
        else:
            pairs, local, hidden = tokens * calls.top_k, calls.experts.w13.shape[0], calls.shape.hidden
            args = self.kernel.c_values(
                "moe_block_f32",
                len(LINEAR) + 5 + len(EXPERTS),  # (after the router, the routing's five and the experts)
                (
                    tokens,
                    self.h,
                    _scratch(tokens * calls.router_n, "logits"),
                    _scratch(pairs, "weights"),
                    _indices(pairs, "expert"),
                    _indices(pairs, "order"),
                    _indices(local + 2, "starts"),
                    _indices(pairs + local, "task_expert"),
                    _indices(pairs + local, "task_row"),
                    _indices(pairs, "pos"),
                    _scratch(pairs * hidden, "ys"),
                    _scratch(threads * CHUNK * 2 * calls.experts.intermediate, "experts"),
                    self.out,
                    threads,
                ),
            )
        self.mlp_args[calls.intermediate] = args


def _scratch(numel: int, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    buffer = scratch(numel, torch.float32, f"decoder_{name}")
    return buffer if shape is None else buffer[:numel].view(shape)


def _indices(numel: int, name: str) -> torch.Tensor:
    return scratch(numel, torch.int64, f"decoder_{name}")
