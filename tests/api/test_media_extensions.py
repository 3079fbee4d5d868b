"""vLLM's media extensions in chat completions: `uuid` on image/video parts (media sent once, then
referred to by id without its bytes) and a video as a list of JPEG frames in one data URL
(`data:video/jpeg;base64,<frame>,<frame>,...`)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import openai
import pytest
from PIL import Image, ImageDraw

from tests.helpers import circle_url, clip_url
from vlm_serve.errors import MediaError
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.tokenizer import Tokenizer

QUESTION = {"type": "text", "text": "What is it?"}
ONE_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def frames(count: int = 6) -> list[Image.Image]:
    """A green square moving left to right."""
    out = []
    for i in range(count):
        frame = Image.new("RGB", (96, 64), "white")
        ImageDraw.Draw(frame).rectangle([8 + 8 * i, 20, 32 + 8 * i, 44], fill="green")
        out.append(frame)
    return out


def jpeg_b64(frame: Image.Image) -> str:
    buffer = io.BytesIO()
    frame.save(buffer, "JPEG", quality=90)
    return base64.b64encode(buffer.getvalue()).decode()


def frame_list_url(images: list[Image.Image]) -> str:
    return "data:video/jpeg;base64," + ",".join(jpeg_b64(frame) for frame in images)


def lossless_mov_url(images: list[Image.Image], fps: int = 1) -> str:
    """The frames as the JPEG list's frames decode (with Pillow), in a losslessly coded clip at `fps`."""
    decoded = [np.asarray(Image.open(io.BytesIO(base64.b64decode(jpeg_b64(f)))).convert("RGB")) for f in images]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mov") as container:
        stream = container.add_stream("png", rate=fps)
        stream.width, stream.height, stream.pix_fmt = decoded[0].shape[1], decoded[0].shape[0], "rgb24"
        for frame in decoded:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/quicktime;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client, model, part: dict, **extra):
    messages = [{"role": "user", "content": [part, QUESTION]}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, **extra)


def refused(client, model, part: dict) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, model, part)
    return caught.value.message


# ---- through a real server ---------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("kind, url", [("image_url", circle_url()), ("video_url", clip_url())])
def test_media_sent_with_a_uuid_is_served_by_uuid_alone(client, model, kind, url):
    uuid = f"test-{kind}-1"
    sent = ask(client, model, {"type": kind, kind: {"url": url}, "uuid": uuid})
    again = ask(client, model, {"type": kind, kind: {"url": url}})
    for part in (
        {"type": kind, kind: None, "uuid": uuid},  # vLLM's shape
        {"type": kind, kind: {"url": ""}, "uuid": uuid},
        {"type": kind, "uuid": uuid},
    ):
        by_uuid = ask(client, model, part)
        assert by_uuid.choices[0].message.content == again.choices[0].message.content == sent.choices[0].message.content
        assert by_uuid.usage.prompt_tokens == again.usage.prompt_tokens
        assert by_uuid.usage.prompt_tokens_details.media == again.usage.prompt_tokens_details.media


@pytest.mark.server
def test_unknown_uuids_and_parts_without_media_are_refused(client, model):
    message = refused(client, model, {"type": "image_url", "image_url": None, "uuid": "never-sent-42"})
    assert "never-sent-42" in message and "send the image again" in message
    # known as an image, not as a video; and the same uuid with other preprocessing options names nothing
    ask(client, model, {"type": "image_url", "image_url": {"url": circle_url()}, "uuid": "known-image"})
    assert "known-image" in refused(client, model, {"type": "video_url", "video_url": None, "uuid": "known-image"})
    other = {"type": "image_url", "image_url": None, "uuid": "known-image", "max_pixels": 64 * 64}
    assert "known-image" in refused(client, model, other)
    # neither a url nor a uuid: the part is named
    message = refused(client, model, {"type": "video_url", "video_url": {"url": ""}})
    assert "messages.0.content.parts.0" in message and "uuid" in message
    # the media caps still apply to a part named by uuid
    huge = {"type": "image_url", "image_url": None, "uuid": "known-image", "max_pixels": 2**40}
    assert "max_pixels" in refused(client, model, huge)


@pytest.mark.server
def test_a_jpeg_frame_list_video_is_the_same_frames_as_a_clip(client, model):
    images = frames(6)
    listed = ask(client, model, {"type": "video_url", "video_url": {"url": frame_list_url(images)}})
    clip = ask(client, model, {"type": "video_url", "video_url": {"url": lossless_mov_url(images, fps=1)}})
    assert listed.choices[0].message.content == clip.choices[0].message.content
    assert listed.usage.prompt_tokens == clip.usage.prompt_tokens
    [media] = listed.usage.prompt_tokens_details.media
    assert media == clip.usage.prompt_tokens_details.media[0] and media["type"] == "video"
    # a frame list and a uuid go together
    ask(client, model, {"type": "video_url", "video_url": {"url": frame_list_url(images)}, "uuid": "frames-1"})
    by_uuid = ask(client, model, {"type": "video_url", "uuid": "frames-1"})
    assert by_uuid.choices[0].message.content == listed.choices[0].message.content


@pytest.mark.server
def test_a_bad_frame_is_refused_by_its_index(client, model):
    good = [jpeg_b64(frame) for frame in frames(3)]
    not_base64 = "data:video/jpeg;base64," + ",".join([good[0], "%%%", good[2]])
    assert "video frame 1" in refused(client, model, {"type": "video_url", "video_url": {"url": not_base64}})
    not_an_image = "data:video/jpeg;base64," + ",".join([good[0], good[1], base64.b64encode(b"nope").decode()])
    assert "video frame 2" in refused(client, model, {"type": "video_url", "video_url": {"url": not_an_image}})
    small = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(small, "JPEG")
    mixed = "data:video/jpeg;base64," + ",".join([good[0], base64.b64encode(small.getvalue()).decode()])
    assert "video frame 1" in refused(client, model, {"type": "video_url", "video_url": {"url": mixed}})


# ---- the processor -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(tiny_dense_dir) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, Tokenizer.from_pretrained(tiny_dense_dir), cache_mb=64)


def test_a_uuid_names_the_latest_content_sent_with_it(processor):
    first, second = frame_list_url(frames(4)), frame_list_url(frames(6))
    one = processor.process(ONE_VIDEO, videos=[MediaInput(first, uuid="clip")]).mm_items[0]
    two = processor.process(ONE_VIDEO, videos=[MediaInput(second, uuid="clip")]).mm_items[0]
    again = processor.process(ONE_VIDEO, videos=[MediaInput(None, uuid="clip")]).mm_items[0]
    assert one.hash != two.hash == again.hash and again.timings.processor_cache_hit
    assert again.grid_thw == two.grid_thw and again.timestamps == two.timestamps
    # keyed by its options too: under other ones the uuid names nothing
    with pytest.raises(MediaError, match="'clip'"):
        processor.process(ONE_VIDEO, videos=[MediaInput(None, {"fps": 0.5}, uuid="clip")])


def test_frame_list_sampling_and_timestamps(processor):
    """Frames are one second apart (vLLM's assumption); `max_frames` samples them evenly."""
    url = frame_list_url(frames(6))
    item = processor.process(ONE_VIDEO, videos=[url]).mm_items[0]
    assert item.grid_thw[0] == 3 and item.timestamps == [0.5, 2.5, 4.5]
    fewer = processor.process(ONE_VIDEO, videos=[url], max_frames=4).mm_items[0]
    assert fewer.grid_thw[0] == 2
