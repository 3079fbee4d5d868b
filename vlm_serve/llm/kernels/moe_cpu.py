"""The MoE experts of one layer through moe_cpu.c: float32 on CPU, one call for every expert."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import cpu_library

LANES = 16  # floats per vector in moe_cpu.c


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
    (p13, width13), (p2, width2) = _panels(w13), _panels(w2)
    return PackedExperts(p13, width13, p2, width2, hidden, intermediate)


def _panels(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(experts, out, in) -> (experts, out / width, in, width): `width` output columns of every input
    row together (64 where they divide, else 16)."""
    experts, out, inp = w.shape
    width = 4 * LANES if out % (4 * LANES) == 0 else LANES
    return w.view(experts, out // width, width, inp).permute(0, 1, 3, 2).contiguous(), width


def moe_forward(
    x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, top_k: int, packed: PackedExperts
) -> torch.Tensor:
    """The experts' part of the layer's output, (tokens, hidden): for each token the sum of its pairs'
    expert outputs times their routing weights. Pair t * top_k + k is token t's k-th choice; `order`
    lists the pairs grouped by local expert (`counts[e]` pairs for expert e, then pairs for experts
    held elsewhere, which are left out); `weights` are the pairs' routing weights."""
    tokens, pairs = x.shape[0], order.numel()
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    out = torch.empty_like(x)
    ys, pos = _scratch(pairs * packed.hidden, torch.float32), _scratch(pairs, torch.int64)
    x, weights = x.contiguous(), weights.contiguous().float()
    _kernel().moe_forward_f32(
        x.data_ptr(), tokens, top_k, order.data_ptr(), starts.data_ptr(), counts.numel(), weights.data_ptr(),
        packed.w13.data_ptr(), packed.width13, packed.w2.data_ptr(), packed.width2, packed.hidden,
        packed.intermediate, out.data_ptr(), ys.data_ptr(), pos.data_ptr(), torch.get_num_threads(),
    )
    return out


_buffers = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer of at least `numel` elements, kept per thread and dtype across layers and steps:
    a fresh one each call would cost its page faults again."""
    held = getattr(_buffers, str(dtype), None)
    if held is None or held.numel() < numel:
        held = torch.empty(numel, dtype=dtype)
        setattr(_buffers, str(dtype), held)
    return held


def _kernel() -> ctypes.CDLL | None:
    lib = cpu_library("moe_cpu")
    if lib is not None and lib.moe_forward_f32.argtypes is None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.moe_forward_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i32, ptr, i32, i64, i64, ptr, ptr, ptr, i32]
        lib.moe_forward_f32.restype = None
    return lib
