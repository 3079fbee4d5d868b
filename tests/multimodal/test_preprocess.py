"""Image/video preprocessing and prompt expansion against transformers' Qwen3-VL processors.

Images are compared with `Qwen2VLImageProcessorPil` bit for bit. transformers' video processor needs
torchvision, which is not installed here; it is run with `hf_video.torchvision_stand_in`. Frame decoding,
sampling, sizing, padding, patch layout, timestamps and the prompt text are transformers' own code. Frames
are decoded for it with transformers' `read_video_pyav`.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.models.qwen3_vl.video_processing_qwen3_vl as hf_qwen3_video
from PIL import Image, ImageOps
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from hf_video import hf_video_inputs, make_video
from hf_video import torchvision_stand_in as torchvision_stand_in_for
from vlm_serve.multimodal.image_processor import ImageProcessor, ImageProcessorConfig, smart_resize
from vlm_serve.multimodal.media import load_image
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.multimodal.video import (
    VideoProcessor,
    VideoProcessorConfig,
    group_timestamps,
    sample_frame_indices,
    smart_resize_video,
)
from vlm_serve.tokenizer import Tokenizer

QWEN3_VL_IMAGE_BUDGET = (65536, 16777216)  # the published checkpoints' image pixel limits


# -- helpers -----------------------------------------------------------------------------------------


def noise_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A deterministic random image of the given size and Pillow mode."""
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        return Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    if mode == "I":
        return Image.fromarray(rng.integers(0, 70000, (height, width), dtype=np.int32))
    if mode == "F":
        return Image.fromarray((rng.random((height, width)) * 300).astype(np.float32))
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "LA":
        return noise_image(height, width, "RGBA", seed).convert("LA")
    if mode == "P+transparency":
        image = rgb.convert("P")
        image.info["transparency"] = 7
        return image
    if mode == "RGB+transparency":
        rgb.info["transparency"] = (10, 20, 30)
        return rgb
    return rgb if mode == "RGB" else rgb.convert(mode)


def assert_same_image(item, reference) -> None:
    assert item.modality == "image"
    assert item.grid_thw == tuple(int(v) for v in reference["image_grid_thw"][0])
    assert item.pixel_values.dtype == torch.float32
    assert np.array_equal(item.pixel_values.numpy(), np.asarray(reference["pixel_values"]))


@pytest.fixture(scope="module")
def torchvision_stand_in():
    with pytest.MonkeyPatch.context() as patch:
        torchvision_stand_in_for(patch)
        yield


@pytest.fixture(scope="module")
def hf_image(tiny_dense_dir):
    return Qwen2VLImageProcessorPil.from_pretrained(tiny_dense_dir)


@pytest.fixture(scope="module")
def image_processor(tiny_dense_dir):
    return ImageProcessor.from_pretrained(tiny_dense_dir)


@pytest.fixture(scope="module")
def hf_video(tiny_dense_dir, torchvision_stand_in):
    return hf_qwen3_video.Qwen3VLVideoProcessor.from_pretrained(tiny_dense_dir)


@pytest.fixture(scope="module")
def hf_processor(tiny_dense_dir, hf_image, hf_video):
    return Qwen3VLProcessor(
        image_processor=hf_image, tokenizer=AutoTokenizer.from_pretrained(tiny_dense_dir), video_processor=hf_video
    )


@pytest.fixture(scope="module")
def processor(tiny_dense_dir):
    return MultimodalProcessor.from_pretrained(tiny_dense_dir, Tokenizer.from_pretrained(tiny_dense_dir))


@pytest.fixture(scope="module")
def video_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("videos") / "clip.mp4"
    path.write_bytes(make_video(frames=45, fps=15, width=100, height=70))
    return path


# -- images ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "height, width",
    [
        (1, 1),
        (5, 7),
        (31, 33),
        (32, 32),
        (64, 64),
        (100, 150),
        (101, 203),
        (333, 517),
        (512, 512),
        (600, 700),
        (1500, 2000),
        (2, 399),
        (1000, 5),
        (40, 1000),
        (7, 1001),
    ],
)
def test_image_sizes_match_transformers(hf_image, image_processor, height, width):
    image = noise_image(height, width, seed=height * 7 + width)
    assert_same_image(image_processor.preprocess(image), hf_image(image, return_tensors="np"))


