"""transformers' video processors as the oracle, here where torchvision is not installed.

`torchvision_stand_in` supplies the three torchvision calls they make on these inputs with the code torchvision
runs for them (uint8 bicubic antialiased resize = `torch.nn.functional.interpolate` on the uint8 tensor,
returning the input when the size is unchanged; normalize = in-place `sub_(mean).div_(std)`;
grayscale_to_rgb), and gives transformers' Qwen2-VL video processing module, which imports torchvision's
functional module outright, imported against them. Frame decoding, sampling, sizing, padding and patch
layout are transformers' own code; `hf_video_inputs` decodes a clip's frames for it with its PyAV reader.
"""

from __future__ import annotations

import enum
import importlib
import io
import sys
import types
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers.image_processing_backends as hf_backends
import transformers.models.qwen3_vl.video_processing_qwen3_vl as hf_qwen3_video
import transformers.video_processing_utils as hf_video_utils
from transformers.processing_utils import ProcessorMixin
from transformers.video_utils import VideoMetadata, read_video_pyav

QWEN2_VL_VIDEO = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def _tv_resize(image, size, interpolation=_InterpolationMode.BILINEAR, antialias=True, max_size=None):
    """torchvision's `resize_image` for uint8 bicubic on CPU: native uint8 interpolate (identity if same size)."""
    channels, height, width = image.shape[-3:]
    if (height, width) == tuple(size):
        return image
    assert interpolation is _InterpolationMode.BICUBIC and image.dtype == torch.uint8
    flat = image.reshape(-1, channels, height, width)
    resized = F.interpolate(flat, size=list(size), mode="bicubic", align_corners=False, antialias=antialias)
    return resized.reshape(image.shape[:-3] + (channels, *size))


def _tv_normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def _tv_grayscale_to_rgb(image):
    return image.repeat_interleave(3, dim=-3) if image.shape[-3] == 1 else image


def torchvision_stand_in(patch: pytest.MonkeyPatch) -> types.ModuleType:
    """Puts the stand-in where transformers' video processors look for torchvision (undone with `patch`)
    and returns transformers' Qwen2-VL video processing module, read against it."""
    tv_functional = types.SimpleNamespace(
        InterpolationMode=_InterpolationMode,
        resize=_tv_resize,
        normalize=_tv_normalize,
        grayscale_to_rgb=_tv_grayscale_to_rgb,
    )
    for module in (hf_backends, hf_video_utils, hf_qwen3_video):
        patch.setattr(module, "tvF", tv_functional, raising=False)
    patch.setattr(hf_backends, "pil_torch_interpolation_mapping", {3: _InterpolationMode.BICUBIC}, raising=False)
    # The processor's class check looks the video processor's base class up on the torchvision-less
    # transformers module, where it is a placeholder; the classes passed are the real ones.
    patch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    if QWEN2_VL_VIDEO not in sys.modules:  # (torchvision's modules stand in while it is read, no longer)
        with pytest.MonkeyPatch.context() as reading:
            for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
                reading.setitem(sys.modules, name, types.ModuleType(name))
            reading.setitem(sys.modules, "torchvision.transforms.v2.functional", tv_functional)
            importlib.import_module(QWEN2_VL_VIDEO)
    return sys.modules[QWEN2_VL_VIDEO]


def make_video(frames: int, fps: int, width: int, height: int, fmt: str = "mp4") -> bytes:
    """An mpeg4 clip whose frames differ (moving gradient), encoded with PyAV."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        y, x = np.mgrid[:height, :width]
        for i in range(frames):
            pixels = np.stack([(x * 3 + i * 9) % 256, (y * 4 + i * 5) % 256, (x + y + i * 20) % 256], axis=-1)
            frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def hf_video_inputs(path: Path) -> tuple[np.ndarray, VideoMetadata]:
    """All frames decoded by transformers' PyAV reader, with the metadata its sampler needs."""

    def every_frame(metadata, **_):
        return np.arange(metadata.total_num_frames)

    frames, metadata = read_video_pyav(str(path), sample_indices_fn=every_frame)
    return frames, VideoMetadata(total_num_frames=metadata.total_num_frames, fps=metadata.fps)
