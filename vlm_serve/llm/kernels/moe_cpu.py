"""The MoE experts of one layer through moe_cpu.c: float32 on CPU, one call for every expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import I32, I64, PTR, CpuKernel, KernelLibrary, scratch

LIBRARY = KernelLibrary(
    "moe_cpu",
    {
        "moe_route_f32": (None, PTR, I64, I64, I64, I32, I64, I64, PTR, PTR, PTR, PTR, I32),
        "moe_forward_f32": (None, PTR, I64, I64, PTR, PTR, I64, PTR, PTR, I32, PTR, I32, I64, I64, PTR, PTR, PTR, I32),
    },
)


@dataclass
class PackedExperts:
    """A layer's expert weights in moe_cpu.c's column panels, and the kernel library they are for."""

    kernel: CpuKernel
    w13: torch.Tensor  # (experts, 2I / width13, H, width13)
    width13: int
    w2: torch.Tensor  # (experts, H / width2, I, width2)
    width2: int
    hidden: int
    intermediate: int


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | None:
    """(experts, 2I, H) and (experts, H, I) weights packed for the kernel, or None where it cannot run
    them (not float32 on CPU, a width not a multiple of the vector width, or no kernel built)."""
    hidden, intermediate = w13.shape[2], w2.shape[2]
    if w13.device.type != "cpu" or w13.dtype != torch.float32:
        return None
    kernel = LIBRARY.get()
    if kernel is None or hidden % kernel.lanes or 2 * intermediate % kernel.lanes:
        return None
    p13, p2 = kernel.panels(w13), kernel.panels(w2)
    return PackedExperts(kernel, p13, p13.shape[-1], p2, p2.shape[-1], hidden, intermediate)


def moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_start: int,
    packed: PackedExperts,
) -> torch.Tensor:
    """The experts' part of the layer's output, (tokens, hidden): each token's top_k experts by router
    logit, weighted by their softmax probabilities (renormalized over the top_k where `renormalize`),
    summed; experts held by other ranks (outside expert_start ... + this rank's count) are left out."""
    tokens, experts = x.shape[0], packed.w13.shape[0]
    pairs = tokens * top_k
    kernel, threads = packed.kernel, torch.get_num_threads()
    order, chosen = torch.empty(pairs, dtype=torch.int64), torch.empty(pairs, dtype=torch.int64)
    starts, weights = torch.empty(experts + 2, dtype=torch.int64), torch.empty(pairs, dtype=torch.float32)
    logits = router_logits.float().contiguous()
    kernel.moe_route_f32(
        logits, tokens, logits.shape[1], top_k, renormalize, expert_start, experts, weights, order, starts, chosen,
        threads,
    )  # fmt: skip
    out = torch.empty_like(x)
    ys, pos = scratch(pairs * packed.hidden, torch.float32), scratch(pairs, torch.int64)
    x = x.contiguous()
    kernel.moe_forward_f32(
        x, tokens, top_k, order, starts, experts, weights, packed.w13, packed.width13, packed.w2, packed.width2,
        packed.hidden, packed.intermediate, out, ys, pos, threads,
    )  # fmt: skip
    return out

