"""Linear layers through linear_cpu.c: float32 on CPU, the weight packed once into column panels."""

from __future__ import annotations

import ctypes

import torch

from vlm_serve.llm.kernels import I32, I64, LANES, PTR, bound_library, panels


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """An (out, in) weight in column panels (`kernels.panels`); None where the kernel cannot run it (not
    float32 on CPU, `out` not a multiple of 16, no kernel built)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] % LANES or _kernel() is None:
        return None
    return panels(weight)


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for the weight `pack` made `panels` of; x: (..., in)."""
    count, inp, width = panels.shape
    lead = x.shape[:-1]
    x = x.reshape(-1, inp)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(*lead, count * width, dtype=x.dtype)
    _kernel().linear_f32(
        x.data_ptr(), x.shape[0], inp, x.stride(0), panels.data_ptr(), count * width, width,
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def _kernel() -> ctypes.CDLL | None:
    return bound_library(
        "linear_cpu", {"linear_f32": (None, PTR, I64, I64, I64, PTR, I64, I32, PTR, PTR, I32)}
    )
