"""The MoE experts of one layer through moe_cpu.c on CPU, one call for every expert: the weights packed
once into column panels in their own format (float32, bfloat16, float16, FP8 e4m3 with block scales, or 4-
and 8-bit integer codes with group scales: as linear_cpu.py takes them), summed in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import I32, I64, PTR, CpuKernel, KernelLibrary, scratch
from vlm_serve.llm.kernels.linear_cpu import (
    BLOCK,
    FORMATS,
    INT_FORMATS,
    W_I8,
    WEIGHT,
    Layout,
    check_scale,
    fits_bytes,
    int_panels,
    panel_layout,
)

CHUNK = 32  # moe_cpu.c's rows per task
EXPERTS = (I32, *WEIGHT, I32, *WEIGHT, I32, I64, I64)  # PackedExperts.args

LIBRARY = KernelLibrary(
    "moe_cpu",
    {
        "moe_route_f32": (None, PTR, I64, I64, I64, I32, I64, I64, PTR, PTR, PTR, PTR, I32),
        "moe_forward": (None, PTR, I64, I64, PTR, PTR, I64, PTR, *EXPERTS, PTR, PTR, PTR, PTR, I32),
    },
)


@dataclass
class PackedExperts:
    """A layer's expert weights in moe_cpu.c's column panels, and the kernel library they are for."""

    kernel: CpuKernel
    w13: torch.Tensor  # (experts, 2I / width, groups of H, width, G), the weights' dtype (CpuKernel.panels)
    layout13: Layout
    w2: torch.Tensor  # (experts, H / width, groups of I, width, G)
    layout2: Layout
    hidden: int
    intermediate: int
    format: int | None = None  # tiles.h's W_*; None: the weights' dtype's (FORMATS)

    def __post_init__(self) -> None:
        l13, l2 = self.layout13, self.layout2
        # the kernel's weight arguments, read once, not at every call
        self.args = (
            FORMATS[self.w13.dtype] if self.format is None else self.format,
            self.w13,
            *l13.args(),
            l13.width,
            self.w2,
            *l2.args(),
            l2.width,
            self.hidden,
            self.intermediate,
        )


def pack_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scale13: torch.Tensor | None = None,
    scale2: torch.Tensor | None = None,
    block13: tuple[int, int] = BLOCK,
    block2: tuple[int, int] = BLOCK,
    offset13: tuple[int, int] = (0, 0),
    offset2: tuple[int, int] = (0, 0),
) -> PackedExperts | None:
    """(experts, 2I, H) and (experts, H, I) weights packed for the kernel in their dtype (both float32,
    bfloat16, float16 or float8_e4m3fn), or None where it cannot run them (another dtype or device, a
    width not a multiple of the vector width, FP8 panels that would straddle scale blocks, or no kernel
    built). FP8 block scales (experts, row blocks, column blocks), blocks and offsets as `linear_cpu.pack`
    takes them; gate and up stacked in w13 give theirs per row (`quantization.row_scales`, block13 (1,
    columns))."""
    check_scale(w13, scale13, block13, offset13)
    check_scale(w2, scale2, block2, offset2)
    if w13.device.type != "cpu" or w13.dtype not in FORMATS or w2.dtype != w13.dtype:
        return None
    kernel = LIBRARY.get()
    if kernel is None:
        return None
    layout13 = panel_layout(kernel, w13, scale13, block13, offset13)
    layout2 = panel_layout(kernel, w2, scale2, block2, offset2)
    if layout13 is None or layout2 is None:
        return None
    p13, p2 = kernel.panels(w13, layout13.width, layout13.lead), kernel.panels(w2, layout2.width, layout2.lead)
    return PackedExperts(kernel, p13, layout13, p2, layout2, w13.shape[2], w2.shape[2])


def pack_int_experts(
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    bits: int,
    group_size: int | None,
    int8_activations: bool = False,
) -> PackedExperts | None:
    """Integer experts, each (codes, scales, zero points or None) as `linear_cpu.pack_int` takes one weight,
    with a leading dimension of experts: w13 (experts, 2I, H * bits / 8), w2 (experts, H, I * bits / 8); None
    where the kernel is not built, they are not on CPU, 2I or H is not whole vectors, or a zero point is not a
    byte. `int8_activations`: W8A8, the inputs of both products rounded to int8 per row by the kernel."""
    if w13[0].device.type != "cpu" or not (fits_bytes(w13[2]) and fits_bytes(w2[2])):
        return None
    kernel = LIBRARY.get()
    if kernel is None:
        return None
    (codes13, scale13, zero13), (codes2, scale2, zero2) = w13, w2
    if codes13.shape[-2] % kernel.lanes or codes2.shape[-2] % kernel.lanes:
        return None
    p13, layout13 = int_panels(kernel, codes13, bits, scale13, zero13, group_size, int8_activations)
    p2, layout2 = int_panels(kernel, codes2, bits, scale2, zero2, group_size, int8_activations)
    hidden, intermediate = codes2.shape[-2], codes2.shape[-1] * 8 // bits
    form = W_I8 if int8_activations else INT_FORMATS[bits]
    return PackedExperts(kernel, p13, layout13, p2, layout2, hidden, intermediate, form)


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
    summed; experts held by other ranks (outside expert_start ... + this rank's count) are left out. In
    float32, returned in x's dtype."""
    tokens, experts = x.shape[0], packed.w13.shape[0]
    pairs = tokens * top_k
    kernel, threads = packed.kernel, torch.get_num_threads()
    order, chosen = scratch(pairs, torch.int64, "order"), scratch(pairs, torch.int64, "chosen")
    starts, weights = scratch(experts + 2, torch.int64, "starts"), scratch(pairs, torch.float32, "weights")
    logits = _float32(router_logits)
    kernel.moe_route_f32(
        logits,
        tokens,
        logits.shape[1],
        top_k,
        renormalize,
        expert_start,
        experts,
        weights,
        order,
        starts,
        chosen,
        threads,
    )
    out = torch.empty(x.shape, dtype=torch.float32)
    ys, pos = scratch(pairs * packed.hidden, torch.float32), scratch(pairs, torch.int64)
    gate_up = scratch(threads * CHUNK * 2 * packed.intermediate, torch.float32, "gate_up")
    dtype, x = x.dtype, _float32(x)
    kernel.moe_forward(x, tokens, top_k, order, starts, experts, weights, *packed.args, out, ys, pos, gate_up, threads)
    return out if dtype == torch.float32 else out.to(dtype)


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
