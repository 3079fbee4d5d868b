"""Pure-torch attention over the paged KV pool: gather each request's K/V by slot, then SDPA.

Used on CPU and as the reference for the GPU backends. Decode batches keep a dense mirror of their
K/V between steps (see `_DecodeMirror`), which doubles the running batch's KV memory: fine on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention.base import AttentionBackend


MIRROR_SPARE_TOKENS = 64  # room to grow, so that most decode steps only append to the mirror


@dataclass
class _DecodeMirror:
    """A dense copy of the decode batch's K/V, per layer (batch, capacity, kv_heads, head_dim).

    Gathering every request's K/V out of the paged pool costs a full copy per layer per step; the
    mirror is gathered once and then only receives each step's new token. A prefix's K/V never
    changes, so the copy stays exact while the batch keeps the same requests (or loses some).
    """

    rows: list[int]  # request rows, in batch order
    lens: list[int]  # tokens held per request
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


class TorchAttnBackend(AttentionBackend):
    """Gathers K/V by slot and runs SDPA; decode batches read a `_DecodeMirror` instead of the pool."""

    mirror: _DecodeMirror | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode():
            rows = batch.req_pool_indices.tolist()
            held = [n - 1 for n in batch.seq_lens_cpu]  # the new token's K/V arrives during the forward
            max_len = max(batch.seq_lens_cpu)
            if not self._reuse_mirror(rows, held, max_len):
                self.mirror = self._build_mirror(batch, rows, held, max_len + MIRROR_SPARE_TOKENS)
            self.mirror.lens = list(batch.seq_lens_cpu)
            device = batch.seq_lens.device
            self.decode_index = (torch.arange(len(rows), device=device), torch.tensor(held, device=device))
            self.decode_len = max_len
            valid = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
            self.decode_mask = valid[:, None, None, :]  # (batch, 1, 1, max_len)
            return
        self.mirror = None  # requests join only through extend: a new batch needs a new mirror
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
        self.extend_slots = [rows[i, :n].long() for i, n in enumerate(batch.seq_lens_cpu)]
        self.extend_masks = [
            _causal_mask(p, e, rows.device) for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)
        ]

    def forward(self, q, k, v, layer_id, scaling, batch):
        self.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        if batch.forward_mode.is_decode():
            mirror_k, mirror_v = self.mirror.k[layer_id], self.mirror.v[layer_id]
            mirror_k[self.decode_index] = k.to(mirror_k.dtype)
            mirror_v[self.decode_index] = v.to(mirror_v.dtype)
            keys = mirror_k[:, : self.decode_len].transpose(1, 2)  # (batch, kv_heads, len, dim)
            values = mirror_v[:, : self.decode_len].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=self.decode_mask, scale=scaling, enable_gqa=True
            )
            return out.squeeze(2)
        out = torch.empty_like(q)
        start = 0
        for slots, mask, n in zip(self.extend_slots, self.extend_masks, batch.extend_lens_cpu):
            query = q[start : start + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, dim)
            keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out


    def _reuse_mirror(self, rows: list[int], held: list[int], max_len: int) -> bool:
        """Keeps the mirror if it holds exactly these requests' K/V (dropping requests that left)."""
        m = self.mirror
        if m is None or max_len > m.capacity:
            return False
        if m.rows == rows:
            return m.lens == held
        position = {r: i for i, r in enumerate(m.rows)}
        if any(r not in position or m.lens[position[r]] != n for r, n in zip(rows, held)):
            return False
        keep = torch.tensor([position[r] for r in rows], device=m.k[0].device)
        m.k = [t.index_select(0, keep) for t in m.k]
        m.v = [t.index_select(0, keep) for t in m.v]
        m.rows, m.lens = rows, held
        return True

    def _build_mirror(self, batch: ForwardBatch, rows: list[int], held: list[int], capacity: int) -> _DecodeMirror:
        longest = max(held)
        slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices, :longest].flatten().long()
        pool = self.token_to_kv_pool
        ks, vs = [], []
        for layer_id in range(len(pool.k_buffer)):
            for buffers, out in ((pool.k_buffer, ks), (pool.v_buffer, vs)):
                cache = buffers[layer_id]
                dense = cache.new_zeros(len(rows), capacity, *cache.shape[1:])
                # index_select is several times faster than advanced indexing here
                dense[:, :longest] = cache.index_select(0, slots).view(len(rows), longest, *cache.shape[1:])
                out.append(dense)
        return _DecodeMirror(rows, held, ks, vs)


def _causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """(extend_len, prefix_len + extend_len): new token j sees the prefix and new tokens up to itself."""
    q_pos = torch.arange(extend_len, device=device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    return k_pos <= q_pos
