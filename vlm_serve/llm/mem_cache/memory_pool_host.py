"""The host-memory tier of the KV cache (HiCache's L2): pages of K and V in host memory, several times the
device pool's size, with the copies between the two pools.

On CUDA the buffers are pinned, so copies to and from the device run at the bus's speed. On CPU both pools
are host memory and the copies are plain gathers and scatters: the code path is the same. The copies run
wherever the caller runs them; `HiCacheController` keeps them in launch order with the forwards.
"""

from __future__ import annotations

import torch

from vlm_serve.llm.mem_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.llm.mem_cache.memory_pool import TokenToKVPool


class TokenToKVPoolHost:
    """Per-layer K and V in host memory, laid out as the device pool's (slot, kv_heads, head_dim), with an
    allocator of its own."""

    def __init__(self, device_pool: TokenToKVPool, size: int) -> None:
        page_size = device_pool.page_size
        size -= size % page_size
        if size < page_size:
            raise ValueError(f"the host KV pool must hold at least one page ({page_size} tokens), not {size}")
        self.size = size
        self.page_size = page_size
        self.dtype = device_pool.dtype
        self.num_layers = len(device_pool.k_buffer)
        _, self.num_kv_heads, self.head_dim = device_pool.k_buffer[0].shape
        pin = device_pool.device.type == "cuda"
        num_slots = size + page_size  # as the device pool: page 0 is never handed out

        def buffer() -> torch.Tensor:
            return torch.zeros(num_slots, self.num_kv_heads, self.head_dim, dtype=self.dtype, pin_memory=pin)

        self.k_buffer = [buffer() for _ in range(self.num_layers)]
        self.v_buffer = [buffer() for _ in range(self.num_layers)]
        self.allocator = TokenToKVPoolAllocator(size, page_size, torch.device("cpu"))

    @property
    def size_per_token(self) -> int:
        """Bytes of K and V one token takes (every layer)."""
        return TokenToKVPool.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def backup_from_device(self, device_pool: TokenToKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor):
        """Copies the KV of `device_slots` into `host_slots`, every layer."""
        device_slots = device_slots.to(device_pool.device)
        for layer in range(self.num_layers):
            for src, dst in ((device_pool.k_buffer, self.k_buffer), (device_pool.v_buffer, self.v_buffer)):
                dst[layer].index_copy_(0, host_slots, src[layer].index_select(0, device_slots).cpu())

    def load_to_device(self, device_pool: TokenToKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor):
        """Copies the KV of `host_slots` into `device_slots`, every layer."""
        device = device_pool.device
        device_slots = device_slots.to(device)
        for layer in range(self.num_layers):
            for src, dst in ((self.k_buffer, device_pool.k_buffer), (self.v_buffer, device_pool.v_buffer)):
                dst[layer].index_copy_(0, device_slots, src[layer].index_select(0, host_slots).to(device))

    def get_pages(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV of `host_slots` (whole pages) as one tensor (pages, layers, 2, page_size, kv_heads, head_dim):
        what the storage tier keeps of each page."""
        k = torch.stack([b.index_select(0, host_slots) for b in self.k_buffer])
        v = torch.stack([b.index_select(0, host_slots) for b in self.v_buffer])
        kv = torch.stack([k, v], dim=1)  # (layers, 2, tokens, heads, dim)
        pages = kv.view(self.num_layers, 2, -1, self.page_size, self.num_kv_heads, self.head_dim)
        return pages.permute(2, 0, 1, 3, 4, 5).contiguous()

    def set_pages(self, host_slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Writes `pages` (as `get_pages` gives them) into `host_slots`."""
        kv = pages.permute(1, 2, 0, 3, 4, 5).reshape(self.num_layers, 2, -1, self.num_kv_heads, self.head_dim)
        for layer in range(self.num_layers):
            self.k_buffer[layer].index_copy_(0, host_slots, kv[layer, 0])
            self.v_buffer[layer].index_copy_(0, host_slots, kv[layer, 1])

    def page_shape(self) -> tuple[int, ...]:
        """The shape of one page as `get_pages` gives it."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
