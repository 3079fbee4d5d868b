"""Attention backends, picked automatically: the C kernel on CPU (`cpu`), FlashInfer on CUDA, and pure torch
(the reference, and wherever neither runs)."""

from __future__ import annotations

import importlib.util

import torch

from vlm_serve.kv_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.kernels import attention_cpu
from vlm_serve.llm.layers.attention.base import AttentionBackend
from vlm_serve.llm.layers.attention.cpu_backend import CpuAttnBackend
from vlm_serve.llm.layers.attention.torch_backend import TorchAttnBackend

FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)  # its kernels' (no float32)
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # its Hopper prefill kernels' (they static-assert on others)


def flashinfer_runs(token_to_kv_pool: TokenToKVPool, head_dim: int) -> bool:
    """Whether FlashInfer runs this KV cache: on CUDA, in half precision, at one of its head sizes."""
    pool = token_to_kv_pool
    return pool.device.type == "cuda" and pool.dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS


def create_attention_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: TokenToKVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scaling: float,
) -> AttentionBackend:
    """`auto` is FlashInfer on CUDA when it is installed and runs the cache's dtype and head size, the C
    kernel on CPU where it runs them (and was built), else torch."""
    on_cuda = token_to_kv_pool.device.type == "cuda"
    cpu_runs = not on_cuda and attention_cpu.supported(token_to_kv_pool.dtype, head_dim)
    if name == "auto":
        flashinfer = flashinfer_runs(token_to_kv_pool, head_dim) and importlib.util.find_spec("flashinfer") is not None
        name = "flashinfer" if flashinfer else "cpu" if cpu_runs else "torch"
    if name == "torch":
        return TorchAttnBackend(req_to_token_pool, token_to_kv_pool)
    if name == "cpu":
        if not cpu_runs:
            raise ValueError(
                "the cpu attention backend needs a float32 KV cache on CPU, a head size a multiple of the kernel's "
                "vector width (16 floats with AVX-512, 8 with AVX2, 4 with NEON) and the kernel built (here: "
                f"{token_to_kv_pool.dtype}, head size {head_dim}, on {token_to_kv_pool.device.type})"
            )
        return CpuAttnBackend(req_to_token_pool, token_to_kv_pool)
    if not flashinfer_runs(token_to_kv_pool, head_dim):
        raise ValueError(
            "the flashinfer attention backend needs a CUDA device, a bfloat16 or float16 KV cache and a head size "
            f"of {', '.join(map(str, FLASHINFER_HEAD_DIMS))} (here: {token_to_kv_pool.dtype}, head size {head_dim}, "
            f"on {token_to_kv_pool.device.type})"
        )
    from vlm_serve.llm.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(req_to_token_pool, token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)


__all__ = ["AttentionBackend", "CpuAttnBackend", "TorchAttnBackend", "create_attention_backend"]
