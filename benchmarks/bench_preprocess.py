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

    python benchmarks/bench_preprocess.py [--images 200] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vlm_serve.vision.image_processor import ImageProcessor, ImageProcessorConfig

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images = make_images(args.images)
    print(f"{len(images)} images, torch threads {args.threads}, fastest of {args.repeats} runs per image")
    for name in BUDGETS:
        run_budget(name, images, args.repeats)


if __name__ == "__main__":
    main()
