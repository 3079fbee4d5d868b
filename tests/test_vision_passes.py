"""The vision tower encodes long videos in bounded passes with the same embeddings as one pass."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image, make_video


@pytest.fixture(scope="module")
def items(tiny_moe_dir, tmp_path_factory):
    engine = Engine(tiny_moe_dir, dtype="float32")
    video = make_video(tmp_path_factory.mktemp("v") / "long.mp4", num_frames=48, fps=8, size=(64, 96))
    content = [
        {"type": "image", "image": make_image(96, 64, seed=1)},
        {"type": "video", "video": str(video)},
        {"type": "image", "image": make_image(64, 160, seed=2)},
        {"type": "text", "text": "Describe."},
    ]
    x = engine.processor.process_messages([{"role": "user", "content": content}])
    return engine.scheduler.runner.model.visual, x.mm_items


@pytest.mark.parametrize("max_patches", [1, 24, 50, 200])
def test_passes_give_the_embeddings_of_one_pass(items, max_patches):
    visual, mm_items = items
    pixels = torch.cat([it.pixel_values for it in mm_items])
    grids = [it.grid_thw for it in mm_items]
    assert any(t > 2 for t, _, _ in grids)  # a video of several temporal groups
    seen: list[int] = []
    hook = visual.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    with torch.no_grad():
        whole = visual(pixels, grids)
        seen.clear()
        parts = visual.encode(pixels, grids, max_patches)
    hook.remove()
    for a, b in zip([parts.embeds, *parts.deepstack], [whole.embeds, *whole.deepstack]):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    # every pass stays within the budget unless one temporal group alone is larger
    largest_group = max(h * w for _, h, w in grids)
    assert all(n <= max(max_patches, largest_group) for n in seen)
    assert len(seen) > 1
