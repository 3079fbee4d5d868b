"""The two lower levels of the KV cache.

`ReqToTokenPool` maps (request row, position) to a KV slot. `TokenToKVPool` stores every layer's K and V
by slot. Slot 0 is never handed out: it is the dummy slot padded batches write into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_serve.kv_cache import store_triton


class ReqToTokenPool:
    """A table with one row per running request: `req_to_token[row, pos]` is the KV slot of that token."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need: int) -> list[int] | None:
        if need > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return rows

    def free(self, rows: int | list[int]) -> None:
        self.free_slots.extend([rows] if isinstance(rows, int) else rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots


@dataclass(frozen=True)
class KVPoolLayout:
    """How every KV pool (device, host, a PD peer's) stores a token: per layer one K and one V row of
    (num_kv_heads, head_dim) in `dtype`, slots handed out in pages of `page_size`. The one place the page
    size is kept; everything else reads it from here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one token takes (every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class TokenToKVPool:
    """Per-layer K and V buffers of shape (num_slots, kv_heads, head_dim), indexed by KV slot. Readers go
    through `get_kv` (one layer's views), `buffers` (all of them, for registering memory) and `layout`."""

    def __init__(self, size: int, layout: KVPoolLayout, device: torch.device, pin_memory: bool = False) -> None:
        self.size = size
        self.layout = layout
        self.device = device
        # one extra page in front: slot 0 (the dummy slot) lives there and is never allocated
        shape = (size + layout.page_size, layout.num_kv_heads, layout.head_dim)

        def buffer() -> torch.Tensor:
            return torch.zeros(shape, dtype=layout.dtype, device=device, pin_memory=pin_memory)

        self._k = [buffer() for _ in range(layout.num_layers)]
        self._v = [buffer() for _ in range(layout.num_layers)]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if store_triton.store_kv_handles(k, v, self._k[layer_id]):
            store_triton.store_kv(self._k[layer_id], self._v[layer_id], slots, k, v)
            return
        self._k[layer_id][slots] = k.to(self.dtype)
        self._v[layer_id][slots] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s K and V buffers, (num_slots, kv_heads, head_dim) each."""
        return self._k[layer_id], self._v[layer_id]

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's K buffer, then every layer's V buffer."""
        return [*self._k, *self._v]
