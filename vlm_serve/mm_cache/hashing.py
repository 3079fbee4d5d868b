"""Content hashes of media items and the pad values derived from them.

An item's hash is a 128-bit xxh3 of its raw media (the file or data-URL bytes as read; for a PIL image
its pixels, mode, size, palette and transparency key) and of the processing settings in effect for it
(modality, pixel limits, fps, frame limits, patch geometry, normalisation). Equal hashes mean equal
processed inputs, so the hash keys the processed-input cache, the embedding cache and the pad value.

A pad value stands in for every placeholder token of one item in the scheduler's ids, so the prefix
cache tells two different images apart and matches the same image across requests. It keeps 62 bits
of the 128-bit hash (a collision between two live images is then practically impossible). The model
never embeds a pad value: its embedding rows are replaced by the item's vision embeddings (a prompt's ids
padded so: `multimodal/padding.py`).
"""

from __future__ import annotations

from pathlib import Path

import xxhash
from PIL import Image

PAD_VALUE_BITS = 62
_READ_CHUNK = 1 << 20


def media_hash(data: bytes | Path | Image.Image | tuple[bytes, ...], modality: str, settings: object) -> int:
    """128-bit hash of raw media (bytes, a local file, a decoded PIL image, or a tuple of encoded frames:
    a video sent as still images) under `settings`, a frozen settings dataclass whose repr lists every
    value that shapes the processed item."""
    h = xxhash.xxh3_128()
    h.update(f"{modality}\0{settings!r}\0".encode())
    if isinstance(data, Image.Image):
        # The palette and transparency key change the RGB pixels a P / L / RGB image converts to.
        h.update(f"{data.mode}\0{data.size}\0{data.getpalette()}\0{data.info.get('transparency')!r}\0".encode())
        h.update(data.tobytes())
    elif isinstance(data, tuple):
        h.update(f"frames\0{len(data)}\0".encode())
        for frame in data:
            h.update(len(frame).to_bytes(8, "little"))
            h.update(frame)
    elif isinstance(data, Path):
        with data.open("rb") as file:
            while chunk := file.read(_READ_CHUNK):
                h.update(chunk)
    else:
        h.update(data)
    return h.intdigest()


def pad_value(content_hash: int, vocab_size: int) -> int:
    """An id above the vocabulary, unique to the content hash (fits in int64)."""
    return vocab_size + content_hash % (1 << PAD_VALUE_BITS)
