"""Hands out KV slots page by page.

A request's tokens fill its pages in order: a new token goes into the free tail of the request's last
page, and only a token that starts a page takes a fresh page. With page_size 1 this is plain slot
allocation.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int, device: torch.device) -> None:
        if size % page_size != 0:
            raise ValueError(f"KV pool size {size} is not a multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.device = device
        # page 0 holds the dummy slot 0 and is never handed out; pages are taken from the end
        self.free_pages = list(range(size // page_size, 0, -1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def _take_pages(self, n: int) -> list[int] | None:
        if n > len(self.free_pages):
            return None
        if n == 0:
            return []
        pages = self.free_pages[-n:]
        del self.free_pages[-n:]
        return pages[::-1]

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` tokens that start on a page boundary."""
        pages = self._take_pages(-(-num_tokens // self.page_size))
        if pages is None:
            return None
        slots = torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size + torch.arange(self.page_size)
        return slots.flatten()[:num_tokens].to(self.device)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for positions prefix_len..seq_len-1 of each request, concatenated.

        `last_locs[i]` is the slot of request i's token at prefix_len-1 (ignored when prefix_len is 0).
        Returns None, taking nothing, when the pool cannot hold them.
        """
        ps = self.page_size
        need_pages = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens))
        pages = self._take_pages(need_pages)
        if pages is None:
            return None
        # Built with numpy in one pass per request: with a torch op per page, a picture's 1,041-token prompt
        # took 9 ms at page_size 1 (0.09 ms so).
        page_slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
        out: list[np.ndarray] = []
        taken = 0  # slots of page_slots handed out
        for prefix_len, seq_len, last_loc in zip(prefix_lens, seq_lens, last_locs):
            tail = min(seq_len, -(-prefix_len // ps) * ps)  # fill the rest of the current page first
            if tail > prefix_len:
                out.append(np.arange(last_loc + 1, last_loc + 1 + tail - prefix_len))
            fresh = seq_len - max(tail, prefix_len)
            if fresh > 0:
                out.append(page_slots[taken : taken + fresh])
                taken += -(-fresh // ps) * ps
        slots = np.concatenate(out) if out else np.empty(0, dtype=np.int64)
        return torch.from_numpy(slots.astype(np.int64, copy=False)).to(self.device)

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for its token at position seq_len-1 (the per-step hot path)."""
        ps = self.page_size
        if ps == 1:
            pages = self._take_pages(len(seq_lens))
            return None if pages is None else torch.tensor(pages, dtype=torch.int64, device=self.device)
        opens_page = [(s - 1) % ps == 0 for s in seq_lens]
        pages = self._take_pages(sum(opens_page))
        if pages is None:
            return None
        page_iter = iter(pages)
        slots = [next(page_iter) * ps if new else last + 1 for new, last in zip(opens_page, last_locs)]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        """Frees the pages of `slots`; a page must be freed only when all its slots are released."""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots // self.page_size).tolist()
        self.free_pages.extend(pages)
