"""Linear layers in float32 on the CPU keep their weights prepacked once loaded: in the C kernel's column
panels (linear_cpu.c) where the output width is a whole number of vectors, else in oneDNN's blocked
layout. Either way they compute what `F.linear` computes with the plain weights, on every ISA the kernel
is built for (cpu_targets.py), and the plain weights are not kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_serve.config import ModelConfig
from vlm_serve.llm.kernels import CACHE_ENV, linear_cpu
from vlm_serve.llm.layers.embedding import ParallelLMHead
from vlm_serve.llm.layers.linear import LinearBase, ReplicatedLinear, packable
from vlm_serve.vision import vision_tower
from vlm_serve.vision.vision_tower import load_vision_model

CPU = torch.device("cpu")


def linear(inp: int, out: int, bias: bool, dtype=torch.float32) -> tuple[ReplicatedLinear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(inp * out)
    layer = ReplicatedLinear(inp, out, bias).to(dtype)
    weight, b = torch.randn(out, inp, generator=g).to(dtype), torch.randn(out, generator=g).to(dtype)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.copy_(b)
    layer.prepack()
    return layer, weight, b if bias else None


@pytest.mark.parametrize("rows", [1, 5, 64, 130])
@pytest.mark.parametrize("panels", ["whole panels", "one vector wide"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_panels_compute_the_plain_product(rows, panels, bias, kernel_target):
    kernel = linear_cpu.LIBRARY.get()
    out = 3 * kernel.panel if panels == "whole panels" else kernel.panel + kernel.lanes
    layer, weight, b = linear(40, out, bias)
    assert layer.panels is not None and layer.packed is None and layer.weight.numel() == 0
    x = torch.randn(rows, 40)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_kernel_takes_batched_and_strided_inputs(kernel_target):
    layer, weight, _ = linear(32, 64, False)
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(layer(x), F.linear(x, weight))
    columns = torch.randn(9, 96)[:, 32:64]  # rows 96 floats apart
    torch.testing.assert_close(layer(columns), F.linear(columns, weight))


def test_widths_the_kernel_does_not_take_go_to_onednn():
    if not packable(torch.empty(0)):
        pytest.skip("no oneDNN in this torch build")
    layer, weight, b = linear(32, 42, True)  # (not a whole number of vectors on any ISA)
    assert layer.panels is None and layer.packed is not None and layer.weight.numel() == 0
    x = torch.randn(6, 32)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_without_a_c_compiler_float32_linears_go_to_onednn(monkeypatch, tmp_path):
    if not packable(torch.empty(0)):
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    layer, weight, _ = linear(32, 64, False)
    assert layer.panels is None and layer.packed is not None
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_bfloat16_keeps_its_plain_weights():
    layer, weight, _ = linear(32, 64, False, torch.bfloat16)
    assert layer.panels is None and layer.packed is None and torch.equal(layer.weight, weight)


def test_float32_cpu_tower_is_prepacked_and_encodes_as_the_plain_weights_do(tiny_moe_dir, monkeypatch):
    """(So the transformers parity tests exercise the prepacked path.)"""
    config = ModelConfig.from_pretrained(tiny_moe_dir)
    packed = load_vision_model(config, CPU, torch.float32)
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    if not packable(torch.empty(0)) and linear_cpu.LIBRARY.get() is None:
        pytest.skip("neither oneDNN nor a C compiler here")
    assert linears and all((m.panels is not None or m.packed is not None) and m.weight.numel() == 0 for m in linears)

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


def test_lm_head_reads_its_panels_and_keeps_the_weight_the_embedding_shares(kernel_target):
    head = ParallelLMHead(96, 32)
    head.weight.data.normal_(generator=torch.Generator().manual_seed(0))
    weight = head.weight.detach().clone()
    head.prepack()
    assert head.panels is not None and torch.equal(head.weight, weight)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), rtol=1e-5, atol=1e-5)
