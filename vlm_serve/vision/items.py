"""What preprocessing hands to the model: prompt ids plus one entry per image or video."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

Modality = Literal["image", "video"]


@dataclass
class MultimodalItem:
    """One image or video after preprocessing.

    `pixel_values` is `(t * h * w, C * temporal_patch * patch * patch)` in patch order (the layout the
    vision tower's 3D patch embedding expects) and `grid_thw` is `(t, h, w)` in patches. In the prompt
    ids the item occupies `spans`: `(start, end)` runs of its placeholder token. An image has one span;
    a video has one span per temporal patch group, separated by its timestamp text.
    """

    modality: Modality
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    timestamps: list[float] | None = None  # video: seconds of each temporal patch group
    hash: int | None = None  # content hash (set by mm_cache); keys the caches and the pad value

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


@dataclass
class ProcessedInput:
    """A rendered, tokenized prompt with its media, ready for the scheduler."""

    input_ids: list[int]
    mm_items: list[MultimodalItem] = field(default_factory=list)