@pytest.mark.parametrize(
    "mode",
    [
        "RGBA",
        "L",
        "P",
        "P+transparency",
        "RGB+transparency",
        "CMYK",
        "LA",
        "PA",
        "1",
        "I;16",
        "I",
        "F",
        "YCbCr",
        "RGBX",
    ],
)
def test_image_modes_match_transformers(hf_image, image_processor, mode):
    image = noise_image(90, 130, mode, seed=3)
    assert_same_image(image_processor.preprocess(image), hf_image(image, return_tensors="np"))


@pytest.mark.parametrize("mode, widened", [("RGB", 1), ("L", 3)])
def test_an_image_is_handed_over_as_its_bytes_and_its_values_made_where_asked(hf_image, image_processor, mode, widened):
    """The item holds the picture's uint8 patches, an eighth of its float32 values (one frame for the
    tower's two, a byte for four; a grayscale picture one channel for three): the values are made from
    them on the device asked, transformers' own."""
    image = noise_image(90, 130, mode, seed=5)
    item = image_processor.preprocess(image)
    values = item.pixels.values("cpu")
    assert item.pixels.data.dtype == torch.uint8 and item.pixels.values_shape == values.shape
    assert item.pixels.nbytes * 8 * widened == values.nbytes
    assert np.array_equal(values.numpy(), np.asarray(hf_image(image, return_tensors="np")["pixel_values"]))


