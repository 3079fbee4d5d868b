"""Linear layers through linear_cpu.c: float32 on CPU, the weight packed once into column panels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.kernels import I32, I64, PTR, CpuKernel, KernelLibrary

LIBRARY = KernelLibrary("linear_cpu", {"linear_f32": (None, PTR, I64, I64, I64, PTR, I64, I32, PTR, PTR, I32)})


@dataclass
class Panels:
    """An (out, in) weight in a kernel library's column panels, and that library."""

    kernel: CpuKernel
    weight: torch.Tensor  # (out / width, in, width)


def pack(weight: torch.Tensor) -> Panels | None:
    """An (out, in) weight in column panels (`CpuKernel.panels`); None where the kernel cannot run it (not
    float32 on CPU, `out` not a multiple of the vector width, no kernel built)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    kernel = LIBRARY.get()
    if kernel is None or weight.shape[0] % kernel.lanes:
        return None
    return Panels(kernel, kernel.panels(weight))


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for the weight `pack` made `panels` of; x: (..., in)."""
    count, inp, width = panels.weight.shape
    lead = x.shape[:-1]
    x = x.reshape(-1, inp)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(*lead, count * width, dtype=x.dtype)
    panels.kernel.linear_f32(
        x, x.shape[0], inp, x.stride(0), panels.weight, count * width, width, bias, y, torch.get_num_threads()
    )
    return y
