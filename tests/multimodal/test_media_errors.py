"""Bad media gives a `MediaError` (a 400, a ValueError) whose message names the problem, never a decoder
error, and whose `param` names the part of the request that holds the media. A picture over the pixel limit
is refused from its header, in words that give its size, the limit and the flag that sets it (never in
Pillow's), before a pixel is decoded."""

from __future__ import annotations

import base64
import io
import struct
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from vlm_serve.errors import BadRequest, MediaError
from vlm_serve.multimodal.image_processor import ImageProcessor, ImageProcessorConfig
from vlm_serve.multimodal.media import MediaAccess, load_image, probe_image, read_media
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.multimodal.video import VideoProcessor, VideoProcessorConfig
from vlm_serve.testing.media import jpeg_stating, png_stating
from vlm_serve.tokenizer import Tokenizer


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


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


def test_media_error_is_a_400_value_error():
    assert issubclass(MediaError, BadRequest) and issubclass(MediaError, ValueError) and MediaError.status == 400


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


def test_a_picture_over_the_limit_is_refused_from_its_header_with_its_size_the_limit_and_the_flag():
    # The header claims 9000 x 9000 but almost no data follows: refused before decoding is attempted.
    message = r"^image is 9000 x 9000 = 81000000 pixels, more than the limit of 50000000 \(--max-image-pixels\)$"
    with pytest.raises(MediaError, match=message):
        load_image(png_stating(9000, 9000), max_pixels=50_000_000)
    with pytest.raises(MediaError, match=message):
        load_image(jpeg_stating(9000, 9000), max_pixels=50_000_000)


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")  # Pillow does not warn first either
@pytest.mark.parametrize("make", [png_stating, jpeg_stating], ids=["png", "jpeg"])
def test_a_20000_x_20000_picture_is_refused_in_our_words_not_pillows(make):
    message = r"^image is 20000 x 20000 = 400000000 pixels, more than the limit of 89478485 \(--max-image-pixels\)$"
    with pytest.raises(MediaError, match=message):
        load_image(make(20000, 20000))
    with pytest.raises(MediaError, match=message):
        probe_image(make(20000, 20000))


def test_a_limit_above_pillows_lets_pillow_refuse_nothing_it_allows(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # (raised here, restored after)
    assert probe_image(png_stating(20000, 20000), max_pixels=10**9) == (20000, 20000)  # over 2x Pillow's
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow checks a TIFF's tiles again as it decodes
    tiff = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(tiff, "TIFF")
    assert load_image(tiff.getvalue(), max_pixels=64 * 64).size == (64, 64)


def test_configurable_pixel_limit():
    message = r"image is 40 x 40 = 1600 pixels, more than the limit of 1000 \(--max-image-pixels\)"
    with pytest.raises(MediaError, match=message):
        load_image(png_bytes(40, 40), max_pixels=1000)
    assert load_image(png_bytes(40, 40), max_pixels=1600).size == (40, 40)


def test_a_picture_holding_more_than_its_header_states_is_refused_as_a_bomb(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's check, at twice the limit, finds 64 x 64
    embedded = png_bytes(64, 64)  # in an ICO whose directory says 8 x 8
    ico = struct.pack("<3H", 0, 1, 1) + struct.pack("<4B2H2I", 8, 8, 0, 0, 1, 32, len(embedded), 22) + embedded
    with pytest.raises(MediaError, match="^image holds more pixels than its header states: refused as a decompression"):
        load_image(ico, max_pixels=100)


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
    message = r"^each video frame is 64 x 48 = 3072 pixels, more than the limit of 1000 \(--max-image-pixels\)$"
    with pytest.raises(MediaError, match=message):
        processor.preprocess(mp4_bytes())
    frames = "data:video/jpeg;base64," + ",".join(base64.b64encode(jpeg_stating(64, 48)).decode() for _ in range(2))
    with pytest.raises(MediaError, match=r"^video frame 0 \(counting from 0, of 2\): image is 64 x 48 = 3072 pixels"):
        processor.preprocess(frames)


def test_video_data_url_works(video_processor):
    url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes()).decode()
    assert video_processor.preprocess(url).grid_thw[0] >= 1


# -- through the prompt processor --------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(tiny_dense_dir: Path) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, Tokenizer.from_pretrained(tiny_dense_dir))


def test_processor_reports_media_errors(processor):
    broken_png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [broken_png]}]
    with pytest.raises(MediaError, match="cannot decode image"):
        processor.process_messages(messages)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ValueError, match="image content part has no 'image' or 'image_url' value"):
        processor.process_messages(messages)
    with pytest.raises(MediaError, match="unsupported video source of type Image"):
        processor.process("<|video_pad|>", videos=[Image.new("RGB", (32, 32))])


GOOD_IMAGE = {"type": "image_url", "image_url": {"url": data_url(png_bytes(32, 32))}}
TEXT = {"type": "text", "text": "What is it?"}
BAD_VIDEO = data_url(b"x", "video/mp4")
NO_URL = {"type": "image_url", "image_url": {}}


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([{"role": "user", "content": [image_part(b"junk"), TEXT]}], "messages[0].content[0]", "cannot decode image"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "user", "content": [TEXT, GOOD_IMAGE, image_part(b"junk")]}],
            "messages[1].content[2]",
            "cannot decode image",
        ),
        (
            [{"role": "user", "content": [GOOD_IMAGE, {"type": "video_url", "video_url": {"url": BAD_VIDEO}}]}],
            "messages[0].content[1]",
            "cannot decode video",
        ),
        (
            [{"role": "user", "content": [TEXT, image_part(png_stating(20000, 20000))]}],
            "messages[0].content[1]",
            "image is 20000 x 20000 = 400000000 pixels",
        ),
        ([{"role": "user", "content": [TEXT, NO_URL]}], "messages[0].content[1]", "has no"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]}],
            "messages[0].content[0]",
            "cannot decode image",  # (the in-process processor reads any local path)
        ),
    ],
    ids=["first part", "second message's third part", "a video", "oversized", "no url", "not an image file"],
)
def test_a_media_error_names_the_failing_part_as_the_client_wrote_it(processor, messages, param, words):
    with pytest.raises(MediaError) as caught:
        processor.process_messages(messages)
    assert caught.value.param == param and words in caught.value.message, caught.value


def test_media_given_with_its_place_is_named_by_it(processor):
    images = [MediaInput(data_url(png_bytes(32, 32)), param="image_data[0]"), MediaInput(b"x", param="image_data[1]")]
    with pytest.raises(MediaError, match="cannot decode image") as caught:
        processor.process("<|image_pad|><|image_pad|>", images=images)
    assert caught.value.param == "image_data[1]"
    with pytest.raises(MediaError) as caught:
        processor.process("<|image_pad|>", images=[b"junk"])  # an in-process caller's: no place to name
    assert caught.value.param is None
