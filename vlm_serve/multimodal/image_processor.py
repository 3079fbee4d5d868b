"""Qwen3-VL image preprocessing: smart resize, rescale + normalise, patchify.

The output equals transformers' `Qwen2VLImageProcessorPil` (the PIL backend Qwen3-VL checkpoints use
for images) bit for bit: the same RGB conversion and Pillow resize, and values computed from the
resized uint8 pixels exactly as `(v * rescale_factor - mean) / std` is computed there (float64 product
rounded to float32, then float32 arithmetic). It is faster because it does less after the resize: the
uint8 pixels are patchified as bytes, and stay bytes (`PatchPixels`) until the vision tower's device
writes them as float32 (one frame), normalises them in place — by a division and a subtraction when these
reproduce the reference value of all 256 bytes bit for bit (they do for Qwen3-VL's mean = std = 0.5),
otherwise by a 256-entry per-channel table — and repeats that frame for the temporal patch's two.
Grayscale images are resized as one band.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_serve.errors import MediaError
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.media import check_image_size, has_transparency, to_rgb
from vlm_serve.multimodal.pixels import PatchPixels, PixelNormalizer

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
_RESAMPLE_NAMES = {int(f): f.name for f in Image.Resampling}


# -- settings ----------------------------------------------------------------------------------------


def positive_int(name: str, value: Any) -> int:
    """`value` as an int >= 1, or a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def positive_float(name: str, value: Any) -> float:
    """`value` as a finite float > 0, or a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def channel_values(name: str, value: Any) -> tuple[float, ...]:
    """A per-channel mean/std as a tuple of three floats (a single number is repeated)."""
    values = (value,) * 3 if isinstance(value, (int, float)) else tuple(value)
    if len(values) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be a number or three numbers, got {value!r}")
    return tuple(float(v) for v in values)


def validate_pixel_settings(config: Any, extra_ints: tuple[str, ...]) -> None:
    """Checks and normalises the fields image and video configs share (a frozen dataclass, in place)."""
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", *extra_ints):
        object.__setattr__(config, name, positive_int(name, getattr(config, name)))
    object.__setattr__(config, "rescale_factor", positive_float("rescale_factor", config.rescale_factor))
    object.__setattr__(config, "image_mean", channel_values("image_mean", config.image_mean))
    object.__setattr__(config, "image_std", channel_values("image_std", config.image_std))
    if any(s == 0 for s in config.image_std):
        raise ValueError(f"image_std must not contain 0, got {config.image_std}")
    if config.min_pixels > config.max_pixels:
        raise ValueError(f"min_pixels ({config.min_pixels}) must not exceed max_pixels ({config.max_pixels})")
    factor = config.patch_size * config.merge_size
    if config.max_pixels < factor**2:
        raise ValueError(f"max_pixels ({config.max_pixels}) must allow at least one merged patch ({factor}x{factor})")


def read_pixel_limits(data: dict, default_min: int, default_max: int) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a processor config in any of its forms.

    transformers 5 writes `size: {shortest_edge, longest_edge}` (pixel counts, not edges); older
    configs have top-level `min_pixels` / `max_pixels` (or those keys inside `size`), which win.
    """
    size = data.get("size") or {}
    min_pixels = size.get("shortest_edge", size.get("min_pixels", default_min))
    max_pixels = size.get("longest_edge", size.get("max_pixels", default_max))
    if data.get("min_pixels") is not None:
        min_pixels = data["min_pixels"]
    if data.get("max_pixels") is not None:
        max_pixels = data["max_pixels"]
    return min_pixels, max_pixels


def reject_disabled_steps(data: dict, steps: tuple[str, ...]) -> None:
    """Raise for a config that turns off a step this implementation always performs."""
    for step in steps:
        if data.get(step, True) is False:
            raise ValueError(f"processor config sets {step}=false, which is not supported")


