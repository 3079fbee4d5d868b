"""Content hashes of media items and the pad values derived from them.

A pad value stands in for every placeholder token of one item in the scheduler's ids, so the prefix
cache tells two different images apart and matches the same image across requests. It keeps 62 bits
of the 128-bit hash (a collision between two live images is then practically impossible); the ids fed
to the embedding table stay the original placeholders.
"""

from __future__ import annotations

import torch
import xxhash

from vlm_serve.vision.items import MultimodalItem

PAD_VALUE_BITS = 62


def item_hash(item: MultimodalItem) -> int:
    """128-bit hash of what determines an item's embeddings: its modality, grid and pixel values."""
    h = xxhash.xxh3_128()
    h.update(f"{item.modality}:{item.grid_thw}:{item.pixel_values.dtype}".encode())
    h.update(item.pixel_values.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.intdigest()


def pad_value(content_hash: int, vocab_size: int) -> int:
    """An id above the vocabulary, unique to the content hash (fits in int64)."""
    return vocab_size + content_hash % (1 << PAD_VALUE_BITS)


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
