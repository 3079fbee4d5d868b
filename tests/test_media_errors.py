"""Bad media gives a `MediaError` (a ValueError) whose message names the problem, never a decoder error."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.image_processor import ImageProcessor, ImageProcessorConfig
from vlm_serve.vision.media import MediaAccess, MediaError, load_image, read_media
from vlm_serve.vision.processor import MultimodalProcessor
from vlm_serve.vision.video import VideoProcessor, VideoProcessorConfig


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` but which holds almost no pixel data."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b"")


def mp4_bytes(frames: int = 10, width: int = 64, height: int = 48) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), i * 20, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def wav_bytes() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def video_processor() -> VideoProcessor:
    return VideoProcessor(VideoProcessorConfig(min_pixels=1024, max_pixels=1024 * 32 * 32))


# -- sources -----------------------------------------------------------------------------------------


def test_media_error_is_a_value_error():
    assert issubclass(MediaError, ValueError)


@pytest.mark.parametrize(
    "source, message",
    [
        (b"", "image data is empty"),
        ("data:image/png,abc", "unsupported data URL for image: only base64-encoded data URLs are supported"),
        ("data:text/plain;base64,aGVsbG8=", r"unsupported data URL for image: media type 'text/plain' is not image/\*"),
        ("data:image/png;base64,@@not base64@@", "invalid base64 data in image data URL"),
        ("data:image/png;base64,", "image data URL holds no data"),
        ("data:image/png;base64", "malformed data URL for image"),
        ("https://example.com/cat.png", "--allowed-media-domains"),
        ("", "image source is an empty string"),
        (12345, "unsupported image source of type int"),
    ],
)
def test_bad_image_sources(source, message):
    with pytest.raises(MediaError, match=message):
        load_image(source)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(MediaError, match=r"image file '.*nothing\.png' does not exist"):
        load_image(str(tmp_path / "nothing.png"))
    with pytest.raises(MediaError, match=r"video file '.*nothing\.mp4' does not exist"):
        read_media(tmp_path / "nothing.mp4", "video")
    empty = tmp_path / "empty.png"
    empty.touch()
    with pytest.raises(MediaError, match=r"image file '.*empty\.png' is empty"):
        load_image(empty)
    with pytest.raises(MediaError, match="is not a regular file"):
        load_image(tmp_path)


def test_paths_outside_allowed_dirs(tmp_path):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    (allowed / "a.png").write_bytes(png_bytes())
    (other / "b.png").write_bytes(png_bytes())
    assert load_image(allowed / "a.png", access=MediaAccess(local_dirs=(str(allowed),))).size == (8, 8)
    with pytest.raises(MediaError, match="outside the allowed local directories"):
        load_image(str(other / "b.png"), access=MediaAccess(local_dirs=(str(allowed),)))
    with pytest.raises(MediaError, match="outside the allowed local directories"):
        load_image(str(allowed / ".." / "other" / "b.png"), access=MediaAccess(local_dirs=(str(allowed),)))


# -- images ------------------------------------------------------------------------------------------


def test_undecodable_image_bytes():
    with pytest.raises(MediaError, match="cannot decode image: the data is not in a recognized image format"):
        load_image(b"this is not an image at all")


def test_truncated_image():
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    with pytest.raises(MediaError, match="cannot decode image: .*truncated"):
        load_image(buffer.getvalue()[: len(buffer.getvalue()) // 2])


def test_decompression_bomb_is_refused_from_the_header():
    # The header claims 9000 x 9000 but almost no data follows: refused before decoding is attempted.
    message = r"image is too large: 9000x9000 = 81000000 pixels exceeds the limit of 50000000"
    with pytest.raises(MediaError, match=message):
        load_image(png_header_only(9000, 9000), max_pixels=50_000_000)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_default_pixel_limit():
    message = r"image is too large: 10000x10000 = 100000000 pixels exceeds the limit of 89478485"
    with pytest.raises(MediaError, match=message):
        load_image(png_header_only(10000, 10000))


def test_configurable_pixel_limit():
    with pytest.raises(MediaError, match=r"image is too large: 40x40 = 1600 pixels exceeds the limit of 1000 pixels"):
        load_image(png_bytes(40, 40), max_pixels=1000)
    assert load_image(png_bytes(40, 40), max_pixels=1600).size == (40, 40)


def test_pillow_decompression_bomb_error_is_converted():
    # Our own limit is lifted, so Pillow's (2 x MAX_IMAGE_PIXELS) is the one that fires.
    with pytest.raises(MediaError, match="image is too large to decode safely \\(decompression bomb\\)"):
        load_image(png_header_only(20000, 20000), max_pixels=10**12)


def test_extreme_aspect_ratio():
    processor = ImageProcessor(ImageProcessorConfig(patch_size=16))
    with pytest.raises(MediaError, match=r"extreme aspect ratio: 402x2 has ratio 201.0, the limit is 200"):
        processor.preprocess(Image.new("RGB", (402, 2)))
    processor.preprocess(Image.new("RGB", (400, 2)))  # exactly 200 is allowed, as in transformers


def test_empty_image():
    processor = ImageProcessor(ImageProcessorConfig(patch_size=16))
    with pytest.raises(MediaError, match=r"image is empty \(0x5 pixels\)"):
        processor.preprocess(Image.new("RGB", (0, 5)))
    with pytest.raises(MediaError, match=r"image is empty \(0x0 pixels\)"):
        load_image(Image.new("RGB", (0, 0)))


def test_unconvertible_image_mode():
    processor = ImageProcessor(ImageProcessorConfig(patch_size=16))
    image = Image.new("La", (40, 40))
    with pytest.raises(MediaError, match="cannot convert image of mode 'La' to RGB"):
        processor.preprocess(image)


# -- videos ------------------------------------------------------------------------------------------


def test_not_a_video(video_processor):
    with pytest.raises(MediaError, match="cannot decode video: the data is not in a recognized video format"):
        video_processor.preprocess(b"definitely not a video " * 20)


def test_still_image_is_not_a_video(video_processor):
    with pytest.raises(MediaError, match=r"not a video: the data is a still image \(png_pipe\)"):
        video_processor.preprocess(png_bytes(64, 64))


def test_audio_only_file_is_not_a_video(video_processor):
    with pytest.raises(MediaError, match="not a video: the data holds no video stream"):
        video_processor.preprocess(wav_bytes())


def test_video_with_no_decodable_frames(video_processor):
    data = bytearray(mp4_bytes())
    mdat = data.find(b"mdat")
    size = struct.unpack(">I", data[mdat - 4 : mdat])[0]
    data[mdat + 4 : mdat - 4 + size] = b"\x55" * (size - 8)  # every frame's payload is garbage
    with pytest.raises(MediaError, match="video has no decodable frames"):
        video_processor.preprocess(bytes(data))


def test_empty_and_missing_video(video_processor, tmp_path):
    with pytest.raises(MediaError, match="video data is empty"):
        video_processor.preprocess(b"")
    with pytest.raises(MediaError, match="does not exist"):
        video_processor.preprocess(str(tmp_path / "missing.mp4"))
    with pytest.raises(MediaError, match=r"unsupported data URL for video: media type 'image/png' is not video/\*"):
        video_processor.preprocess("data:image/png;base64," + base64.b64encode(png_bytes()).decode())


def test_video_frames_over_the_pixel_limit():
    processor = VideoProcessor(VideoProcessorConfig(), max_frame_pixels=1000)
    with pytest.raises(MediaError, match=r"video frames are too large: 64x48 exceeds the limit of 1000 pixels"):
        processor.preprocess(mp4_bytes())


def test_video_data_url_works(video_processor):
    url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes()).decode()
    assert video_processor.preprocess(url).grid_thw[0] >= 1


# -- through the prompt processor --------------------------------------------------------------------


def test_processor_reports_media_errors(tiny_dense_dir: Path):
    processor = MultimodalProcessor.from_pretrained(tiny_dense_dir, Tokenizer.from_pretrained(tiny_dense_dir))
    broken_png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [broken_png]}]
    with pytest.raises(MediaError, match="cannot decode image"):
        processor.process_messages(messages)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ValueError, match="image content part has no 'image' or 'image_url' value"):
        processor.process_messages(messages)
    with pytest.raises(MediaError, match="unsupported video source of type Image"):
        processor.process("<|video_pad|>", videos=[Image.new("RGB", (32, 32))])
