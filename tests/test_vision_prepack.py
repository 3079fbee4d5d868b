"""The vision tower loaded in float32 on the CPU runs its linears on oneDNN-prepacked weights (so the
transformers parity tests exercise that path), with the embeddings the plain weights give."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.linear import LinearBase, packable
from vlm_serve.vision import vision_tower
from vlm_serve.vision.vision_tower import load_vision_model

CPU = torch.device("cpu")


def test_float32_cpu_tower_is_prepacked_and_encodes_as_the_plain_weights_do(tiny_moe_dir, monkeypatch):
    if not packable(torch.empty(0)):
        pytest.skip("no oneDNN in this torch build")
    config = ModelConfig.from_pretrained(tiny_moe_dir)
    packed = load_vision_model(config, CPU, torch.float32)
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    half = load_vision_model(config, CPU, torch.bfloat16)
    assert all(m.packed is None for m in half.modules() if isinstance(m, LinearBase))

    monkeypatch.setattr(vision_tower, "prepack_weights", lambda model: None)
    plain = load_vision_model(config, CPU, torch.float32)
    vision = config.vision
    grids = [(2, 4, 6), (1, 8, 4)]
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(rows, vision.in_channels * vision.temporal_patch_size * vision.patch_size**2)
    with torch.no_grad():
        ours, ref = packed(pixels, grids), plain(pixels, grids)
    for a, b in zip([ours.embeds, *ours.deepstack], [ref.embeds, *ref.deepstack], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
