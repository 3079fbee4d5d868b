"""The two lower levels of the KV cache.

`ReqToTokenPool` maps (request row, position) to a KV slot. `TokenToKVPool` stores every layer's K and V
by slot. Slot 0 is never handed out: it is the dummy slot padded batches write into.
"""

from __future__ import annotations

import torch

from vlm_serve.llm.kernels import rowwise_triton


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


class TokenToKVPool:
    """Per-layer K and V buffers of shape (num_slots, kv_heads, head_dim), indexed by KV slot."""

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        # one extra page in front: slot 0 (the dummy slot) lives there and is never allocated
        num_slots = size + page_size
        self.k_buffer = [
            torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if rowwise_triton.store_kv_handles(k, v, self.k_buffer[layer_id]):
            rowwise_triton.store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], slots, k, v)
            return
        self.k_buffer[layer_id][slots] = k.to(self.dtype)
        self.v_buffer[layer_id][slots] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    @property
    def size_per_token(self) -> int:
        """Bytes of K and V one token takes in this pool (every layer)."""
        _, heads, dim = self.k_buffer[0].shape
        return self.bytes_per_token(len(self.k_buffer), heads, dim, self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
