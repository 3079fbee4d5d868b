"""Pure-torch attention over the paged KV pool: gather each request's K/V by slot, then SDPA.

Used on CPU and as the reference for the GPU backends. Decode batches keep a dense mirror of their
K/V between steps (see `TorchAttnBackend`), which doubles the running batch's KV memory: fine on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention.base import AttentionBackend
from vlm_serve.llm.layers.sdpa import sdpa

MIRROR_SPARE_TOKENS = 64  # room to grow, so that most decode steps only append to the mirror


@dataclass
class _ExtendMetadata:
    slots: list[torch.Tensor]  # per request: the KV slots of its prefix and new tokens
    masks: list[torch.Tensor]  # per request: (new tokens, all tokens) causal mask


@dataclass
class _DecodeMetadata:
    index: tuple[torch.Tensor, torch.Tensor]  # (mirror row, position) of each request's new token
    max_len: int
    mask: torch.Tensor  # (batch, 1, 1, max_len): which mirror positions each request attends to
    capacity: int  # positions per mirror row
    build_slots: torch.Tensor | None  # pool slots to gather a fresh mirror from, (batch * capacity,)
    keep: torch.Tensor | None  # rows of the current mirror to keep, in batch order (requests left)


@dataclass
class _MirrorPlan:
    """What the mirror will hold once the last planned forward has run: the scheduler plans the next
    forward against it, before the forwards already launched have run."""

    rows: list[int]  # request rows, in batch order
    lens: list[int]  # tokens held per request
    capacity: int


class TorchAttnBackend(AttentionBackend):
    """Gathers K/V by slot and runs SDPA; decode batches read a dense mirror instead of the pool.

    Gathering every request's K/V out of the paged pool costs a full copy per layer per step; the
    mirror (per layer `(batch, capacity, kv_heads, head_dim)`) is gathered once and then only receives
    each step's new token. A prefix's K/V never changes, so the copy stays exact while the batch keeps
    the same requests (or loses some); a request joins the decode batch only after an extend, which
    drops the mirror.
    """

    _plan: _MirrorPlan | None = None  # scheduler side
    # forward side: (rows, capacity, kv_heads, head_dim) buffers, one per pool buffer (every layer's K, then
    # every layer's V), kept between builds (fresh ones would cost page faults every time); the mirror is
    # their first `_rows` rows
    _buffers: list[torch.Tensor] | None = None
    _rows = 0

    def init_forward_metadata(self, batch: ForwardBatch) -> _ExtendMetadata | _DecodeMetadata:
        if not batch.forward_mode.is_decode():
            self._plan = None
            rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
            return _ExtendMetadata(
                [rows[i, :n].long() for i, n in enumerate(batch.seq_lens_cpu)],
                [_causal_mask(p, e, rows.device) for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)],
            )
        rows = batch.req_pool_indices.tolist()
        held = [n - 1 for n in batch.seq_lens_cpu]  # the new token's K/V arrives during the forward
        max_len = max(batch.seq_lens_cpu)
        device = batch.seq_lens.device
        plan, build_slots, keep = self._plan, None, None
        position = {r: i for i, r in enumerate(plan.rows)} if plan is not None else {}
        if (
            plan is None
            or max_len > plan.capacity
            or any(r not in position or plan.lens[position[r]] != n for r, n in zip(rows, held))
        ):
            plan = _MirrorPlan(rows, held, max_len + MIRROR_SPARE_TOKENS)
            # positions past a request's tokens gather slot 0 (the dummy slot): finite, and masked out
            build_slots = torch.zeros(len(rows), plan.capacity, dtype=torch.int64, device=device)
            build_slots[:, : max(held)] = self.req_to_token_pool.req_to_token[batch.req_pool_indices, : max(held)]
            build_slots = build_slots.flatten()
        elif plan.rows != rows:
            keep = torch.tensor([position[r] for r in rows], device=device)
        self._plan = _MirrorPlan(rows, list(batch.seq_lens_cpu), plan.capacity)
        valid = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
        return _DecodeMetadata(
            (torch.arange(len(rows), device=device), torch.tensor(held, device=device)),
            max_len,
            valid[:, None, None, :],
            plan.capacity,
            build_slots,
            keep,
        )

    def begin_forward(self, batch: ForwardBatch) -> None:
        meta = batch.attn_metadata
        if not isinstance(meta, _DecodeMetadata):
            self._rows = 0
        elif meta.build_slots is not None:
            self._build_mirror(meta, batch.batch_size)
        elif meta.keep is not None:
            for buffer in self._buffers:
                buffer[: len(meta.keep)] = buffer.index_select(0, meta.keep)
            self._rows = len(meta.keep)

    def forward(self, q, k, v, layer_id, scaling, batch):
        self.token_to_kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta = batch.attn_metadata
        if batch.forward_mode.is_decode():
            layers = self.token_to_kv_pool.layout.num_layers
            mirror_k, mirror_v = (self._buffers[i][: self._rows] for i in (layer_id, layers + layer_id))
            mirror_k[meta.index] = k.to(mirror_k.dtype)
            mirror_v[meta.index] = v.to(mirror_v.dtype)
            keys = mirror_k[:, : meta.max_len].transpose(1, 2)  # (batch, kv_heads, len, dim)
            values = mirror_v[:, : meta.max_len].transpose(1, 2)
            out = sdpa(q.unsqueeze(2), keys, values, attn_mask=meta.mask, scale=scaling, enable_gqa=True)
            return out.squeeze(2)
        k_cache, v_cache = self.token_to_kv_pool.get_kv(layer_id)
        out = torch.empty_like(q)
        start = 0
        for slots, mask, n in zip(meta.slots, meta.masks, batch.extend_lens_cpu):
            query = q[start : start + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, dim)
            keys = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            values = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
            o = sdpa(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def _build_mirror(self, meta: _DecodeMetadata, batch_size: int) -> None:
        pool = self.token_to_kv_pool
        shape = (pool.layout.num_kv_heads, pool.layout.head_dim)
        caches, mirrors = pool.buffers(), self._buffers
        if mirrors is None or mirrors[0].shape[0] < batch_size or mirrors[0].shape[1] != meta.capacity:
            rows = max(batch_size, mirrors[0].shape[0] if mirrors is not None else 0)
            self._buffers = mirrors = [cache.new_empty(rows, meta.capacity, *shape) for cache in caches]
        for cache, mirror in zip(caches, mirrors, strict=True):
            torch.index_select(cache, 0, meta.build_slots, out=mirror[:batch_size].view(-1, *shape))
        self._rows = batch_size


def _causal_mask(prefix_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """(extend_len, prefix_len + extend_len): new token j sees the prefix and new tokens up to itself."""
    q_pos = torch.arange(extend_len, device=device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + extend_len, device=device)[None, :]
    return k_pos <= q_pos