def load_json(model_dir: str | os.PathLike, name: str) -> dict | None:
    path = Path(model_dir) / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Image settings of a checkpoint (`preprocessor_config.json`); defaults are transformers' class defaults."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)

    def __post_init__(self) -> None:
        validate_pixel_settings(self, ())
        if self.resample not in _RESAMPLE_NAMES:
            raise ValueError(f"resample must be a Pillow resampling filter, got {self.resample!r}")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merged patch)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, data: dict) -> ImageProcessorConfig:
        reject_disabled_steps(data, ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"))
        min_pixels, max_pixels = read_pixel_limits(data, cls.min_pixels, cls.max_pixels)
        known = (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
            "rescale_factor",
            "resample",
        )
        fields = {k: data[k] for k in known if data.get(k) is not None}
        return cls(min_pixels=min_pixels, max_pixels=max_pixels, **fields)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImageProcessorConfig:
        """Read `preprocessor_config.json` of a checkpoint directory (defaults when it is missing)."""
        return cls.from_dict(load_json(model_dir, "preprocessor_config.json") or {})

    def with_overrides(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageProcessorConfig:
        """These settings with a request's pixel limits (validated; None keeps the checkpoint's)."""
        if min_pixels is None and max_pixels is None:
            return self
        return replace(
            self,
            min_pixels=self.min_pixels if min_pixels is None else positive_int("min_pixels", min_pixels),
            max_pixels=self.max_pixels if max_pixels is None else positive_int("max_pixels", max_pixels),
        )


# -- geometry ----------------------------------------------------------------------------------------


def check_aspect_ratio(height: int, width: int) -> None:
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaError(
            f"extreme aspect ratio: {width}x{height} has ratio {ratio:.1f}, the limit is {MAX_ASPECT_RATIO}"
        )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's target (height, width): multiples of `factor`, about the same aspect ratio, with the
    pixel count brought inside [min_pixels, max_pixels] by one uniform scale."""
    check_aspect_ratio(height, width)
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


# -- values ------------------------------------------------------------------------------------------


def image_normalizer(rescale_factor: float, mean: tuple[float, ...], std: tuple[float, ...]) -> PixelNormalizer:
    """Values as transformers' PIL backend computes them: float32(v * rescale_factor), then (x - mean) / std."""
    rescaled = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    table = torch.from_numpy((rescaled[None, :] - mean32) / std32)
    divisor = torch.tensor([s / rescale_factor for s in std], dtype=torch.float32).view(-1, 1)
    offset = torch.tensor([m / s for m, s in zip(mean, std)], dtype=torch.float32).view(-1, 1)
    scaled_mean = torch.tensor([m / rescale_factor for m in mean], dtype=torch.float32).view(-1, 1)
    return PixelNormalizer(table, [("div_sub", divisor, offset), ("sub_div", scaled_mean, divisor)])


def meta_pixels(grid_thw: tuple[int, int, int], patch_size: int, temporal_patch_size: int) -> PatchPixels:
    """`meta` pixels of the shape (and dtype) of an item of `grid_thw`: a pixel-free item's stand-in, which
    holds no memory."""
    t, h, w = grid_thw
    data = torch.empty((t * h * w, 3, 1, patch_size**2), dtype=torch.uint8, device="meta")
    return PatchPixels(data, temporal_patch_size)


def patchify(
    pixels: np.ndarray, normalizer: PixelNormalizer, patch_size: int, merge_size: int, temporal_patch_size: int
) -> PatchPixels:
    """`(h, w, C)` or `(h, w)` uint8 pixels of one image -> its `h/P * w/P` patches, as bytes.

    Patches are ordered merge window by merge window (row-major windows, row-major patches inside a
    window); each patch is channel, patch row, patch column, its values the image repeated T times. A 2-D
    (grayscale) input stays one channel: its values are three equal ones.
    """
    height, width = pixels.shape[:2]
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks = (grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size)
    if pixels.ndim == 3:
        patches = pixels.reshape(*blocks, pixels.shape[2]).transpose(0, 3, 1, 4, 6, 2, 5)
    else:
        patches = pixels.reshape(blocks).transpose(0, 3, 1, 4, 2, 5)[:, :, :, :, None]
    data = torch.from_numpy(np.array(patches, order="C")).view(grid_h * grid_w, -1, 1, patch_size * patch_size)
    return PatchPixels(data, temporal_patch_size, normalizer)


# -- processor ---------------------------------------------------------------------------------------


class ImageProcessor:
    """Turns a PIL image into a `MultimodalItem` exactly as Qwen3-VL's image processor does."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config
        self._normalizer = image_normalizer(config.rescale_factor, config.image_mean, config.image_std)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImageProcessor:
        return cls(ImageProcessorConfig.from_pretrained(model_dir))

    def preprocess(
        self, image: Image.Image, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> MultimodalItem:
        """Resize, normalise and patchify `image` (any Pillow mode; converted to RGB like transformers)."""
        config = self.config.with_overrides(min_pixels, max_pixels)
        height, width = self._target_size(image.width, image.height, config)
        # Grayscale is resized as one band: Pillow resizes every band of an RGB image the same way.
        if has_transparency(image) or image.mode not in ("RGB", "L"):
            image = to_rgb(image)
        if image.size != (width, height):
            image = image.resize((width, height), resample=config.resample)
        shape = (height, width, 3) if image.mode == "RGB" else (height, width)
        pixels = np.frombuffer(image.tobytes(), dtype=np.uint8).reshape(shape)
        patches = patchify(pixels, self._normalizer, config.patch_size, config.merge_size, config.temporal_patch_size)
        return MultimodalItem("image", patches, _grid(height, width, config))

    def describe(
        self, width: int, height: int, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> MultimodalItem:
        """The item `preprocess` makes of a `width` x `height` image, with `meta` pixels: its grid,
        for which no pixel is needed."""
        config = self.config.with_overrides(min_pixels, max_pixels)
        grid = _grid(*self._target_size(width, height, config), config)
        return MultimodalItem("image", meta_pixels(grid, config.patch_size, config.temporal_patch_size), grid)

    @staticmethod
    def _target_size(width: int, height: int, config: ImageProcessorConfig) -> tuple[int, int]:
        """(height, width) after resizing; a MediaError for an empty image or an extreme aspect ratio."""
        check_image_size(width, height)
        return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)


def _grid(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image resized to `height` x `width`."""
    return 1, height // config.patch_size, width // config.patch_size