@pytest.mark.parametrize("height, width", [(50, 50), (700, 1100), (3000, 20)])
def test_image_qwen3_vl_budget_matches_transformers(height, width):
    min_pixels, max_pixels = QWEN3_VL_IMAGE_BUDGET
    config = ImageProcessorConfig(
        patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, min_pixels=min_pixels, max_pixels=max_pixels
    )
    reference = Qwen2VLImageProcessorPil(
        patch_size=16,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    image = noise_image(height, width, seed=11)
    assert_same_image(ImageProcessor(config).preprocess(image), reference(image, return_tensors="np"))


def test_clip_statistics_match_transformers():
    """CLIP mean/std (transformers' class defaults) take the 256-entry table path: values still equal."""
    reference = Qwen2VLImageProcessorPil(patch_size=16, size={"shortest_edge": 1024, "longest_edge": 65536})
    ours = ImageProcessor(ImageProcessorConfig(patch_size=16, min_pixels=1024, max_pixels=65536))
    image = noise_image(120, 77, seed=5)
    assert_same_image(ours.preprocess(image), reference(image, return_tensors="np"))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(hf_image, image_processor, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    noise_image(60, 100, seed=orientation).save(buffer, "JPEG", exif=exif)
    data = buffer.getvalue()

    loaded = load_image(data)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert loaded.size == upright.size == ((60, 100) if orientation >= 5 else (100, 60))
    assert_same_image(image_processor.preprocess(loaded), hf_image(upright, return_tensors="np"))
    # A PIL image given directly is turned upright too.
    assert load_image(Image.open(io.BytesIO(data))).size == upright.size


@pytest.mark.parametrize("min_pixels, max_pixels", [(4096, 50000), (32 * 32, 32 * 32), (200_000, 400_000)])
def test_request_pixel_limits_match_transformers(hf_image, image_processor, min_pixels, max_pixels):
    image = noise_image(300, 420, seed=2)
    item = image_processor.preprocess(image, min_pixels=min_pixels, max_pixels=max_pixels)
    reference = hf_image(image, size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, return_tensors="np")
    assert_same_image(item, reference)


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    for _ in range(500):
        height, width = (int(v) for v in rng.integers(1, 5000, size=2))
        if max(height, width) / min(height, width) > 200:
            continue
        min_pixels = int(rng.integers(1, 100_000))
        max_pixels = int(rng.integers(min_pixels, 20_000_000))
        expected = hf_smart_resize(height, width, 32, min_pixels, max_pixels)
        assert smart_resize(height, width, 32, min_pixels, max_pixels) == expected


# -- settings ----------------------------------------------------------------------------------------


def test_configs_read_from_checkpoint(tiny_dense_dir):
    image = ImageProcessorConfig.from_pretrained(tiny_dense_dir)
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (16, 2, 2)
    assert (image.min_pixels, image.max_pixels) == (32 * 32, 512 * 512)
    assert image.image_mean == image.image_std == (0.5, 0.5, 0.5)
    video = VideoProcessorConfig.from_pretrained(tiny_dense_dir)
    assert (video.fps, video.min_frames, video.max_frames) == (2.0, 4, 768)
    assert (video.min_pixels, video.max_pixels) == (32 * 32, 1024 * 32 * 32 * 2)
    assert video.cap_pixels_per_frame is False


def test_config_older_pixel_forms():
    old = ImageProcessorConfig.from_dict({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14})
    assert (old.min_pixels, old.max_pixels, old.factor) == (3136, 12845056, 28)
    inside_size = ImageProcessorConfig.from_dict({"size": {"min_pixels": 4096, "max_pixels": 65536}})
    assert (inside_size.min_pixels, inside_size.max_pixels) == (4096, 65536)
    # top-level keys win over `size`, as transformers' constructor applies them last
    both = ImageProcessorConfig.from_dict({"size": {"shortest_edge": 1, "longest_edge": 10**6}, "max_pixels": 5000})
    assert both.max_pixels == 5000


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"min_pixels": 0}, "min_pixels must be a positive integer"),
        ({"max_pixels": -5}, "max_pixels must be a positive integer"),
        ({"min_pixels": True}, "min_pixels must be a positive integer"),
        ({"max_pixels": 1.5e6}, "max_pixels must be a positive integer"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "must not exceed max_pixels"),
        ({"min_pixels": 50, "max_pixels": 100}, "at least one merged patch"),
    ],
)
def test_bad_image_overrides(image_processor, overrides, message):
    with pytest.raises(ValueError, match=message):
        image_processor.preprocess(noise_image(40, 40), **overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"fps": 0}, "fps must be a positive number"),
        ({"fps": float("nan")}, "fps must be a positive number"),
        ({"fps": "2"}, "fps must be a positive number"),
        ({"max_frames": 0}, "max_frames must be a positive integer"),
        ({"max_frames": 2.5}, "max_frames must be a positive integer"),
        ({"min_pixels": -1}, "min_pixels must be a positive integer"),
    ],
)
def test_bad_video_overrides(tiny_dense_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        VideoProcessorConfig.from_pretrained(tiny_dense_dir).with_overrides(**overrides)


# -- video -------------------------------------------------------------------------------------------


def test_frame_sampling_matches_transformers(torchvision_stand_in):
    for max_frames in (768, 8, 3):
        reference = hf_qwen3_video.Qwen3VLVideoProcessor(min_frames=4, max_frames=max_frames)
        for total in (1, 2, 3, 5, 17, 30, 61, 300, 1001):
            for video_fps in (1.0, 10.0, 23.976, 30.0, 60.0):
                for fps in (0.5, 1.0, 2.0, 4.5):
                    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
                    expected = reference.sample_frames(metadata, fps=fps).tolist()
                    assert sample_frame_indices(total, video_fps, fps, 4, max_frames) == expected


def test_video_smart_resize_and_timestamps_match_transformers():
    rng = np.random.default_rng(1)
    for _ in range(300):
        frames = int(rng.integers(2, 200))
        height, width = (int(v) for v in rng.integers(8, 3000, size=2))
        if max(height, width) / min(height, width) > 150:
            continue
        budget = (int(rng.integers(1024, 50_000)), int(rng.integers(100_000, 50_000_000)))
        expected = hf_qwen3_video.smart_resize(frames, height, width, 2, 32, *budget)
        assert smart_resize_video(frames, height, width, 2, 32, *budget) == expected
    for indices in ([0, 6, 12, 17, 23, 29], [0, 4, 9], [3], list(range(0, 100, 7))):
        expected = Qwen3VLProcessor._calculate_timestamps(None, list(indices), 23.976, 2)
        assert group_timestamps(indices, 23.976, 2) == expected


@pytest.mark.parametrize(
    "frames, fps, width, height, overrides",
    [
        (30, 10, 96, 64, {}),  # no resize needed
        (45, 15, 100, 70, {}),  # bicubic resize
        (5, 5, 64, 48, {}),  # 5 sampled frames: the last is repeated
        (40, 20, 160, 120, {"max_pixels": 4 * 64 * 64}),  # whole-clip budget forces a downscale
        (40, 20, 80, 80, {"fps": 4.0, "max_frames": 7}),
    ],
)
def test_video_matches_transformers(
    tmp_path, tiny_dense_dir, torchvision_stand_in, frames, fps, width, height, overrides
):
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_video(frames, fps, width, height))
    item = VideoProcessor.from_pretrained(tiny_dense_dir).preprocess(path, **overrides)

    # transformers reads max_frames from the processor, not from the call: configure the reference itself.
    settings = {k: overrides[k] for k in ("fps", "max_frames") if k in overrides}
    if "max_pixels" in overrides:
        settings["size"] = {"shortest_edge": 32 * 32, "longest_edge": overrides["max_pixels"]}
    reference_processor = hf_qwen3_video.Qwen3VLVideoProcessor.from_pretrained(tiny_dense_dir, **settings)
    all_frames, metadata = hf_video_inputs(path)
    reference = reference_processor(
        videos=[all_frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True
    )
    assert item.modality == "video"
    assert item.grid_thw == tuple(int(v) for v in reference["video_grid_thw"][0])
    assert torch.equal(item.pixel_values, reference["pixel_values_videos"])
    indices = reference["video_metadata"][0].frames_indices
    assert item.timestamps == Qwen3VLProcessor._calculate_timestamps(None, indices, metadata.fps, 2)


def test_video_frames_given_explicitly(tiny_dense_dir, hf_video, video_file):
    all_frames, metadata = hf_video_inputs(video_file)
    indices = [0, 11, 22, 33, 44]
    item = VideoProcessor.from_pretrained(tiny_dense_dir).preprocess_frames(all_frames[indices], indices, metadata.fps)
    reference = hf_video(videos=[all_frames[indices]], do_sample_frames=False)
    assert item.grid_thw == tuple(int(v) for v in reference["video_grid_thw"][0])
    assert torch.equal(item.pixel_values, reference["pixel_values_videos"])
    assert item.timestamps == Qwen3VLProcessor._calculate_timestamps(None, indices, metadata.fps, 2)


def test_video_without_stated_frame_count(tiny_dense_dir):
    """Matroska does not state the frame count: frames are counted by demuxing, and sampled the same way."""
    processor = VideoProcessor.from_pretrained(tiny_dense_dir)
    mkv = processor.preprocess(make_video(24, 8, 64, 64, fmt="matroska"))
    mp4 = processor.preprocess(make_video(24, 8, 64, 64, fmt="mp4"))
    assert mkv.grid_thw == mp4.grid_thw == (3, 4, 4)
    assert mkv.timestamps == mp4.timestamps


def test_single_frame_video_is_accepted(tiny_dense_dir):
    item = VideoProcessor.from_pretrained(tiny_dense_dir).preprocess(make_video(1, 10, 64, 64))
    assert item.grid_thw == (1, 4, 4)
    assert item.timestamps == [0.0]
    patch = item.pixel_values[0].view(3, 2, 16 * 16)
    assert torch.equal(patch[:, 0], patch[:, 1])  # the frame is repeated to fill the temporal patch


# -- prompt expansion --------------------------------------------------------------------------------


def check_spans(result, token_ids: dict[str, int]) -> None:
    for item in result.mm_items:
        token = token_ids[item.modality]
        assert sum(end - start for start, end in item.spans) == item.num_tokens(2)
        for start, end in item.spans:
            assert all(t == token for t in result.input_ids[start:end])
            assert result.input_ids[start - 1] != token
            assert end == len(result.input_ids) or result.input_ids[end] != token


def test_one_image_prompt(processor, hf_processor):
    image = noise_image(100, 150, seed=1)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]
    result = processor.process_messages(messages)
    text = processor.tokenizer.apply_chat_template(messages)
    reference = hf_processor(text=[text], images=[image])
    assert result.input_ids == list(reference["input_ids"][0])
    assert_same_image(result.mm_items[0], reference)
    check_spans(result, {"image": processor.image_token_id})


