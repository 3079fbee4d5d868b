"""FlashInfer paged attention for CUDA.

The KV pool is viewed as pages of one slot each, so a request's KV is simply the list of its slots from
`req_to_token`, whatever page size the allocator uses. Prefill/extend runs FlashInfer's batch prefill
over the paged cache (new K/V are written first; its causal mask aligns queries to the end of each
sequence, which is exactly "prefix + new tokens up to itself"); decode runs its batch decode kernel.
For CUDA graphs (`CudaGraphRunner`), one decode wrapper per captured batch size reads fixed index
buffers, which `plan_cuda_graph` fills before each replay.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from vlm_serve.kv_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention.base import AttentionBackend

WORKSPACE_BYTES = 256 * 1024 * 1024


@dataclass
class _Metadata:
    kv_indptr: torch.Tensor  # (batch + 1,) host
    kv_indices: torch.Tensor  # KV slots of every request, back to back (device)
    last_page_len: torch.Tensor  # (batch,) host: pages of one slot are always full
    qo_indptr: torch.Tensor | None  # (batch + 1,) host; None for decode
    graph_batch_size: int = 0  # a captured graph's batch (its decode wrapper's); 0: run eagerly


def padded_decode_indices(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, batch_size: int):
    """A decode batch's KV index pointers and slots, padded to `batch_size` rows: each padding row holds
    one slot, slot 0 (the pool's dummy slot, which the padding rows also write)."""
    pad = batch_size - (len(kv_indptr) - 1)
    indptr = torch.cat([kv_indptr, kv_indptr[-1] + torch.arange(1, pad + 1, dtype=kv_indptr.dtype)])
    return indptr, torch.cat([kv_indices, kv_indices.new_zeros(pad)])


class FlashInferAttnBackend(AttentionBackend):
    """Plans FlashInfer's wrappers in `begin_forward`, on the forward's stream, from index tensors the
    scheduler gathered when it built the batch."""

    supports_cuda_graph = True

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
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_decode: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}
        self.planned = torch.cuda.Event()  # after the last plan's copy to the device (`_plan`)

    def init_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """A decode wrapper of fixed batch size for each of `batch_sizes`, its index buffers on the device
        (the slots' buffer, shared, holds every slot of the pool plus one per padding row)."""
        import flashinfer

        device = self.token_to_kv_pool.device
        slots = torch.zeros(self.token_to_kv_pool.size + 1 + max(batch_sizes), dtype=torch.int32, device=device)
        self.graph_decode = {
            size: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=slots,
                paged_kv_last_page_len_buffer=torch.ones(size, dtype=torch.int32, device=device),
            )
            for size in batch_sizes
        }

    def cuda_graph_metadata(self, batch_size: int) -> _Metadata:
        """The metadata of a captured graph's batch: its decode wrapper, planned by `plan_cuda_graph`."""
        empty = torch.zeros(1, dtype=torch.int32)
        return _Metadata(empty, empty[:0].to(self.token_to_kv_pool.device), empty[:0], None, batch_size)

    def plan_cuda_graph(self, batch_size: int, meta: _Metadata) -> None:
        """Plans the graph wrapper of `batch_size` for the decode batch of `meta`, padded to that size."""
        indptr, indices = padded_decode_indices(meta.kv_indptr, meta.kv_indices, batch_size)
        dtype = self.token_to_kv_pool.dtype
        self._plan(
            self.graph_decode[batch_size],
            indptr,
            indices,
            torch.ones(batch_size, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            sm_scale=self.scaling,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

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
            self._plan(
                self.decode,
                meta.kv_indptr,
                meta.kv_indices,
                meta.last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                1,
                sm_scale=self.scaling,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
            return
        self._plan(
            self.prefill,
            meta.qo_indptr,
            meta.kv_indptr,
            meta.kv_indices,
            meta.last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            causal=True,
            sm_scale=self.scaling,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """`wrapper.plan(...)`. A plan fills a page-locked host buffer of its wrapper and copies it to the
        device asynchronously, on the stream: under the overlap loop the host plans the next batch while the
        device runs this one, so it first waits until the device has taken the last plan's copy (by then
        it has, in practice: the host waited for the batch before that one's tokens)."""
        self.planned.synchronize()
        wrapper.plan(*args, **kwargs)
        self.planned.record()

    def forward(self, q, k, v, layer_id, scaling, batch):
        self.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # (slots, page_size=1, kv_heads, dim)
        meta: _Metadata = batch.attn_metadata
        if meta.graph_batch_size:
            wrapper = self.graph_decode[meta.graph_batch_size]
        else:
            wrapper = self.decode if batch.forward_mode.is_decode() else self.prefill
        return wrapper.run(q.contiguous(), paged)
