"""The MoE experts of one layer through moe_cpu.c: float32 on CPU, one call for every expert."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import I32, I64, LANES, PTR, bound_library, panels, scratch


@dataclass
class PackedExperts:
    """A layer's expert weights in moe_cpu.c's column panels."""

    w13: torch.Tensor  # (experts, 2I / width13, H, width13)
    width13: int
    w2: torch.Tensor  # (experts, H / width2, I, width2)
    width2: int
    hidden: int
    intermediate: int


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | None:
    """(experts, 2I, H) and (experts, H, I) weights packed for the kernel, or None where it cannot run
    them (not float32 on CPU, a width not a multiple of 16, or no kernel built)."""
    hidden, intermediate = w13.shape[2], w2.shape[2]
    if w13.device.type != "cpu" or w13.dtype != torch.float32 or hidden % LANES or 2 * intermediate % LANES:
        return None
    if _kernel() is None:
        return None
    p13, p2 = panels(w13), panels(w2)
    return PackedExperts(p13, p13.shape[-1], p2, p2.shape[-1], hidden, intermediate)


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
    lib, threads = _kernel(), torch.get_num_threads()
    order, chosen = torch.empty(pairs, dtype=torch.int64), torch.empty(pairs, dtype=torch.int64)
    starts, weights = torch.empty(experts + 2, dtype=torch.int64), torch.empty(pairs, dtype=torch.float32)
    logits = router_logits.float().contiguous()
    lib.moe_route_f32(
        logits.data_ptr(), tokens, logits.shape[1], top_k, renormalize, expert_start, experts, weights.data_ptr(),
        order.data_ptr(), starts.data_ptr(), chosen.data_ptr(), threads,
    )  # fmt: skip
    out = torch.empty_like(x)
    ys, pos = scratch(pairs * packed.hidden, torch.float32), scratch(pairs, torch.int64)
    x = x.contiguous()
    lib.moe_forward_f32(
        x.data_ptr(), tokens, top_k, order.data_ptr(), starts.data_ptr(), experts, weights.data_ptr(),
        packed.w13.data_ptr(), packed.width13, packed.w2.data_ptr(), packed.width2, packed.hidden,
        packed.intermediate, out.data_ptr(), ys.data_ptr(), pos.data_ptr(), threads,
    )  # fmt: skip
    return out


def _kernel() -> ctypes.CDLL | None:
    return bound_library(
        "moe_cpu",
        {
            "moe_route_f32": (None, PTR, I64, I64, I64, I32, I64, I64, PTR, PTR, PTR, PTR, I32),
            "moe_forward_f32": (
                None, PTR, I64, I64, PTR, PTR, I64, PTR, PTR, I32, PTR, I32, I64, I64, PTR, PTR, PTR, I32
            ),
        },
    )
