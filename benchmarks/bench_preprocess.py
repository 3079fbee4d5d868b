"""Image preprocessing throughput: vlm_serve's ImageProcessor vs transformers' Qwen2VLImageProcessorPil.

Both get the same 200 deterministic PIL images (64..1600 px per side, aspect ratios up to 25:1, modes
RGB / L / RGBA / P / CMYK) in one run, with the Qwen3-VL settings (patch 16, merge 2, temporal 2,
mean/std 0.5, bicubic). Two pixel budgets are measured: the published Qwen3-VL checkpoints'
(65536..16777216 pixels: images keep about their size) and the tiny test checkpoint's (1024..262144:
most images are shrunk). Every output is checked to be bit-identical to transformers'.

Each image is timed `--repeats` times per implementation, calls alternating between the two so that
both see the same machine load; an image counts with its fastest run, outputs are dropped after each
call. torch runs with `--threads` intra-op threads (default 1, as transformers' numpy code is
single-threaded).

`--pixel-free` measures instead what a PD decode server spends on a request's media: the pixel-free
processor (`MultimodalProcessor(pixels=False)`: fetch, hash, header probe) against the full one (fetch,
hash, probe, decode, preprocess), for a 1024x1024 PNG, the same as a JPEG, and a 16-frame 448x448
MPEG-4 video at 2 fps (every frame sampled), each sent as a data URL in a chat request, with the
Qwen3-VL settings and no processed-input cache. Both must give the same prompt ids, grids and hashes.
Times are whole `process_messages` calls (chat template and tokenizing included), fastest of
`--repeats`, calls alternating.

    python benchmarks/bench_preprocess.py [--images 200] [--repeats 2] [--threads 1] [--pixel-free]
"""

from __future__ import annotations

import argparse
import base64
import io
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.multimodal.image_processor import ImageProcessor, ImageProcessorConfig
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.multimodal.video import VideoProcessor, VideoProcessorConfig, write_video
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer

BUDGETS = {"qwen3-vl": (65536, 16777216), "tiny checkpoint": (32 * 32, 512 * 512)}
MODES = ["RGB"] * 13 + ["L"] * 2 + ["RGBA"] * 2 + ["P"] * 2 + ["CMYK"]


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """Deterministic images: smooth gradients plus noise, sides uniform in [64, 1600]."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        width, height = rng.integers(64, 1601, size=2)
        y, x = np.ogrid[:height, :width]
        base = (x * (255 / width) + y * (255 / height)) / 2
        noise = rng.integers(-40, 40, size=(height, width, 3))
        pixels = np.clip(base[..., None] + noise + rng.integers(0, 60, size=3), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels)
        mode = MODES[i % len(MODES)]
        if mode == "RGBA":
            alpha = rng.integers(0, 256, size=(height, width, 1), dtype=np.uint8)
            image = Image.fromarray(np.concatenate([pixels, alpha], axis=2), "RGBA")
        elif mode != "RGB":
            image = image.convert(mode)
        images.append(image)
    return images


def timed_rates(
    implementations: list[Callable[[Image.Image], object]], images: list[Image.Image], repeats: int
) -> list[float]:
    """Images per second of each implementation. Calls alternate image by image, so both see the same
    machine load, and each image counts with its fastest of `repeats` runs."""
    best = np.full((len(implementations), len(images)), np.inf)
    for _ in range(repeats):
        for i, image in enumerate(images):
            for k, process in enumerate(implementations):
                start = time.perf_counter()
                process(image)
                best[k, i] = min(best[k, i], time.perf_counter() - start)
    return [len(images) / total for total in best.sum(axis=1)]


def run_budget(name: str, images: list[Image.Image], repeats: int) -> float:
    min_pixels, max_pixels = BUDGETS[name]
    reference = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    ours = ImageProcessor(
        ImageProcessorConfig(
            patch_size=16,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=(0.5, 0.5, 0.5),
            image_std=(0.5, 0.5, 0.5),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )
    )

    def run_reference(image: Image.Image) -> dict:
        return reference(image, return_tensors="np")

    for image in images:  # identity check (also the warm-up)
        expected = run_reference(image)
        got = ours.preprocess(image)
        if not np.array_equal(expected["pixel_values"], got.pixel_values.numpy()):
            raise SystemExit(f"[{name}] pixel values differ for a {image.mode} {image.size} image")
        if tuple(expected["image_grid_thw"][0]) != got.grid_thw:
            raise SystemExit(f"[{name}] grids differ for a {image.mode} {image.size} image")

    reference_rate, ours_rate = timed_rates([run_reference, ours.preprocess], images, repeats)
    ratio = ours_rate / reference_rate
    print(
        f"{name:>16}: transformers {reference_rate:7.1f} img/s | vlm_serve {ours_rate:7.1f} img/s | "
        f"ratio {ratio:.2f}x | outputs identical"
    )
    return ratio


def pixel_free_requests() -> dict[str, list[dict]]:
    """One chat request per medium, its media as a data URL (as an API request carries it)."""
    image = make_image(1024, 1024)
    media = {
        "1024x1024 PNG": ("image", "png"),
        "1024x1024 JPEG": ("image", "jpeg"),
        "16x448x448 video": ("video", "mp4"),
    }
    requests = {}
    for name, (kind, fmt) in media.items():
        buffer = io.BytesIO()
        if kind == "image":
            image.save(buffer, fmt.upper())
        else:
            write_video(buffer, [make_image(448, 448, seed=i) for i in range(16)], fps=2)
        url = f"data:{kind}/{fmt};base64," + base64.b64encode(buffer.getvalue()).decode()
        part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
        requests[name] = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
    return requests


MEDIA_STAGES_MEASURED = ("fetch", "hash", "probe", "decode", "preprocess")


def media_seconds(processed: ProcessedInput) -> float:
    """The item's media time: the sum of its stages."""
    return sum(getattr(processed.mm_items[0].timings, stage) for stage in MEDIA_STAGES_MEASURED)


