"""torch's scaled_dot_product_attention, with the kernels that take any shape as it comes.

cuDNN's attention is left out: it builds a plan for every new shape. On an H200 that was 1.8 ms a call,
and since every decode step of the torch attention backend has a new length, 90% of a step's time (the
GPU kit's profile). Flash and memory-efficient attention (and the math fallback, on CPU) have no such cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention(query, key, value, **kwargs)` on one of `SDPA_BACKENDS`."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
