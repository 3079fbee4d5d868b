"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class AttentionBackend(ABC):
    """Computes causal attention of a batch's new tokens over their requests' cached K/V.

    `init_forward_metadata` runs once per forward (index tensors, planning); `forward` runs per layer:
    it stores the new K/V in the pool, then attends over prefix + new tokens.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (tokens, heads, head_dim)
        k: torch.Tensor,  # (tokens, kv_heads, head_dim)
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...  # (tokens, heads, head_dim)
