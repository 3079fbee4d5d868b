"""Deterministic test images and videos (made here, never downloaded)."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from vlm_serve.multimodal.video import write_video


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth gradient plus noise: structured enough that resizing matters, random per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def png_stating(width: int, height: int) -> bytes:
    """A PNG whose header states `width` x `height` but which holds almost no pixel data: an oversized
    picture as it looks before decoding, in a hundred bytes whatever its size."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def jpeg_stating(width: int, height: int) -> bytes:
    """`png_stating` as a JPEG: an 8 x 8 one whose frame header (SOF0) states `width` x `height`."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    struct.pack_into(">HH", data, data.find(b"\xff\xc0") + 5, height, width)
    return bytes(data)


def make_video(path: str | Path, num_frames: int, fps: int, size: tuple[int, int], seed: int = 0) -> Path:
    """Writes an MPEG-4 video of `num_frames` frames of `size` (width, height) at `fps`."""
    width, height = size
    write_video(path, [make_image(width, height, seed=seed + i) for i in range(num_frames)], fps)
    return Path(path)