def test_several_images_prompt(processor, hf_processor):
    images = [noise_image(100, 150, seed=1), noise_image(400, 90, "RGBA", seed=2), noise_image(33, 700, "L", seed=3)]
    buffer = io.BytesIO()
    images[1].save(buffer, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {"role": "system", "content": "You are helpful."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0]},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "image_url", "image_url": images[2]},
                {"type": "text", "text": "Compare them."},
            ],
        },
    ]
    result = processor.process_messages(messages)
    reference = hf_processor(text=[processor.tokenizer.apply_chat_template(messages)], images=images)
    assert result.input_ids == list(reference["input_ids"][0])
    assert [item.grid_thw for item in result.mm_items] == [tuple(g) for g in reference["image_grid_thw"].tolist()]
    pixel_values = torch.cat([item.pixel_values for item in result.mm_items]).numpy()
    assert np.array_equal(pixel_values, reference["pixel_values"])
    check_spans(result, {"image": processor.image_token_id})


def test_video_prompt(processor, hf_processor, video_file):
    content = [{"type": "video", "video": str(video_file)}, {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": content}]
    result = processor.process_messages(messages)
    frames, metadata = hf_video_inputs(video_file)
    text = processor.tokenizer.apply_chat_template(messages)
    reference = hf_processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=True)
    assert result.input_ids == list(reference["input_ids"][0])
    (item,) = result.mm_items
    assert item.grid_thw == tuple(reference["video_grid_thw"][0].tolist())
    assert torch.equal(item.pixel_values, reference["pixel_values_videos"])
    assert len(item.spans) == item.grid_thw[0]
    check_spans(result, {"video": processor.video_token_id})


def test_image_and_video_prompt(processor, hf_processor, video_file):
    image = noise_image(50, 80, seed=4)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": "file://" + str(video_file)}},
                {"type": "text", "text": "and"},
                {"type": "image", "image": image},
                {"type": "text", "text": "What is common?"},
            ],
        }
    ]
    result = processor.process_messages(messages)
    frames, metadata = hf_video_inputs(video_file)
    text = processor.tokenizer.apply_chat_template(messages)
    reference = hf_processor(
        text=[text], images=[image], videos=[frames], video_metadata=[metadata], do_sample_frames=True
    )
    assert result.input_ids == list(reference["input_ids"][0])
    assert [item.modality for item in result.mm_items] == ["video", "image"]
    assert torch.equal(result.mm_items[0].pixel_values, reference["pixel_values_videos"])
    assert np.array_equal(result.mm_items[1].pixel_values.numpy(), reference["pixel_values"])
    check_spans(result, {"image": processor.image_token_id, "video": processor.video_token_id})


