"""The pixel-free mode of a PD decode server (`MultimodalProcessor(pixels=False)`).

From the same request it builds exactly the full processor's prompt ids, grids, spans, video
timestamps and content hashes (the pad values), reading only image headers and video containers: no
pixel is decoded, resized or normalised, and the pixel values are `meta` tensors of the full shape.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import struct
import tempfile
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from PIL import Image

from vlm_serve.config import ServerArgs
from vlm_serve.errors import MediaError
from vlm_serve.messages.backend import SchedulerLimits
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.server.ports import PortArgs
from vlm_serve.server.tokenizer_manager import TokenizerManager
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

PIXEL_WORK = (  # every function that decodes, resizes or normalises pixels
    "PIL.ImageFile.ImageFile.load",
    "PIL.TiffImagePlugin.TiffImageFile.load",
    "PIL.WebPImagePlugin.WebPImageFile.load",
    "vlm_serve.multimodal.processor.decode_image",
    "vlm_serve.multimodal.image_processor.ImageProcessor.preprocess",
    "vlm_serve.multimodal.video.VideoProcessor._decode",
    "vlm_serve.multimodal.video.resize_frame",
    "vlm_serve.multimodal.video.patchify_video",
)


# -- media made here ---------------------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def after_image_data(png: bytes, chunk: bytes) -> bytes:
    """`png` with `chunk` inserted before IEND, after the image data (where Pillow reads it only while decoding)."""
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunk + png[end:]


XMP_ORIENTATION_6 = (
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
    b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
)


def video(
    frames: int,
    fps: float | Fraction,
    size: tuple[int, int],
    fmt: str = "mp4",
    codec: str = "mpeg4",
    pix_fmt: str = "yuv420p",
    first_pts: int = 0,
    options: dict[str, str] | None = None,
) -> bytes:
    """A clip of distinct frames. `first_pts` < 0 makes the MP4 muxer write an edit list that starts
    the clip `-first_pts` frames in, as in a trimmed clip. `options` are the muxer's."""
    width, height = size
    with tempfile.NamedTemporaryFile(suffix=f".{fmt}") as file:  # a file: some muxer options rewrite it
        with av.open(file.name, "w", format=fmt, options=options or {}) as container:
            stream = container.add_stream(codec, rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            for i in range(frames):
                frame = av.VideoFrame.from_image(make_image(width, height, seed=i))
                if first_pts:
                    frame.pts, frame.time_base = first_pts + i, 1 / Fraction(fps)
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        return Path(file.name).read_bytes()


def corrupt_middle(clip: bytes) -> bytes:
    """`clip` (an MP4) with garbage over the middle of its frame data: decoding stops there."""
    data = bytearray(clip)
    mdat = data.find(b"mdat")
    middle = mdat + struct.unpack(">I", data[mdat - 4 : mdat])[0] // 2
    data[middle : middle + 4000] = b"\x55" * 4000
    return bytes(data)


def cut_short(clip: bytes) -> bytes:
    """The first two thirds of `clip` (an MP4 with its index first): the index states frames it lacks."""
    return clip[: len(clip) * 2 // 3]


def made_once(makers: dict[str, Callable[[], bytes]]) -> dict[str, Callable[[], bytes]]:
    """The same media makers, each making its media on first use only."""
    return {name: functools.cache(make) for name, make in makers.items()}


IMAGES = made_once(
    {
        "png": lambda: encoded(make_image(150, 100), "PNG"),
        "png, odd sides": lambda: encoded(make_image(333, 201), "PNG"),
        "png, palette with transparency": lambda: encoded(make_image(90, 70, mode="P"), "PNG", transparency=3),
        "png, grayscale": lambda: encoded(make_image(120, 80, mode="L"), "PNG"),
        "jpeg": lambda: encoded(make_image(200, 120), "JPEG"),
        "jpeg, cmyk": lambda: encoded(make_image(100, 140, mode="CMYK"), "JPEG"),
        **{
            f"jpeg, exif orientation {o}": (lambda o=o: encoded(make_image(160, 96), "JPEG", exif=exif(o)))
            for o in range(1, 9)
        },
        "png, exif orientation 6 before the image data": lambda: encoded(make_image(160, 96), "PNG", exif=exif(6)),
        "png, exif orientation 8 after the image data": lambda: after_image_data(
            encoded(make_image(160, 96), "PNG"),
            png_chunk(b"eXIf", exif(8)[6:]),  # eXIf holds the TIFF part
        ),
        "png, xmp orientation 6 after the image data": lambda: after_image_data(
            encoded(make_image(160, 96), "PNG"), png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + XMP_ORIENTATION_6)
        ),
        "apng, exif orientation 5": lambda: encoded(
            make_image(160, 96), "PNG", save_all=True, append_images=[make_image(160, 96, seed=1)], exif=exif(5)
        ),
        "tiff, orientation 6 (Pillow turns it upright as it decodes)": lambda: encoded(
            make_image(160, 96), "TIFF", exif=exif(6), compression="tiff_lzw"
        ),
        "webp, exif orientation 8": lambda: encoded(make_image(160, 96), "WEBP", exif=exif(8)),
        "gif": lambda: encoded(make_image(100, 60), "GIF"),
        "tiny: scaled up to min_pixels": lambda: encoded(make_image(9, 7), "PNG"),
        "huge: scaled down to max_pixels": lambda: encoded(make_image(2400, 1500), "JPEG"),
    }
)

VIDEOS = made_once(
    {
        "mp4, 16 frames at 8 fps, 64x64": lambda: video(16, 8, (64, 64)),
        "mp4, one frame": lambda: video(1, 10, (64, 64)),
        "mp4, 5 frames at 2 fps, 96x48": lambda: video(5, 2, (96, 48)),
        "mp4, 47 frames at 24 fps, 80x112": lambda: video(47, 24, (80, 112)),
        "mp4, 40 frames at 29.97 fps": lambda: video(40, Fraction(30000, 1001), (64, 48)),
        "mp4 h264, odd sides": lambda: video(12, 6, (75, 53), codec="libx264", pix_fmt="yuv444p"),
        "mkv: no stated frame count": lambda: video(24, 8, (64, 64), fmt="matroska"),
        "webm vp9: no stated frame count": lambda: video(10, 5, (64, 64), fmt="webm", codec="libvpx-vp9"),
        "mp4 h264 with an edit list (a trimmed clip)": lambda: video(30, 10, (64, 64), codec="libx264", first_pts=-3),
        "mp4 cut short": lambda: cut_short(video(30, 10, (64, 64), codec="libx264", options={"movflags": "faststart"})),
        "mp4 corrupt in the middle": lambda: corrupt_middle(video(16, 8, (64, 64))),
    }
)

IMAGE_OPTIONS = [{}, {"max_pixels": 48 * 48}, {"min_pixels": 300 * 300, "max_pixels": 400 * 400}]
VIDEO_OPTIONS = [
    {},
    {"fps": 5.0},
    {"fps": 8.0, "max_frames": 6},
    {"max_pixels": 8 * 32 * 32},
    {"min_pixels": 4 * 128 * 128},
]


def data_url(data: bytes, kind: str) -> str:
    return f"data:{kind}/x;base64," + base64.b64encode(data).decode()


def part(kind: str, data: bytes, **options: Any) -> dict[str, Any]:
    """A chat content part as an API request carries it: a data URL, and the part's own options."""
    return {"type": f"{kind}_url", f"{kind}_url": {"url": data_url(data, kind)}, **options}


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_dense_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dense_dir)


