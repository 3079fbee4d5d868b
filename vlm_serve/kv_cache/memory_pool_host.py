"""The host-memory tier of the KV cache (HiCache's L2): pages of K and V in host memory, several times the
device pool's size, with the copies between the two pools.

On CUDA the buffers are pinned, so copies to and from the device run at the bus's speed. On CPU both pools
are host memory and the copies are plain gathers and scatters: the code path is the same. The copies run
wherever the caller runs them; `HiCacheController` keeps them in launch order with the forwards.
"""

from __future__ import annotations

import torch

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.memory_pool import TokenToKVPool


class TokenToKVPoolHost(TokenToKVPool):
    """A KV pool in host memory of the device pool's layout, with an allocator of its own."""

    def __init__(self, device_pool: TokenToKVPool, size: int) -> None:
        page_size = device_pool.page_size
        size -= size % page_size
        if size < page_size:
            raise ValueError(f"the host KV pool must hold at least one page ({page_size} tokens), not {size}")
        cpu = torch.device("cpu")
        super().__init__(size, device_pool.layout, cpu, pin_memory=device_pool.device.type == "cuda")
        self.allocator = TokenToKVPoolAllocator(size, page_size, cpu)

    def backup_from_device(self, device_pool: TokenToKVPool, host_slots: torch.Tensor, device_slots: torch.Tensor):
        """Copies the KV of `device_slots` into `host_slots`, every layer."""
        device_slots = device_slots.to(device_pool.device)
        for src, dst in zip(device_pool.buffers(), self.buffers(), strict=True):
            dst.index_copy_(0, host_slots, src.index_select(0, device_slots).cpu())

    def load_to_device(self, device_pool: TokenToKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor):
        """Copies the KV of `host_slots` into `device_slots`, every layer."""
        device = device_pool.device
        device_slots = device_slots.to(device)
        for src, dst in zip(self.buffers(), device_pool.buffers(), strict=True):
            dst.index_copy_(0, device_slots, src.index_select(0, host_slots).to(device))

    def get_pages(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV of `host_slots` (whole pages) as one tensor (pages, layers, 2, page_size, kv_heads, head_dim):
        what the storage tier keeps of each page."""
        layout = self.layout
        kv = torch.stack([b.index_select(0, host_slots) for b in self.buffers()])  # (2 * layers, tokens, ...)
        pages = kv.view(2, layout.num_layers, -1, layout.page_size, layout.num_kv_heads, layout.head_dim)
        return pages.permute(2, 1, 0, 3, 4, 5).contiguous()

    def set_pages(self, host_slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Writes `pages` (as `get_pages` gives them) into `host_slots`."""
        layout = self.layout
        kv = pages.permute(2, 1, 0, 3, 4, 5).reshape(2 * layout.num_layers, -1, layout.num_kv_heads, layout.head_dim)
        for buffer, rows in zip(self.buffers(), kv, strict=True):
            buffer.index_copy_(0, host_slots, rows)

    def page_shape(self) -> tuple[int, ...]:
        """The shape of one page as `get_pages` gives it."""
        layout = self.layout
        return (layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
