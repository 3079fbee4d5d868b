"""A prompt's ids as the scheduler holds them: each item's placeholder spans replaced by its pad value
(`mm_cache.hashing.pad_value`), so that the prefix cache tells pictures apart and matches the same one across
requests."""

from __future__ import annotations

import torch
import xxhash

from vlm_serve.mm_cache.hashing import pad_value
from vlm_serve.multimodal.items import MultimodalItem


def item_hash(item: MultimodalItem) -> int:
    """128-bit hash of what determines an item's embeddings: its modality, grid and pixels (for items built
    without the processor, which sets `hash` itself)."""
    data = item.pixels.data
    h = xxhash.xxh3_128()
    h.update(f"{item.modality}:{item.grid_thw}:{data.dtype}:{tuple(data.shape)}".encode())
    h.update(data.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.intdigest()


def pad_input_ids(input_ids: list[int], items: list[MultimodalItem], vocab_size: int) -> list[int]:
    """`input_ids` with each item's placeholder spans replaced by its pad value (hashing items that
    have no hash yet)."""
    padded = list(input_ids)
    for item in items:
        if item.hash is None:
            item.hash = item_hash(item)
        value = pad_value(item.hash, vocab_size)
        for start, end in item.spans:
            padded[start:end] = [value] * (end - start)
    return padded