@pytest.fixture(scope="module")
def full(tiny_dense_dir: Path, tokenizer: Tokenizer) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer)


@pytest.fixture(scope="module")
def pixel_free(tiny_dense_dir: Path, tokenizer: Tokenizer) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer, pixels=False)


@pytest.fixture
def without_pixels(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], Any]], Any]:
    """Runs a call with every pixel-decoding, resizing and normalising function raising (and checks
    afterwards that none was called: a caller may have caught the error)."""
    calls = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise AssertionError("pixels were decoded, resized or normalised")

    def run(call: Callable[[], Any]) -> Any:
        try:
            with monkeypatch.context() as patch:
                for target in PIXEL_WORK:
                    patch.setattr(target, refuse)
                return call()
        finally:
            assert not calls, "pixels were decoded, resized or normalised"

    return run


@pytest.fixture
def both(full, pixel_free, without_pixels) -> Callable[..., tuple[ProcessedInput, ProcessedInput]]:
    """(pixel-free, full) processing of one user message with these content parts."""

    def run(*parts: dict[str, Any]) -> tuple[ProcessedInput, ProcessedInput]:
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is shown?"}]}]
        expected = full.process_messages(messages)
        return without_pixels(lambda: pixel_free.process_messages(messages)), expected

    return run


def assert_same_layout(got: ProcessedInput, expected: ProcessedInput) -> None:
    """The same prompt ids and, item by item, grid, spans, timestamps and hash; `meta` pixel values of
    the full item's shape."""
    assert got.input_ids == expected.input_ids
    assert len(got.mm_items) == len(expected.mm_items) > 0
    for item, reference in zip(got.mm_items, expected.mm_items):
        assert (item.modality, item.grid_thw, item.spans, item.timestamps, item.hash) == (
            reference.modality,
            reference.grid_thw,
            reference.spans,
            reference.timestamps,
            reference.hash,
        )
        assert item.pixel_values.is_meta
        assert (item.pixel_values.shape, item.pixel_values.dtype) == (reference.pixel_values.shape, torch.float32)


