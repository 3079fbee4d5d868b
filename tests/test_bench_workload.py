"""The workloads of benchmarks/bench_serving.py: drawn lengths, videos and pools (no server, no timing)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from vlm_serve.vision.video import VideoProcessor, VideoProcessorConfig

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"


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
