"""The multimodal data that preprocessing hands to the model: prompt ids plus one entry per image or
video, and where each item's time went. A neutral module: multimodal/, vision/, scheduler/ and llm/ all import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from vlm_serve.multimodal.pixels import PatchPixels

if TYPE_CHECKING:
    import torch

Modality = Literal["image", "video"]
EmbeddingSource = Literal["", "cache", "encoder", "prefix"]
MEDIA_STAGES = ("fetch", "probe", "decode", "preprocess", "hash", "encoder_wait", "vit")  # the timed fields below


@dataclass
class MediaTimings:
    """Where one media item's time went, in seconds, and which caches served it."""

    fetch: float = 0.0  # resolve the source and get its bytes (data URL, local file, download)
    probe: float = 0.0  # read the header: image size and orientation; video frame count, rate and size
    decode: float = 0.0  # image / video decoding (for videos, frame decoding)
    preprocess: float = 0.0  # resize, normalise, patchify
    hash: float = 0.0  # content hash of the raw bytes
    encoder_wait: float = 0.0  # from submission to the encoder until a rank started on it
    vit: float = 0.0  # vision tower compute (its share of the pass it ran in)
    processor_cache_hit: bool = False  # probe, decode and preprocessing were skipped
    embedding_source: EmbeddingSource = ""  # "cache" hit, "encoder" run, or covered by the "prefix" cache


@dataclass
class MultimodalItem:
    """One image or video after preprocessing.

    `pixels` are its patches, kept as bytes until the vision tower makes their values
    (`pixel_values`: `(t * h * w, C * temporal_patch * patch * patch)` in patch order, the layout of the
    tower's 3D patch embedding), and `grid_thw` is `(t, h, w)` in patches. A tensor given as `pixels` is
    taken as those values. In the prompt ids the item occupies `spans`: `(start, end)` runs of its
    placeholder token. An image has one span; a video has one span per temporal patch group, separated by
    its timestamp text (Qwen3-VL's prompts), or one span for all of them (Qwen2.5-VL's, whose groups are
    `second_per_grid` seconds apart). A pixel-free item (made for a PD decode server, which never runs the
    vision tower) has `meta` pixels of the shape instead, and the same grid, spans, timestamps and hash.
    """

    modality: Modality
    pixels: PatchPixels
    grid_thw: tuple[int, int, int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    timestamps: list[float] | None = None  # video: seconds of each temporal patch group (Qwen3-VL's prompts)
    second_per_grid: float | None = None  # video: seconds from one temporal patch group to the next (Qwen2.5-VL)
    hash: int | None = None  # content hash (mm_cache.hashing); keys the caches and the pad value
    timings: MediaTimings = field(default_factory=MediaTimings)

    def __post_init__(self) -> None:
        if not isinstance(self.pixels, PatchPixels):
            self.pixels = PatchPixels(self.pixels)

    @property
    def pixel_values(self) -> torch.Tensor:
        """The float32 values the vision tower reads, made on the host (a `meta` tensor if pixel-free)."""
        return self.pixels.values()

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass
class ProcessedInput:
    """A rendered, tokenized prompt with its media, ready for the scheduler."""

    input_ids: list[int]
    mm_items: list[MultimodalItem] = field(default_factory=list)
