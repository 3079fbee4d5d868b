"""A Qwen3 decoder layer through decoder_cpu.c in two calls: its attention half and its MLP (or MoE) half,
each one parallel region running the separate kernels' loops back to back, with results equal to theirs
bit for bit. Float32 activations and KV cache on CPU, weights in their kernel layouts (`linear_cpu.pack`,
`moe_cpu.pack_experts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import F32, I32, I64, PTR, CpuKernel, KernelLibrary, scratch
from vlm_serve.llm.kernels.attention_cpu import PagedBatch
from vlm_serve.llm.kernels.linear_cpu import Panels
from vlm_serve.llm.kernels.moe_cpu import CHUNK, PackedExperts

LINEAR = (PTR, I32, PTR, I64, I64, I64, I64, I32, PTR)  # decoder_cpu.c's LINEAR: panels' args, then a bias
LIBRARY = KernelLibrary(
    "decoder_cpu",
    {
        "attention_block_f32": (
            None, PTR, PTR, I32, I64, I64, PTR, PTR, PTR, PTR, F32, *LINEAR, *LINEAR, I64, I64, I64, PTR, PTR, PTR,
            PTR, PTR, I64, PTR, PTR, PTR, I64, PTR, F32, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32,
        ),  # fmt: skip
        "mlp_block_f32": (None, PTR, I64, I64, *LINEAR, *LINEAR, PTR, PTR, PTR, I32),
        "moe_block_f32": (
            None, PTR, I64, I64, *LINEAR, I64, I32, I64, I64, I32, PTR, PTR, I64, I64, I64, I32, PTR, PTR, I64, I64,
            I64, I32, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32,
        ),  # fmt: skip
    },
)


def linear_args(panels: Panels, bias: torch.Tensor | None) -> tuple:
    """A linear layer as decoder_cpu.c's LINEAR takes it."""
    return (*panels.args, None if bias is None else bias.float().contiguous())


@dataclass
class AttentionWeights:
    """A layer's attention half: its norms (one eps), the qkv and output projections in panels, its heads."""

    input_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: tuple  # linear_args
    o: tuple
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    def __post_init__(self) -> None:
        self.args = (self.input_norm, self.q_norm, self.k_norm, self.post_norm, self.eps, *self.qkv, *self.o,
                     self.heads, self.kv_heads, self.head_dim)  # fmt: skip


def attention_block(
    kernel: CpuKernel,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weights: AttentionWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual stream after the layer's attention, its post-attention norm) for the stream
    `residual + x` (x alone where residual is None), as the layer's modules compute them one by one. The
    residual given is updated in place (a fresh one is made where None); the norm's tensor is scratch,
    good until the next call."""
    tokens, hidden = x.shape
    width = (weights.heads + 2 * weights.kv_heads) * weights.head_dim
    fresh = residual is None
    if fresh:
        residual = torch.empty_like(x)
    h = _scratch(tokens * hidden, "h")[: tokens * hidden].view(tokens, hidden)
    q_size = tokens * weights.heads * weights.head_dim
    kernel.attention_block_f32(
        x, residual, not fresh, tokens, hidden, *weights.args, cos, sin, k_cache, v_cache, batch.kv_slots,
        batch.kv_slots.stride(0), batch.seq_lens, batch.ext_lens, batch.q_starts, batch.seq_lens.numel(),
        batch.new_slots, weights.scale, h, _scratch(tokens * width, "qkv"), _scratch(q_size, "q"),
        _scratch(tokens * weights.kv_heads * weights.head_dim, "k"), _scratch(q_size, "attn"),
        _scratch(tokens * hidden, "o"), batch.work, batch.threads,
    )  # fmt: skip
    return residual, h


def mlp_block(kernel: CpuKernel, h: torch.Tensor, gate_up: tuple, down: tuple) -> torch.Tensor:
    """down(silu(gate) * up) of h, the gated MLP's linears as linear_args."""
    tokens, intermediate = h.shape[0], gate_up[6] // 2
    out = torch.empty(tokens, down[6])
    kernel.mlp_block_f32(
        h, tokens, h.shape[1], *gate_up, *down, _scratch(tokens * 2 * intermediate, "gate_up"),
        _scratch(tokens * intermediate, "act"), out, torch.get_num_threads(),
    )  # fmt: skip
    return out


def moe_block(
    kernel: CpuKernel,
    h: torch.Tensor,
    router: tuple | Callable[[torch.Tensor], torch.Tensor],
    top_k: int,
    renormalize: bool,
    expert_start: int,
    experts: PackedExperts,
) -> torch.Tensor:
    """The experts' weighted sum for h as `moe_cpu.moe_forward` computes it; the router a linear_args, or
    a module computing its logits (one whose weight the kernels cannot take: fewer outputs than a vector)."""
    tokens, threads = h.shape[0], torch.get_num_threads()
    pairs, local = tokens * top_k, experts.w13.shape[0]
    if callable(router):
        logits = router(h).float().contiguous()
        router = (None, 0, None, 0, 0, 0, logits.shape[1], 0, None)
    else:
        logits = _scratch(tokens * router[6], "logits")
    out = torch.empty(tokens, experts.hidden)
    kernel.moe_block_f32(
        h, tokens, h.shape[1], *router, top_k, renormalize, expert_start, local, *experts.args[:-2], experts.intermediate,
        logits, _scratch(pairs, "weights"), _indices(pairs, "expert"),
        _indices(pairs, "order"), _indices(local + 2, "starts"), _indices(pairs + local, "task_expert"),
        _indices(pairs + local, "task_row"), _indices(pairs, "pos"), _scratch(pairs * experts.hidden, "ys"),
        _scratch(threads * CHUNK * 2 * experts.intermediate, "experts"), out, threads,
    )  # fmt: skip
    return out


def _scratch(numel: int, name: str) -> torch.Tensor:
    return scratch(numel, torch.float32, f"decoder_{name}")


def _indices(numel: int, name: str) -> torch.Tensor:
    return scratch(numel, torch.int64, f"decoder_{name}")
