"""Video preprocessing: PyAV decoding, fps frame sampling, resize, normalise, patchify.

`VideoProcessor` matches transformers' `Qwen3VLVideoProcessor` (with its PyAV reader): the same frame indices
(`linspace(0, total - 1, n).round()`, n from fps clamped by min/max frames and the frame count), the
same `smart_resize` with the temporal factor and whole-clip pixel budget, the same resize (torchvision's
uint8 bicubic antialiased resize, which is `torch.nn.functional.interpolate`), normalisation
`(v - mean / rescale) / (std / rescale)` in float32, frame padding by repeating the last frame, patch
layout and per-group timestamps. One deliberate difference: a clip with a single frame is accepted
(sized as if it had `temporal_patch_size` frames) where transformers raises.

`Qwen2VLVideoProcessor` matches transformers' `Qwen2VLVideoProcessor` (Qwen2.5-VL's checkpoints name it, or
their `Qwen2_5_VLProcessor`): its frame indices (`arange(0, total, total / n)`, n from fps clamped and cut to
a multiple of the temporal patch), each frame sized alone (the images' `smart_resize` between the per-frame
`min_pixels` and `max_pixels`), no timestamps but the seconds between groups (`second_per_grid`, for the
temporal positions). Deliberate differences: frames are always sampled by fps (transformers keeps every frame
of a checkpoint that does not set `do_sample_frames`, as Qwen2.5-VL's published ones do not; qwen-vl-utils and
vLLM sample them at 2 per second), and a clip of fewer frames than a temporal patch is kept whole.

Decoding is bounded: frames are decoded in order, only the sampled ones are converted to RGB, and each
is resized as soon as it is decoded, so memory holds the kept frames at their final size.

Which frames are kept, and their size, come from the container alone (`probe_video`: frames counted by
demuxing, never decoded), so that a PD decode server gets the same grid and timestamps without
decoding (`preprocess(..., pixels=False)`). A stream that decodes fewer frames than its container
holds (truncated or corrupt) repeats its last decoded frame in place of the missing ones.
"""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vlm_serve.multimodal.image_processor import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    check_aspect_ratio,
    load_json,
    meta_pixels,
    positive_float,
    read_pixel_limits,
    reject_disabled_steps,
    smart_resize,
    validate_pixel_settings,
)
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.media import (
    DEFAULT_MAX_IMAGE_PIXELS,
    FrameList,
    MediaAccess,
    MediaError,
    VideoSource,
    check_pixel_count,
    decode_image,
    frame_name,
    open_image,
    probe_image,
    read_media,
    to_rgb,
)
from vlm_serve.multimodal.pixels import PatchPixels, PixelNormalizer

DEFAULT_VIDEO_FPS = 24.0  # assumed when a stream states no frame rate, as transformers does
FRAME_LIST_FPS = 1.0  # the rate of a video sent as a list of frames, as vLLM assumes it


@dataclass(frozen=True)
class VideoProcessorConfig:
    """Video settings of a checkpoint (`video_preprocessor_config.json`); defaults are transformers'."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32  # whole clip: frames * height * width
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        validate_pixel_settings(self, ("min_frames", "max_frames", "max_video_tokens"))
        object.__setattr__(self, "fps", positive_float("fps", self.fps))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, data: dict) -> VideoProcessorConfig:
        reject_disabled_steps(data, ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames"))
        if data.get("resample", int(Image.Resampling.BICUBIC)) != int(Image.Resampling.BICUBIC):
            raise ValueError(f"only bicubic video resizing is supported, config has resample={data['resample']}")
        if data.get("num_frames") is not None:
            raise ValueError("a fixed num_frames in the video config is not supported; frames are sampled by fps")
        min_pixels, max_pixels = read_pixel_limits(data, cls.min_pixels, cls.max_pixels)
        known = (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "image_mean",
            "image_std",
            "rescale_factor",
            "fps",
            "min_frames",
            "max_frames",
            "cap_pixels_per_frame",
            "max_video_tokens",
        )
        fields = {k: data[k] for k in known if data.get(k) is not None}
        return cls(min_pixels=min_pixels, max_pixels=max_pixels, **fields)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> VideoProcessorConfig:
        """Read `video_preprocessor_config.json`; without it, the patch geometry of `preprocessor_config.json`."""
        data = load_json(model_dir, "video_preprocessor_config.json")
        if data is None:
            image = load_json(model_dir, "preprocessor_config.json") or {}
            data = {k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in image}
        return cls.from_dict(data)

    def with_overrides(
        self,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        fps: float | None = None,
        max_frames: int | None = None,
    ) -> VideoProcessorConfig:
        """These settings with a request's overrides (validated; None keeps the checkpoint's)."""
        changes = {
            name: value
            for name, value in (
                ("min_pixels", min_pixels),
                ("max_pixels", max_pixels),
                ("fps", fps),
                ("max_frames", max_frames),
            )
            if value is not None
        }
        return replace(self, **changes) if changes else self

    def clip_max_pixels(self, num_frames: int) -> int:
        """The whole-clip pixel budget for `num_frames` frames (capped per frame when configured)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        frame_cap = self.max_video_tokens * self.factor * self.factor
        per_frame = max(min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05))
        return per_frame * num_frames


