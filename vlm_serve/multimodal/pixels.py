"""An item's patches as the picture's own bytes, turned into the vision tower's values where the tower runs.

Preprocessing hands over uint8 patches: a 1024 x 1024 picture is 3 MB instead of the 25 MB of float32
values the tower reads (an image's one frame stands for the two of a temporal patch, and a value takes four
bytes). They are what is cached, put in shared memory, sent to an encoder process and copied to the
GPU; `PatchPixels.values` makes the float32 values there, bit for bit the ones transformers' processors
compute on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

CHANNELS = 3  # the tower's patches are RGB


class PixelNormalizer:
    """Maps byte values to normalised float32 values through a per-channel table, in place.

    `table[c, v]` is the reference value of byte `v` in channel `c`. Each candidate is
    `(order, first, second)` with `(C, 1)` float32 constants: "div_sub" computes `v / first - second`,
    "sub_div" `(v - first) / second`. The first candidate that reproduces every table entry bit for bit
    is used instead of a lookup (two in-place passes are cheaper than a gather); without one, values
    are gathered from the table. Float32 division and subtraction round the same way on every device.
    The constants are kept as numpy arrays: they travel with every item, pickled by value (a tensor would
    go into shared memory, a file descriptor per tensor per message).
    """

    def __init__(self, table: torch.Tensor, candidates: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        self.table = np.ascontiguousarray(table.numpy(), dtype=np.float32)
        byte_values = torch.arange(256, dtype=torch.float32).expand(table.shape[0], 256)
        self._affine = None
        for order, first, second in candidates:
            candidate = (order, first.numpy().astype(np.float32), second.numpy().astype(np.float32))
            values = byte_values.clone()
            self._apply_affine(candidate, values)
            if np.array_equal(values.numpy(), self.table):
                self._affine = candidate
                break

    @staticmethod
    def _apply_affine(candidate: tuple[str, np.ndarray, np.ndarray], values: torch.Tensor) -> None:
        order, first, second = candidate
        first, second = torch.from_numpy(first).to(values.device), torch.from_numpy(second).to(values.device)
        if order == "div_sub":
            values.div_(first).sub_(second)
        else:
            values.sub_(first).div_(second)

    def normalize_(self, values: torch.Tensor) -> None:
        """Replace the byte values (0..255, as float32) of a contiguous `(..., C, K)` tensor by their
        normalised values."""
        if self._affine is not None:
            self._apply_affine(self._affine, values)
            return
        offsets = torch.arange(values.shape[-2], dtype=torch.int64, device=values.device).view(-1, 1) * 256
        index = values.to(torch.int64).add_(offsets)
        values.copy_(torch.from_numpy(self.table).to(values.device).view(-1)[index])


@dataclass
class PatchPixels:
    """The patches of one image or video: `data` is `(patches, channels, frames, P * P)` uint8, patch by
    patch in the tower's order, with 1 or 3 channels (grayscale is widened where the values are made) and
    1 frame (an image, repeated) or `temporal_patch_size` frames; `normalizer` gives each byte its value.

    Pixels made by hand (an item built without the processor) may be the values themselves: `data` a
    `(patches, C * T * P * P)` float tensor. A pixel-free item's `data` is a `meta` tensor of the shape."""

    data: torch.Tensor
    temporal_patch_size: int = 1
    normalizer: PixelNormalizer | None = None

    @property
    def are_values(self) -> bool:
        """Whether `data` holds the values themselves (floats), not bytes."""
        return self.data.dtype.is_floating_point

    @property
    def is_meta(self) -> bool:
        return self.data.is_meta

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def values_shape(self) -> tuple[int, ...]:
        """The shape of `values()`: (patches, C * T * P * P)."""
        if self.are_values:
            return tuple(self.data.shape)
        return self.data.shape[0], CHANNELS * self.temporal_patch_size * self.data.shape[-1]

    def share_memory_(self) -> PatchPixels:
        if not self.is_meta:
            self.data.share_memory_()
        return self

    def without_data(self) -> PatchPixels:
        """These pixels as a `meta` tensor of their shape: what they are, holding no memory."""
        return replace(self, data=torch.empty(self.data.shape, dtype=self.data.dtype, device="meta"))

    def values(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 values `(patches, C * T * P * P)` the tower reads, made on `device` (the data's own
        by default) from the bytes copied there."""
        device = torch.device(device) if device is not None else self.data.device
        if self.are_values:
            return self.data.to(device)
        if self.is_meta:
            return torch.empty(self.values_shape, dtype=torch.float32, device="meta")
        n, area, frames = self.data.shape[0], self.data.shape[-1], self.temporal_patch_size
        data = self.data.to(device)
        data = data.expand(n, CHANNELS, data.shape[2], area)  # (a grayscale picture's one channel, as three)
        values = _empty(data.shape, device)
        values.copy_(data)
        self.normalizer.normalize_(values.view(n, CHANNELS, -1))  # (an image's one frame before it is repeated)
        if data.shape[2] != frames:
            repeated = _empty((n, CHANNELS, frames, area), device)
            values = repeated.copy_(values.expand(repeated.shape))
        return values.view(n, -1)


def _empty(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialised float32 tensor; on the CPU from numpy, which takes large blocks on huge pages: far
    fewer page faults than torch.empty."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, dtype=np.float32))
    return torch.empty(shape, dtype=torch.float32, device=device)