def media_stages(processed: ProcessedInput) -> str:
    timings = processed.mm_items[0].timings
    return " ".join(f"{stage} {getattr(timings, stage) * 1e3:.2f}" for stage in MEDIA_STAGES_MEASURED)


def run_pixel_free(repeats: int) -> None:
    """The decode server's media time per request against the full path's."""
    tokenizer = Tokenizer.from_pretrained(BUILTIN_MODEL)
    image_processor = ImageProcessor(
        ImageProcessorConfig(
            patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, min_pixels=65536, max_pixels=16777216
        )
    )
    video_processor = VideoProcessor(VideoProcessorConfig(min_pixels=4096, max_pixels=25165824))
    processors = {
        "full": MultimodalProcessor(tokenizer, image_processor, video_processor),
        "pixel-free": MultimodalProcessor(tokenizer, image_processor, video_processor, pixels=False),
    }
    print(f"ms per request, fastest of {repeats} (media: {' + '.join(MEDIA_STAGES_MEASURED)}; request: all of it)")
    print(f"{'':>17}   {'full: media':>11} {'request':>8} | {'pixel-free: media':>17} {'request':>8} | media ratio")
    for name, messages in pixel_free_requests().items():
        best = {label: (np.inf, processor.process_messages(messages)) for label, processor in processors.items()}
        expected, got = best["full"][1], best["pixel-free"][1]  # (the warm-up)
        if (got.input_ids, got.mm_items[0].grid_thw, got.mm_items[0].hash) != (
            expected.input_ids,
            expected.mm_items[0].grid_thw,
            expected.mm_items[0].hash,
        ):
            raise SystemExit(f"{name}: the pixel-free path's ids, grid or hash differ from the full path's")
        for _ in range(repeats):
            for label, processor in processors.items():
                start = time.perf_counter()
                processed = processor.process_messages(messages)
                seconds = time.perf_counter() - start
                if seconds < best[label][0]:
                    best[label] = (seconds, processed)
        (full_request, full), (free_request, free) = best["full"], best["pixel-free"]
        print(
            f"{name:>17}:  {media_seconds(full) * 1e3:11.2f} {full_request * 1e3:8.2f} | "
            f"{media_seconds(free) * 1e3:17.2f} {free_request * 1e3:8.2f} | "
            f"{media_seconds(full) / media_seconds(free):5.1f}x   (grid {got.mm_items[0].grid_thw}, ids identical)"
        )
        print(f"{'':>19}full: {media_stages(full)}\n{'':>19}pixel-free: {media_stages(free)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--pixel-free", action="store_true", help="the PD decode server's media time instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.pixel_free:
        run_pixel_free(args.repeats)
        return
    images = make_images(args.images)
    print(f"{len(images)} images, torch threads {args.threads}, fastest of {args.repeats} runs per image")
    for name in BUDGETS:
        run_budget(name, images, args.repeats)


if __name__ == "__main__":
    main()