@dataclass(frozen=True)
class Qwen2VLVideoProcessorConfig(VideoProcessorConfig):
    """Video settings of a checkpoint whose videos are Qwen2-VL's: `min_pixels` / `max_pixels` bound each
    frame, not the clip; defaults are transformers' `Qwen2VLVideoProcessor`'s."""

    patch_size: int = 14
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    max_video_tokens: int = 128000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cap_pixels_per_frame:
            raise ValueError("cap_pixels_per_frame=true is not supported for Qwen2-VL's video processor")

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> Qwen2VLVideoProcessorConfig:
        """Read `video_preprocessor_config.json`; without it, `preprocessor_config.json` (as transformers does)."""
        return cls.from_dict(
            load_json(model_dir, "video_preprocessor_config.json")
            or load_json(model_dir, "preprocessor_config.json")
            or {}
        )


def names_qwen2_vl_videos(model_dir: str | os.PathLike) -> bool:
    """Whether a checkpoint's videos are Qwen2-VL's: its video config names `Qwen2VLVideoProcessor`, or
    (without one) its processor is Qwen2-VL's or Qwen2.5-VL's."""
    video = load_json(model_dir, "video_preprocessor_config.json") or {}
    if "video_processor_type" in video:
        return video["video_processor_type"] == "Qwen2VLVideoProcessor"
    processor = video.get("processor_class") or (load_json(model_dir, "preprocessor_config.json") or {}).get(
        "processor_class"
    )
    return processor in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")


# -- sampling and geometry ---------------------------------------------------------------------------


def sample_frame_indices(
    total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int
) -> list[int]:
    """Indices of the frames kept: `fps` per second of video, clamped to [min_frames, max_frames] and the
    frame count, spread evenly from the first to the last frame."""
    num_frames = int(total_frames / video_fps * fps)
    num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


def sample_frame_indices_qwen2_vl(
    total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int, temporal_patch_size: int
) -> list[int]:
    """Indices of the frames kept, as transformers' `Qwen2VLVideoProcessor` picks them: `fps` per second of
    video, clamped to [min_frames, max_frames] and the frame count, cut to a multiple of the temporal patch,
    every `total / n`-th frame from the first; every frame of a clip shorter than a temporal patch."""
    most = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    num_frames = min(max(total_frames / video_fps * fps, min_frames), most, total_frames)
    num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    if num_frames == 0:
        return list(range(total_frames))
    return torch.arange(0, total_frames, total_frames / num_frames).int().tolist()