# -- images ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", IMAGE_OPTIONS, ids=str)
@pytest.mark.parametrize("name", IMAGES)
def test_image_layout_equals_the_full_path(both, name, options):
    assert_same_layout(*both(part("image", IMAGES[name](), **options)))


def test_image_refusals_are_the_same(full, pixel_free, without_pixels):
    for data, message in (
        (encoded(make_image(600, 2), "PNG"), "extreme aspect ratio"),
        (b"not an image at all", "not in a recognized image format"),
    ):
        with pytest.raises(MediaError, match=message) as expected:
            full.process("<|image_pad|>", images=[data])
        with pytest.raises(MediaError) as got:
            without_pixels(lambda: pixel_free.process("<|image_pad|>", images=[data]))
        assert str(got.value) == str(expected.value)


def test_broken_pixel_data_is_found_only_by_decoding(full, pixel_free, without_pixels):
    """A sound header over truncated pixel data: the full path (a PD prefill server) refuses it."""
    data = encoded(make_image(150, 100), "PNG")[:200]
    with pytest.raises(MediaError, match="cannot decode image: .*truncated"):
        full.process("<|image_pad|>", images=[data])
    assert without_pixels(lambda: pixel_free.process("<|image_pad|>", images=[data])).mm_items[0].grid_thw == (1, 6, 10)


def test_the_image_pixel_limit_is_checked_from_the_header(tiny_dense_dir, tokenizer, without_pixels):
    processor = MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer, max_image_pixels=100 * 100, pixels=False)
    message = r"image is 150 x 100 = 15000 pixels, more than the limit of 10000 \(--max-image-pixels\)"
    with pytest.raises(MediaError, match=message):
        without_pixels(lambda: processor.process("<|image_pad|>", images=[IMAGES["png"]()]))


def test_a_pil_image_is_hashed_from_its_pixels_and_sized_from_them(full, pixel_free):
    """An in-process caller's PIL image is decoded already: only its resizing and normalising are skipped."""
    image = make_image(130, 70)
    assert_same_layout(
        pixel_free.process("<|image_pad|>x", images=[image]), full.process("<|image_pad|>x", images=[image])
    )


# -- videos ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", VIDEO_OPTIONS, ids=str)
@pytest.mark.parametrize("name", VIDEOS)
def test_video_layout_equals_the_full_path(both, name, options):
    assert_same_layout(*both(part("video", VIDEOS[name](), **options)))


