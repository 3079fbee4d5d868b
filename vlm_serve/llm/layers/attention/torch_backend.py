"""Pure-torch attention over the paged KV pool: gather each request's K/V by slot, then SDPA.

Used on CPU and as the reference for the GPU backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention.base import AttentionBackend


class TorchAttnBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
        if batch.forward_mode.is_decode():
            # one query per request: pad every request's slots to the longest and mask the padding
            max_len = max(batch.seq_lens_cpu)
            self.decode_slots = rows[:, :max_len]
            valid = torch.arange(max_len, device=rows.device)[None, :] < batch.seq_lens[:, None]
            self.decode_mask = valid[:, None, None, :]  # (batch, 1, 1, max_len)
            return
        self.extend_slots = [rows[i, :n] for i, n in enumerate(batch.seq_lens_cpu)]
        self.extend_masks = [
            _causal_mask(p, e, rows.device) for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)
        ]

    def forward(self, q, k, v, layer_id, scaling, batch):
        self.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        if batch.forward_mode.is_decode():
            keys = k_cache[self.decode_slots].transpose(1, 2)  # (batch, kv_heads, len, dim)
            values = v_cache[self.decode_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=self.decode_mask, scale=scaling, enable_gqa=True
            )
            return out.squeeze(2)
        out = torch.empty_like(q)
        start = 0
        for slots, mask, n in zip(self.extend_slots, self.extend_masks, batch.extend_lens_cpu):
            query = q[start : start + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, dim)
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0)
            values = v_cache[slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out


def _causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """(extend_len, prefix_len + extend_len): new token j sees the prefix and new tokens up to itself."""
    q_pos = torch.arange(extend_len, device=device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    return k_pos <= q_pos
