"""Attention on CPU through attention_cpu.c: every request of a batch, prefill or decode, in one kernel
call per layer that reads K/V straight from the paged pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.kernels.attention_cpu import paged_attention
from vlm_serve.llm.layers.attention.base import AttentionBackend


@dataclass
class _Metadata:
    kv_slots: torch.Tensor  # (batch, longest sequence) int32: each request's slots, copied out of req_to_token
    seq_lens: torch.Tensor  # (batch,) int64
    ext_lens: torch.Tensor  # (batch,) int64: new tokens per request
    q_starts: torch.Tensor  # (batch,) int64: each request's first row among the new tokens


class CpuAttnBackend(AttentionBackend):
    """Float32 K/V on CPU, a head size a multiple of the vector width (`kernels.attention_cpu.supported`)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> _Metadata:
        # a copy: the scheduler may hand a finished request's row to a new one while this batch runs
        kv_slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices, : max(batch.seq_lens_cpu)]
        ext_lens = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
        return _Metadata(kv_slots, batch.seq_lens.to(torch.int64), ext_lens, ext_lens.cumsum(0) - ext_lens)

    def forward(self, q, k, v, layer_id, scaling, batch):
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        meta = batch.attn_metadata
        return paged_attention(
            q, k_cache, v_cache, meta.kv_slots, meta.seq_lens, meta.ext_lens, meta.q_starts, scaling,
            new_kv=(k, v, batch.out_cache_loc),
        )  # fmt: skip
