"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from vlm_serve.kv_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes causal attention of a batch's new tokens over their requests' cached K/V.

    Three calls per forward. `init_forward_metadata` runs when the scheduler builds the batch and returns
    its index tensors (stored as `batch.attn_metadata`): it is the only one that reads `req_to_token`,
    which the scheduler goes on changing while earlier batches run. `begin_forward` runs just before the
    model does, in launch order (state kept between forwards belongs here). `forward` runs per layer: it
    stores the new K/V in the pool, then attends over prefix + new tokens.
    """

    supports_cuda_graph = False  # whether decode forwards can be captured (`CudaGraphRunner`)

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> Any: ...

    def begin_forward(self, batch: ForwardBatch) -> None:
        """Called right before the model runs `batch`."""

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