def test_a_video_that_decodes_short_keeps_the_layout_its_container_states(full):
    """Frames the stream lacks (here: all after the corrupt middle) repeat the last frame decoded."""
    item = full.process("<|video_pad|>", videos=[VIDEOS["mp4 corrupt in the middle"]()]).mm_items[0]
    assert item.grid_thw[0] == 2  # 4 frames sampled from the 16 the container holds
    last_group = item.pixel_values.view(2, -1, 3, 2, 16 * 16)[1]
    assert torch.equal(last_group[:, :, 0], last_group[:, :, 1])


def test_video_refusals_are_the_same(full, pixel_free, without_pixels):
    for data in (b"not a video at all" * 10, encoded(make_image(64, 64), "PNG")):
        with pytest.raises(MediaError) as expected:
            full.process("<|video_pad|>", videos=[data])
        with pytest.raises(MediaError) as got:
            without_pixels(lambda: pixel_free.process("<|video_pad|>", videos=[data]))
        assert str(got.value) == str(expected.value)


# -- whole requests ----------------------------------------------------------------------------------


def test_a_conversation_with_images_and_videos_equals_the_full_path(both):
    assert_same_layout(
        *both(
            part("image", IMAGES["jpeg, exif orientation 6"]()),
            part("video", VIDEOS["mp4, 16 frames at 8 fps, 64x64"](), fps=4.0),
            part("image", IMAGES["png, odd sides"](), max_pixels=64 * 64),
            part("video", VIDEOS["mkv: no stated frame count"]()),
        )
    )


def test_the_work_done_shows_as_fetching_hashing_and_probing(both):
    got, expected = both(part("image", IMAGES["png"]()), part("video", VIDEOS["mp4, 16 frames at 8 fps, 64x64"]()))
    for item in got.mm_items:
        assert item.timings.fetch > 0 and item.timings.hash > 0 and item.timings.probe > 0
        assert item.timings.decode == item.timings.preprocess == 0
    for item in expected.mm_items:
        assert item.timings.probe > 0 and item.timings.decode > 0 and item.timings.preprocess > 0


def test_the_pixel_free_cache_holds_pixel_free_items_only(tiny_dense_dir, tokenizer, full, without_pixels):
    """Each processor owns its cache, so a decode server's never holds (or serves) pixels."""
    cached = MultimodalProcessor.from_pretrained(tiny_dense_dir, tokenizer, cache_mb=1, pixels=False)
    image, clip = IMAGES["png"](), VIDEOS["mp4, 5 frames at 2 fps, 96x48"]()
    prompt = "<|image_pad|><|video_pad|>"
    without_pixels(lambda: cached.process(prompt, images=[image], videos=[clip]))
    again = without_pixels(lambda: cached.process(prompt, images=[MediaInput(image)], videos=[clip]))
    assert [item.timings.processor_cache_hit for item in again.mm_items] == [True, True]
    assert all(item.timings.probe == 0 for item in again.mm_items)
    assert_same_layout(again, full.process(prompt, images=[image], videos=[clip]))
    assert 0 < cached.cache.usage_bytes < 1024  # grids and timestamps, not pixels


def test_a_decode_server_processes_media_without_pixels(tiny_dense_dir, tmp_path, full, without_pixels):
    """The TokenizerManager of `--disaggregation-mode decode` is pixel-free; a colocated one is not."""
    messages = [{"role": "user", "content": [part("image", IMAGES["png"]()), {"type": "text", "text": "Hi"}]}]
    expected = full.process_messages(messages)
    for mode, pixels in (("decode", False), ("null", True)):
        ports = PortArgs(*(f"ipc://{tmp_path}/{mode}-{name}" for name in ("scheduler", "detokenizer", "tokenizer")))
        manager = TokenizerManager(
            ServerArgs(model=str(tiny_dense_dir), disaggregation_mode=mode), ports, SchedulerLimits(4096, 4096, 8, 1)
        )
        try:
            process = lambda: asyncio.run(manager.process_messages(messages))  # noqa: E731
            processed = without_pixels(process) if not pixels else process()
        finally:
            manager.send_to_scheduler.close(0)
            manager.recv_from_detokenizer.close(0)
            manager.executor.shutdown()
        assert manager.processor.pixels is pixels
        assert processed.input_ids == expected.input_ids
        assert processed.mm_items[0].pixel_values.is_meta is not pixels
