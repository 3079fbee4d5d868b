"""Attention on CPU through attention_cpu.c: every request of a batch, prefill or decode, in one kernel
call per layer that reads K/V straight from the paged pool."""

from __future__ import annotations

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.kernels.attention_cpu import PagedBatch, paged_attention, paged_batch
from vlm_serve.llm.layers.attention.base import AttentionBackend


class CpuAttnBackend(AttentionBackend):
    """Float32 K/V on CPU, a head size a multiple of the vector width (`kernels.attention_cpu.supported`)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> PagedBatch:
        # a copy: the scheduler may hand a finished request's row to a new one while this batch runs
        kv_slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices, : max(batch.seq_lens_cpu)]
        return paged_batch(kv_slots, batch.seq_lens_cpu, batch.extend_lens_cpu, batch.out_cache_loc)

    def forward(self, q, k, v, layer_id, scaling, batch):
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        return paged_attention(q, k, v, k_cache, v_cache, batch.attn_metadata, scaling)