def group_timestamps(frame_indices: Sequence[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch group: the mean time of its first and last frame (after padding)."""
    indices = list(frame_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [index / video_fps for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def smart_resize_video(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Frame (height, width) for a clip: multiples of `factor`, whole-clip pixels within the budget."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width)
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    rounded_frames = round(num_frames / temporal_factor) * temporal_factor
    if rounded_frames * new_height * new_width > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded_frames * new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def resize_frame(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    """`(H, W, 3)` uint8 RGB -> `(3, height, width)` uint8, as torchvision resizes uint8 tensors (bicubic,
    antialiased, computed natively on uint8; unchanged when the size already matches)."""
    pixels = torch.from_numpy(np.array(frame.transpose(2, 0, 1), order="C"))
    if pixels.shape[1:] == (height, width):
        return pixels
    resized = F.interpolate(pixels[None], size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized[0]


def video_normalizer(rescale_factor: float, mean: tuple[float, ...], std: tuple[float, ...]) -> PixelNormalizer:
    """Values as transformers' fused video normalisation computes them: (v - mean/r) / (std/r) in float32."""
    scaled_mean = (torch.tensor(mean) * (1.0 / rescale_factor)).view(-1, 1)
    scaled_std = (torch.tensor(std) * (1.0 / rescale_factor)).view(-1, 1)
    table = (torch.arange(256, dtype=torch.float32).expand(len(mean), 256) - scaled_mean) / scaled_std
    return PixelNormalizer(table, [("sub_div", scaled_mean, scaled_std)])


def patchify_video(
    frames: torch.Tensor, normalizer: PixelNormalizer, patch_size: int, merge_size: int, temporal_patch_size: int
) -> PatchPixels:
    """`(F, 3, h, w)` uint8 frames (F a multiple of T) -> their `F/T * h/P * w/P` patches, as bytes."""
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.view(
        grid_t,
        temporal_patch_size,
        channels,
        grid_h // merge_size,
        merge_size,
        patch_size,
        grid_w // merge_size,
        merge_size,
        patch_size,
    ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    data = patches.contiguous().view(grid_t * grid_h * grid_w, channels, temporal_patch_size, patch_size**2)
    return PatchPixels(data, temporal_patch_size, normalizer)


# -- decoding ----------------------------------------------------------------------------------------


def _open_container(data: bytes | Path) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data) if isinstance(data, bytes) else str(data), mode="r")
    except Exception as exc:  # noqa: BLE001 - any demuxer failure is a property of the data
        raise MediaError("cannot decode video: the data is not in a recognized video format") from exc


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise MediaError("not a video: the data holds no video stream")
    if container.format.name.endswith("_pipe") or container.format.name == "image2":
        raise MediaError(f"not a video: the data is a still image ({container.format.name})")
    return container.streams.video[0]


@dataclass(frozen=True)
class VideoInfo:
    """What a video's container states about its frames."""

    total_frames: int
    fps: float
    height: int
    width: int


def probe_video(data: bytes | Path | FrameList, max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> VideoInfo:
    """The frame count, frame rate and frame size of the video in `data`, read from its container by
    demuxing: no frame is decoded.

    Frames are counted as the packets that hold data and are not discarded: an MP4 edit list (a trimmed
    clip) marks the frames before its start, which decoders drop, and the count the container states
    includes them. A stated count below that is kept (transformers samples by the stated count). A
    demuxing error ends the stream, as a decoding error does. A `FrameList` is probed by `probe_frame_list`.
    """
    if isinstance(data, FrameList):
        return probe_frame_list(data, max_frame_pixels)
    with _open_container(data) as container:
        stream = _video_stream(container)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise MediaError("video has no decodable frames: its stream states no frame size")
        check_pixel_count("each video frame is", width, height, max_frame_pixels)
        rate = stream.average_rate or stream.guessed_rate
        stated = stream.frames
        demuxed = 0
        try:
            for packet in container.demux(stream):
                if packet.size and not packet.is_discard:
                    demuxed += 1
        except av.FFmpegError:
            pass
    total_frames = min(stated, demuxed) if stated > 0 else demuxed
    if total_frames <= 0:
        raise MediaError("video has no decodable frames")
    return VideoInfo(total_frames, float(rate) if rate else DEFAULT_VIDEO_FPS, height, width)


def probe_frame_list(frames: FrameList, max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> VideoInfo:
    """A video sent as a list of frames (vLLM's `data:video/jpeg;base64,<frame>,...`), read from the frames'
    headers (no pixel is decoded): as vLLM takes it, a clip at `FRAME_LIST_FPS` frames per second whose
    frames are all there is, sampled afterwards by the same rules as any video (with the default fps of
    2, every frame is kept). Every frame must be an image of the first one's size; one that is not is a
    `MediaError` naming it."""
    if not frames:
        raise MediaError("video frame list holds no frames")
    size = None
    for index, frame in enumerate(frames):
        try:
            frame_size = probe_image(frame, max_frame_pixels)
        except MediaError as exc:
            raise MediaError(f"{frame_name(index, len(frames))}: {exc}") from exc
        if size is None:
            size = frame_size
        elif frame_size != size:
            raise MediaError(
                f"{frame_name(index, len(frames))} is {frame_size[0]}x{frame_size[1]} pixels, "
                f"but the video's first frame is {size[0]}x{size[1]}: every frame must have the same size"
            )
    width, height = size
    return VideoInfo(len(frames), FRAME_LIST_FPS, height, width)


class VideoProcessor:
    """Decodes, samples and preprocesses videos exactly as Qwen3-VL's video processor does.

    What the container states (`probe_video`) alone decides which frames are kept and their size, so
    `preprocess(..., pixels=False)` gives the same grid and timestamps without decoding a frame.
    """

    config_class: type[VideoProcessorConfig] = VideoProcessorConfig
    # The prompt sets each temporal patch group apart: its time (`<1.5 seconds>`), then its pads in a
    # <|vision_start|> ... <|vision_end|> of its own (Qwen3-VL's). Without: the video's pads in one run.
    timestamps = True

    def __init__(self, config: VideoProcessorConfig, max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.config = config
        self.max_frame_pixels = max_frame_pixels
        self._normalizer = video_normalizer(config.rescale_factor, config.image_mean, config.image_std)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, **kwargs) -> VideoProcessor:
        """The checkpoint's video processor: Qwen2-VL's where its configs name it (`names_qwen2_vl_videos`),
        else Qwen3-VL's."""
        kind = Qwen2VLVideoProcessor if names_qwen2_vl_videos(model_dir) else VideoProcessor
        return kind(kind.config_class.from_pretrained(model_dir), **kwargs)

    def preprocess(
        self,
        source: VideoSource,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        fps: float | None = None,
        max_frames: int | None = None,
        access: MediaAccess = MediaAccess(),
        pixels: bool = True,
    ) -> MultimodalItem:
        """Decode `source` (bytes, path, `data:` URL), sample frames by fps and build the video item.
        With `pixels` False, the same item without pixels (`meta` pixels): its grid and
        timestamps, from the container's frame count, rate and size; no frame is decoded.
        The item's `timings` get the probing, the decoding and the resizing/normalising time."""
        config = self.config.with_overrides(min_pixels, max_pixels, fps, max_frames)
        data = read_media(source, "video", access)
        start = time.perf_counter()
        info = probe_video(data, self.max_frame_pixels)
        indices, size = self._sampling(info, config)
        probed = time.perf_counter()
        if not pixels:
            item = self._item(indices, info, size, config)
            item.timings.probe = probed - start
            return item
        frames, resize_seconds = self._decode(data, indices, size)
        decoded = time.perf_counter()
        item = self._item(indices, info, size, config, frames)
        item.timings.probe = probed - start
        item.timings.decode = decoded - probed - resize_seconds
        item.timings.preprocess = time.perf_counter() - decoded + resize_seconds
        return item

    def preprocess_frames(
        self,
        frames: np.ndarray,
        frame_indices: Sequence[int],
        video_fps: float,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        total_frames: int | None = None,
    ) -> MultimodalItem:
        """Build the video item from already sampled `(n, H, W, 3)` uint8 RGB frames taken at
        `frame_indices` of a video of `total_frames` frames (default: up to the last index) running at
        `video_fps`."""
        config = self.config.with_overrides(min_pixels, max_pixels)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
            raise ValueError(f"frames must be a non-empty (n, H, W, 3) uint8 array, got {frames.shape} {frames.dtype}")
        if len(frame_indices) != len(frames):
            raise ValueError(f"got {len(frames)} frames but {len(frame_indices)} frame indices")
        size = self._target_size(len(frames), frames.shape[1], frames.shape[2], config)
        pixels = [resize_frame(frame, *size) for frame in frames]
        total = total_frames or max(frame_indices) + 1
        info = VideoInfo(total, positive_float("video_fps", video_fps), frames.shape[1], frames.shape[2])
        return self._item(list(frame_indices), info, size, config, pixels)

    def _sampling(self, info: VideoInfo, config: VideoProcessorConfig) -> tuple[list[int], tuple[int, int]]:
        """The indices of the frames kept, and their (height, width) once resized."""
        indices = sample_frame_indices(info.total_frames, info.fps, config.fps, config.min_frames, config.max_frames)
        return indices, self._target_size(len(indices), info.height, info.width, config)

    def _target_size(self, num_frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
        clip_frames = max(num_frames, config.temporal_patch_size)
        return smart_resize_video(
            clip_frames,
            height,
            width,
            config.temporal_patch_size,
            config.factor,
            config.min_pixels,
            config.clip_max_pixels(clip_frames),
        )

    def _decode(
        self, data: bytes | Path | FrameList, indices: list[int], size: tuple[int, int]
    ) -> tuple[list[torch.Tensor], float]:
        """The frames at `indices`, resized to `size` (height, width), and the seconds spent resizing.

        Frames are decoded in order up to the last one wanted. A stream that ends (or breaks) before
        that stands still: the frames it lacks repeat the last frame decoded, so the clip keeps the
        layout its container states. Of a `FrameList`, only the frames at `indices` are decoded.
        """
        if isinstance(data, FrameList):
            return self._decode_frame_list(data, indices, size)
        wanted = set(indices)
        kept: dict[int, torch.Tensor] = {}
        last: av.VideoFrame | None = None
        still: torch.Tensor | None = None
        resize_seconds = 0.0

        def resize(frame: av.VideoFrame) -> torch.Tensor:
            nonlocal resize_seconds
            rgb = frame.to_ndarray(format="rgb24")
            start = time.perf_counter()
            resized = resize_frame(rgb, *size)
            resize_seconds += time.perf_counter() - start
            return resized

        with _open_container(data) as container:
            stream = _video_stream(container)
            stream.thread_type = "AUTO"
            try:
                for index, frame in enumerate(container.decode(stream)):
                    if index in wanted:
                        kept[index] = resize(frame)
                    last = frame
                    if index >= indices[-1]:
                        break
            except av.FFmpegError:
                pass  # a corrupt tail ends the stream
            if last is None:
                raise MediaError("video has no decodable frames")
            if len(kept) < len(wanted):
                still = resize(last)
        return [kept.get(index, still) for index in indices], resize_seconds

    def _decode_frame_list(
        self, frames: FrameList, indices: list[int], size: tuple[int, int]
    ) -> tuple[list[torch.Tensor], float]:
        """`_decode` for a list of frames: a frame that does not decode is a `MediaError` naming it."""
        resized: dict[int, torch.Tensor] = {}
        resize_seconds = 0.0
        for index in indices:
            if index in resized:
                continue
            try:
                with open_image(frames[index], self.max_frame_pixels) as header:
                    rgb = np.asarray(to_rgb(decode_image(header)))
            except MediaError as exc:
                raise MediaError(f"{frame_name(index, len(frames))}: {exc}") from exc
            start = time.perf_counter()
            resized[index] = resize_frame(rgb, *size)
            resize_seconds += time.perf_counter() - start
        return [resized[index] for index in indices], resize_seconds

    def _item(
        self,
        indices: list[int],
        info: VideoInfo,
        size: tuple[int, int],
        config: VideoProcessorConfig,
        pixels: list[torch.Tensor] | None = None,
    ) -> MultimodalItem:
        """The item of the frames at `indices` of the video `info` tells of, resized to `size`: with their
        `pixels` patchified, or without pixels (`meta` pixels)."""
        temporal = config.temporal_patch_size
        grid = (-(-len(indices) // temporal), size[0] // config.patch_size, size[1] // config.patch_size)
        if pixels is None:
            patches = meta_pixels(grid, config.patch_size, temporal)
        else:
            frames = torch.stack(pixels + [pixels[-1]] * (-len(pixels) % temporal))
            patches = patchify_video(frames, self._normalizer, config.patch_size, config.merge_size, temporal)
        return self._timed(MultimodalItem("video", patches, grid), indices, info, temporal)

    def _timed(self, item: MultimodalItem, indices: list[int], info: VideoInfo, temporal: int) -> MultimodalItem:
        """`item` with the times its prompt text gives: each temporal patch group's."""
        item.timestamps = group_timestamps(indices, info.fps, temporal)
        return item


class Qwen2VLVideoProcessor(VideoProcessor):
    """Samples, sizes and preprocesses videos exactly as Qwen2-VL's video processor does (Qwen2.5-VL's
    checkpoints use it); see the module's doc for where it differs on purpose."""

    config_class = Qwen2VLVideoProcessorConfig
    timestamps = False

    def _sampling(self, info: VideoInfo, config: VideoProcessorConfig) -> tuple[list[int], tuple[int, int]]:
        indices = sample_frame_indices_qwen2_vl(
            info.total_frames, info.fps, config.fps, config.min_frames, config.max_frames, config.temporal_patch_size
        )
        return indices, self._target_size(len(indices), info.height, info.width, config)

    def _target_size(self, num_frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
        return smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)

    def _timed(self, item: MultimodalItem, indices: list[int], info: VideoInfo, temporal: int) -> MultimodalItem:
        """`item` with the seconds between its temporal patch groups, at the rate its frames were kept
        (transformers' `second_per_grid_ts`)."""
        item.second_per_grid = temporal / (len(indices) / info.total_frames * info.fps)
        return item


def write_video(
    target: str | Path | io.BytesIO, frames: list[Image.Image], fps: int | Fraction, codec: str = "mpeg4"
) -> None:
    """`frames` (all one size) as an MP4 video at `fps`, into a file or a buffer: MPEG-4 Part 2 (what many
    cameras and tools write, and browsers do not play), or `codec` (`libx264`: H.264, which they do; its
    sizes cut to even ones)."""
    width, height = frames[0].size
    with av.open(target if isinstance(target, io.BytesIO) else str(target), "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width // 2 * 2, height // 2 * 2, "yuv420p"
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(image).reformat(stream.width, stream.height)))
        container.mux(stream.encode())