def test_raw_prompt_with_overrides(processor, hf_processor):
    images = [noise_image(300, 300, seed=8), noise_image(300, 300, seed=9)]
    prompt = "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>Same?"
    items = [images[0], MediaInput(images[1], {"max_pixels": 64 * 64})]
    result = processor.process(prompt, images=items, max_pixels=128 * 128)
    assert [item.grid_thw for item in result.mm_items] == [(1, 8, 8), (1, 4, 4)]
    reference = hf_processor.image_processor(images[0], size={"shortest_edge": 1024, "longest_edge": 128 * 128})
    assert np.array_equal(result.mm_items[0].pixel_values.numpy(), reference["pixel_values"])
    check_spans(result, {"image": processor.image_token_id})


def test_message_part_overrides_and_sources(processor, tmp_path):
    image = noise_image(256, 256, seed=6)
    path = tmp_path / "picture.png"
    image.save(path)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(path), "max_pixels": 64 * 64},
                {"type": "image", "image": path.read_bytes()},
                {"type": "text", "text": "Same picture?"},
            ],
        }
    ]
    result = processor.process_messages(messages)
    assert [item.grid_thw for item in result.mm_items] == [(1, 4, 4), (1, 16, 16)]


def test_placeholder_count_mismatch(processor):
    with pytest.raises(ValueError, match=r"1 <\|image_pad\|> placeholder\(s\) but 2 image\(s\)"):
        processor.process("<|image_pad|>", images=[noise_image(40, 40), noise_image(40, 40)])
    with pytest.raises(ValueError, match=r"1 <\|video_pad\|> placeholder\(s\) but 0 video\(s\)"):
        processor.process("<|video_pad|> text")
