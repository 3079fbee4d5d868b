"""Attention backends: pure torch (CPU, reference) and FlashInfer (CUDA), picked automatically."""

from __future__ import annotations

import importlib.util

from vlm_serve.llm.layers.attention.base import AttentionBackend
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
    """`auto` is FlashInfer on CUDA when it is installed, else torch."""
    on_cuda = token_to_kv_pool.device.type == "cuda"
    if name == "auto":
        name = "flashinfer" if on_cuda and importlib.util.find_spec("flashinfer") else "torch"
    if name == "torch":
        return TorchAttnBackend(req_to_token_pool, token_to_kv_pool)
    if not on_cuda:
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    from vlm_serve.llm.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(req_to_token_pool, token_to_kv_pool, num_heads, num_kv_heads, head_dim, scaling)


__all__ = ["AttentionBackend", "create_attention_backend"]
