"""FlashInfer paged attention for CUDA.

The KV pool is viewed as pages of one slot each, so a request's KV is simply the list of its slots from
`req_to_token`, whatever page size the allocator uses. Prefill/extend runs FlashInfer's batch prefill
over the paged cache (new K/V are written first; its causal mask aligns queries to the end of each
sequence, which is exactly "prefix + new tokens up to itself"); decode runs its batch decode kernel.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention.base import AttentionBackend
from vlm_serve.llm.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

WORKSPACE_BYTES = 256 * 1024 * 1024


@dataclass
class _Metadata:
    kv_indptr: torch.Tensor  # (batch + 1,) host
    kv_indices: torch.Tensor  # KV slots of every request, back to back (device)
    last_page_len: torch.Tensor  # (batch,) host: pages of one slot are always full
    qo_indptr: torch.Tensor | None  # (batch + 1,) host; None for decode


class FlashInferAttnBackend(AttentionBackend):
    """Plans FlashInfer's wrappers in `begin_forward`, on the forward's stream, from index tensors the
    scheduler gathered when it built the batch."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: TokenToKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
    ) -> None:
        import flashinfer  # imported here: CUDA only

        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = scaling
        device = token_to_kv_pool.device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def init_forward_metadata(self, batch: ForwardBatch) -> _Metadata:
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
        kv_indices = torch.cat([rows[i, :n] for i, n in enumerate(batch.seq_lens_cpu)]).to(torch.int32)
        # index pointers are built on the host: FlashInfer's planning reads them there
        kv_indptr = torch.tensor([0, *itertools.accumulate(batch.seq_lens_cpu)], dtype=torch.int32)
        qo_indptr = None
        if not batch.forward_mode.is_decode():
            qo_indptr = torch.tensor([0, *itertools.accumulate(batch.extend_lens_cpu)], dtype=torch.int32)
        return _Metadata(kv_indptr, kv_indices, torch.ones(batch.batch_size, dtype=torch.int32), qo_indptr)

    def begin_forward(self, batch: ForwardBatch) -> None:
        meta: _Metadata = batch.attn_metadata
        dtype = self.token_to_kv_pool.dtype
        if meta.qo_indptr is None:
            self.decode.plan(
                meta.kv_indptr, meta.kv_indices, meta.last_page_len, self.num_heads, self.num_kv_heads,
                self.head_dim, 1, sm_scale=self.scaling, q_data_type=dtype, kv_data_type=dtype,
            )
            return
        self.prefill.plan(
            meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len, self.num_heads,
            self.num_kv_heads, self.head_dim, 1, causal=True, sm_scale=self.scaling, q_data_type=dtype,
            kv_data_type=dtype,
        )

    def forward(self, q, k, v, layer_id, scaling, batch):
        self.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # (slots, page_size=1, kv_heads, dim)
        wrapper = self.decode if batch.forward_mode.is_decode() else self.prefill
        return wrapper.run(q.contiguous(), paged)
