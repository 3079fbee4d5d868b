"""The workloads of benchmarks/bench_serving.py: drawn lengths, videos and pools; and how
benchmarks/bench_offline.py counts static batches and hands requests to vLLM (no server, no timing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_serve.multimodal.video import VideoProcessor, VideoProcessorConfig
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def workload(bench, *flags: str):
    parser = bench.build_parser()
    args = parser.parse_args(["--launch", "--num-prompts", "200", *flags])
    bench.check_args(parser, args)
    return args, *bench.build_workload(args)


def test_without_sigmas_every_request_asks_the_same_lengths(bench):
    _, requests, warm_ups = workload(bench, "--images-per-request", "0", "--input-len", "20", "--output-len", "7")
    assert {r.max_tokens for r in requests} == {7}
    assert {len(r.prompt.split()) for r in requests} == {20}
    assert not any(r.images or r.videos for r in requests) and warm_ups == []


def test_sigmas_draw_reproducible_long_tailed_lengths(bench):
    flags = ("--images-per-request", "0", "--input-len", "50", "--input-len-sigma", "0.5", "--output-len", "40")
    _, requests, _ = workload(bench, *flags, "--output-len-sigma", "1.0")
    _, again, _ = workload(bench, *flags, "--output-len-sigma", "1.0")
    _, other_output, _ = workload(bench, *flags, "--output-len-sigma", "0.3")
    lengths = [r.max_tokens for r in requests]
    words = [len(r.prompt.split()) for r in requests]
    assert lengths == [r.max_tokens for r in again] and words == [len(r.prompt.split()) for r in again]
    assert 1 <= min(lengths) and max(lengths) <= 8 * 40 and max(words) <= 8 * 50
    assert 30 <= np.median(lengths) <= 55 and np.mean(lengths) > np.median(lengths)  # median ~40, long right tail
    assert max(lengths) > 3 * 40
    # the output sigma changes neither the texts nor the input lengths
    assert [r.prompt for r in other_output] == [r.prompt for r in requests]


def test_video_requests_carry_decodable_mp4_parts(bench):
    flags = ("--images-per-request", "0", "--videos-per-request", "1", "--video-frames", "4", "--video-size", "64x48")
    args, requests, _ = workload(bench, *flags)
    requests = requests[:2]
    assert requests[0].videos[0] != requests[1].videos[0]  # fresh per request
    payload = bench.chat_payload("m", requests[0], text_first=False)
    video, text = payload["messages"][0]["content"]
    assert video["type"] == "video_url" and video["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert text["type"] == "text" and payload["max_tokens"] == args.output_len and payload["ignore_eos"] is True
    item = VideoProcessor(VideoProcessorConfig()).preprocess(video["video_url"]["url"])
    assert item.grid_thw[0] == 2  # 4 frames at 2 fps, 2 frames per temporal patch


def test_repeated_requests_take_images_and_videos_from_warmed_pools(bench):
    flags = ("--videos-per-request", "1", "--video-frames", "2", "--video-size", "32x32", "--image-size", "32x32")
    _, requests, warm_ups = workload(bench, *flags, "--repeat-image-ratio", "0.5", "--image-pool-size", "2")
    pool_images = {url for w in warm_ups for url in w.images}
    pool_videos = {url for w in warm_ups for url in w.videos}
    assert len(warm_ups) == 4 and len(pool_images) == 2 and len(pool_videos) == 2
    assert sum(r.repeated for r in requests) == 100
    for r in requests:
        assert (set(r.images) <= pool_images and set(r.videos) <= pool_videos) == r.repeated


@pytest.mark.parametrize(
    "flags",
    [("--video-size", "63x48"), ("--output-len-sigma", "-1"), ("--input-len", "0", "--input-len-sigma", "0.5")],
)
def test_bad_workload_flags_are_rejected(bench, flags):
    with pytest.raises(SystemExit):
        workload(bench, *flags)


# ---- benchmarks/bench_offline.py: static batches and the vLLM request file ---------------------------


@pytest.fixture(scope="module")
def offline(bench):
    """benchmarks/bench_offline.py; its `from bench_serving import ...` finds the module `bench` loaded, and
    its other imports of benchmarks/ modules find them on the path."""
    spec = importlib.util.spec_from_file_location("bench_offline", BENCH.parent / "bench_offline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    yield module
    del sys.modules[spec.name]
    sys.modules.pop("compare_peer", None)


class CountingModel:
    """Stands in for transformers' model: row r of a batch generates 100 r, 100 r + 1, ..."""

    device = torch.device("cpu")

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        rows = torch.arange(len(input_ids))[:, None]
        return torch.cat([input_ids, 100 * rows + torch.arange(max_new_tokens)], dim=1)


def test_a_static_batch_runs_to_its_longest_request_but_counts_only_each_requests_own_tokens(offline):
    batch = {"input_ids": torch.zeros((2, 3), dtype=torch.long)}
    setting = offline.HfSetting(batch_size=2, requests=4, batches=[batch, batch], max_tokens=[[2, 5], [3, 1]])
    setting.run(CountingModel(), pad_id=0)
    assert setting.tokens == [[0, 1], [100, 101, 102, 103, 104], [0, 1, 2], [100]]
    assert setting.waste == pytest.approx(1 - 11 / (2 * 5 + 2 * 3))  # the batches generated 10 and 6 tokens
    # agreement compares each request's own tokens with the reference's, request by request
    reference = [[0, 1], [100, 101, 7, 103, 104], [0, 1, 2], [100], [5, 5]]
    assert offline.agreement(setting.tokens, reference) == (10, 11, 3)
    assert setting.agrees(reference)
    assert not setting.agrees([[9, 9], [9] * 5, [9] * 3, [9]])


def test_vllm_requests_carry_the_rendered_prompt_and_each_image_once_as_lossless_png(offline, tiny_moe_dir, tmp_path):
    engine = SimpleNamespace(tokenizer=Tokenizer.from_pretrained(tiny_moe_dir))
    shared, other = make_image(40, 30, seed=1), make_image(20, 50, seed=2)

    def conversation(*pictures: Image.Image) -> list[dict]:
        content = [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": "Hi"}]
        return [{"role": "user", "content": content}]

    images: dict[int, str] = {}
    first = offline.vllm_request(engine, conversation(shared), 7, images, tmp_path)
    second = offline.vllm_request(engine, conversation(shared, other), 3, images, tmp_path)
    assert first["max_tokens"] == 7 and second["max_tokens"] == 3
    assert first["prompt"].count("<|image_pad|>") == 1 and second["prompt"].count("<|image_pad|>") == 2
    assert second["prompt"].endswith("<|im_start|>assistant\n")
    assert second["images"][0] == first["images"][0] and len(set(images.values())) == 2
    assert len(list(tmp_path.glob("*.png"))) == 2
    for path, picture in zip(second["images"], (shared, other)):
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), np.asarray(picture))
