"""Attention backends, picked automatically: the C kernel on CPU (`cpu`), FlashInfer on CUDA, and pure torch
(the reference, and wherever neither runs)."""

from __future__ import annotations

import importlib.util

from vlm_serve.llm.kernels import attention_cpu
from vlm_serve.llm.layers.attention.base import AttentionBackend
from vlm_serve.llm.layers.attention.cpu_backend import CpuAttnBackend
from vlm_serve.llm.layers.attention.torch_backend import TorchAttnBackend
from vlm_serve.llm.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


def create_attention_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: TokenToKVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scaling: float,
) -> AttentionBackend:
    """`auto` is FlashInfer on CUDA when it is installed, the C kernel on CPU where it runs the cache's dtype
    and head size (and was built), else torch."""
    on_cuda = token_to_kv_pool.device.type == "cuda"
    cpu_runs = not on_cuda and attention_cpu.supported(token_to_kv_pool.dtype, head_dim)
    if name == "auto":
        name = "flashinfer" if on_cuda and importlib.util.find_spec("flashinfer") else "cpu" if cpu_runs else "torch"
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
    if not on_cuda:
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    from vlm_serve.llm.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(req_to_token_pool, token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)


__all__ = ["AttentionBackend", "CpuAttnBackend", "TorchAttnBackend", "create_attention_backend"]
