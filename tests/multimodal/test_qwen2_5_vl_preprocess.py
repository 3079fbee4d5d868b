"""Qwen2.5-VL's preprocessing against transformers' `Qwen2VLVideoProcessor` and `Qwen2_5_VLProcessor`
(run with `hf_video.torchvision_stand_in`): frames sampled and sized as there, pixels bit for bit, the seconds
between patch groups (`second_per_grid_ts`), and the prompt: a video's pads in one run, no timestamps."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_utils import VideoMetadata

from hf_video import hf_video_inputs, make_video, torchvision_stand_in
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.multimodal.video import (
    Qwen2VLVideoProcessor,
    Qwen2VLVideoProcessorConfig,
    VideoProcessor,
    sample_frame_indices_qwen2_vl,
)
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def hf_video_module():
    with pytest.MonkeyPatch.context() as patch:
        yield torchvision_stand_in(patch)


@pytest.fixture(scope="module")
def hf_processor(tiny_qwen2_5_dir, hf_video_module) -> Qwen2_5_VLProcessor:
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(tiny_qwen2_5_dir),
        tokenizer=AutoTokenizer.from_pretrained(tiny_qwen2_5_dir),
        video_processor=hf_video_module.Qwen2VLVideoProcessor.from_pretrained(tiny_qwen2_5_dir),
    )


@pytest.fixture(scope="module")
def processor(tiny_qwen2_5_dir) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(tiny_qwen2_5_dir, Tokenizer.from_pretrained(tiny_qwen2_5_dir))


def test_the_checkpoint_names_qwen2_vl_videos(tiny_qwen2_5_dir, tiny_dense_dir, tmp_path):
    """By its video config's `video_processor_type`; without that file (the published checkpoints), by the
    processor `preprocessor_config.json` names, whose settings then hold for videos too (as in transformers)."""
    assert type(VideoProcessor.from_pretrained(tiny_qwen2_5_dir)) is Qwen2VLVideoProcessor
    assert type(VideoProcessor.from_pretrained(tiny_dense_dir)) is VideoProcessor
    published = shutil.copytree(tiny_qwen2_5_dir, tmp_path / "published")
    (published / "video_preprocessor_config.json").unlink()
    image = json.loads((published / "preprocessor_config.json").read_text())
    video = VideoProcessor.from_pretrained(published)
    assert type(video) is Qwen2VLVideoProcessor and not video.timestamps
    assert (video.config.min_pixels, video.config.max_pixels) == (image["size"]["shortest_edge"], 448 * 448)
    assert video.config.patch_size == 14


def test_frame_sampling_matches_transformers(hf_video_module):
    for max_frames in (768, 8, 3):
        reference = hf_video_module.Qwen2VLVideoProcessor(min_frames=4, max_frames=max_frames)
        for total in (2, 3, 5, 17, 30, 61, 300, 1001):
            for video_fps in (1.0, 10.0, 23.976, 30.0, 60.0):
                for fps in (0.5, 1.0, 2.0, 4.5):
                    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
                    try:
                        expected = reference.sample_frames(metadata, fps=fps).tolist()
                    except ZeroDivisionError:  # (fewer frames than a temporal patch: kept whole here)
                        expected = list(range(total))
                    assert sample_frame_indices_qwen2_vl(total, video_fps, fps, 4, max_frames, 2) == expected


@pytest.mark.parametrize(
    "frames, fps, width, height, overrides",
    [
        (30, 10, 96, 64, {}),  # resized to multiples of 28 pixels
        (5, 5, 64, 48, {}),  # 4 frames kept: a group every half second
        (40, 20, 160, 120, {}),  # the per-frame limit (224 x 224) is not reached
        (40, 20, 300, 260, {}),  # it is: each frame scaled down
        (40, 20, 80, 80, {"fps": 4.0, "max_frames": 6}),
        (40, 20, 160, 120, {"max_pixels": 56 * 56}),
    ],
)
def test_video_matches_transformers(tmp_path, tiny_qwen2_5_dir, hf_video_module, frames, fps, width, height, overrides):
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_video(frames, fps, width, height))
    item = VideoProcessor.from_pretrained(tiny_qwen2_5_dir).preprocess(path, **overrides)

    # transformers reads max_frames from the processor, not from the call: configure the reference itself.
    settings = {k: overrides[k] for k in ("fps", "max_frames") if k in overrides}
    if "max_pixels" in overrides:
        settings["size"] = {"shortest_edge": 28 * 28, "longest_edge": overrides["max_pixels"]}
    reference_processor = hf_video_module.Qwen2VLVideoProcessor.from_pretrained(tiny_qwen2_5_dir, **settings)
    all_frames, metadata = hf_video_inputs(path)
    reference = reference_processor(
        videos=[all_frames], video_metadata=[metadata], do_sample_frames=True, return_metadata=True
    )
    assert item.grid_thw == tuple(int(v) for v in reference["video_grid_thw"][0])
    assert torch.equal(item.pixel_values, reference["pixel_values_videos"])
    assert item.timestamps is None
    assert item.second_per_grid == 2 / reference["video_metadata"][0].sampled_fps


def test_a_clip_shorter_than_a_temporal_patch_is_kept_whole(tiny_qwen2_5_dir):
    """(transformers divides by zero on it.)"""
    item = VideoProcessor.from_pretrained(tiny_qwen2_5_dir).preprocess(make_video(1, 10, 56, 56))
    assert item.grid_thw == (1, 4, 4) and item.second_per_grid == 2 / 10  # (a temporal patch of frames at 10 a second)
    patch = item.pixel_values[0].view(3, 2, 14 * 14)
    assert torch.equal(patch[:, 0], patch[:, 1])  # the frame is repeated to fill the temporal patch


def test_cap_pixels_per_frame_is_refused():
    with pytest.raises(ValueError, match="cap_pixels_per_frame"):
        Qwen2VLVideoProcessorConfig(cap_pixels_per_frame=True)


def test_prompt_matches_transformers(tmp_path, processor, hf_processor):
    path = tmp_path / "clip.mp4"
    path.write_bytes(make_video(45, 15, 100, 70))
    image = make_image(230, 170, seed=1)
    content = [
        {"type": "video", "video": str(path)},
        {"type": "text", "text": "and"},
        {"type": "image", "image": image},
        {"type": "text", "text": "What is common?"},
    ]
    messages = [{"role": "user", "content": content}]
    result = processor.process_messages(messages)
    frames, metadata = hf_video_inputs(path)
    text = processor.tokenizer.apply_chat_template(messages)
    reference = hf_processor(
        text=[text], images=[image], videos=[frames], video_metadata=[metadata], do_sample_frames=True
    )
    assert result.input_ids == list(reference["input_ids"][0])
    video, picture = result.mm_items
    assert torch.equal(video.pixel_values, reference["pixel_values_videos"])
    assert np.array_equal(picture.pixel_values.numpy(), reference["pixel_values"])
    assert [video.second_per_grid] == list(reference["second_per_grid_ts"])
    # one run of pads for the whole video, between the chat template's own vision start and end
    ((start, end),) = video.spans
    assert end - start == video.num_tokens(2) and video.grid_thw[0] > 1
    start_id, end_id = (processor.tokenizer.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert (result.input_ids[start - 1], result.input_ids[end]) == (start_id, end_id)
