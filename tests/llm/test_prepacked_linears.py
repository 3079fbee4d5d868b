"""Linear layers on the CPU keep their weights prepacked once loaded: in the C kernel's column panels
(linear_cpu.c) where the output width is a whole number of vectors, in the weights' own format (float32,
bfloat16, float16, FP8 e4m3 with block scales), else (float32) in oneDNN's blocked layout. Either way they
compute what `F.linear` computes with the plain (dequantized) weights in float32, on every ISA the kernel
is built for (cpu_targets.py), and the plain weights are not kept. FP8 weights come as the published
checkpoints hold them, tensor-parallel shards cut inside their 128 x 128 scale blocks included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_serve.config import ModelConfig
from vlm_serve.llm.kernels import CACHE_ENV, linear_cpu
from vlm_serve.llm.layers.embedding import ParallelLMHead
from vlm_serve.llm.layers.linear import LinearBase, ReplicatedLinear, packable
from vlm_serve.llm.models import loader
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.quantization import row_scales, shard_scale
from weight_formats import E4M3, as_multiplied, dequantize, every_value, quantize_fp8, within_bfloat16_rounding

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


def test_a_width_not_of_whole_vectors_gets_zero_rows_and_each_row_its_own_answer(native_kernels):
    """(A router of 8 experts. oneDNN, which took these before, gives a row other bits in another batch:
    a seeded answer then changed with a prefix-cache hit.)"""
    layer, weight, b = linear(32, 42, True)  # (not a whole number of vectors on any ISA)
    assert layer.panels is not None and layer.panels.features == 42 and layer.weight.numel() == 0
    x = torch.randn(6, 32)
    y = layer(x)
    assert y.shape == (6, 42)
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(layer(x[i : i + 1]), y[i : i + 1]) for i in range(6))


def test_without_a_c_compiler_float32_linears_go_to_onednn(monkeypatch, tmp_path):
    if not packable(torch.empty(0)):
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    layer, weight, _ = linear(32, 64, False)
    assert layer.panels is None and layer.packed is not None
    x = torch.randn(4, 32)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_layers_read_their_weights_as_stored(dtype, kernel_target):
    layer, weight, b = linear(40, 64, True, dtype)
    assert layer.panels is not None and layer.panels.weight.dtype == dtype and layer.weight.numel() == 0
    x = torch.randn(5, 40).to(dtype)
    y = layer(x)  # (summed in float32, returned in x's dtype)
    assert y.dtype == dtype
    torch.testing.assert_close(y, F.linear(x.float(), weight.float(), b.float()).to(dtype))


LOW_PRECISION = [torch.bfloat16, torch.float16, E4M3]


def in_format(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float32 weight in `dtype`, and its block scales (FP8, 128 x 128 blocks, the last ones partial)."""
    return quantize_fp8(weight) if dtype == E4M3 else (weight.to(dtype), None)


def float32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, exactly (float64) then rounded: what a float32 sum must come within rounding of."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("rows", [1, 6, 7, 70])
@pytest.mark.parametrize("panels", ["whole panels", "one vector wide"])
@pytest.mark.parametrize("bias", [False, True])
def test_low_precision_panels_compute_the_dequantized_product(dtype, rows, panels, bias, kernel_target):
    """(Rows up to a tile read the panels as stored, more widen them once; `in` odd, past the widening's
    256-row chunks and the bfloat16 dot products' 256-row rounding of x, FP8's last scale block partial.)
    bfloat16 panels on AVX-512-BF16 multiply x rounded to bfloat16 (`as_multiplied`), so their products
    are also within that rounding of float32 x's, what the other ISAs compute."""
    kernel = linear_cpu.LIBRARY.get()
    out, inp = (3 * kernel.panel if panels == "whole panels" else kernel.panel + kernel.lanes), 301
    g = torch.Generator().manual_seed(rows)
    weight, scale = in_format(torch.randn(out, inp, generator=g), dtype)
    packed = linear_cpu.pack(weight, scale)
    assert packed is not None and packed.weight.dtype == dtype
    x, b = torch.randn(rows, inp, generator=g), torch.randn(out, generator=g) if bias else None
    y = linear_cpu.linear(x, packed, b)
    expected = float32_product(as_multiplied(x, dtype, kernel), dequantize(weight, scale), b)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    within_bfloat16_rounding(y - (0 if b is None else b), x, dequantize(weight, scale))


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_every_value_of_a_format_is_read_exactly(dtype, kernel_target):
    """Subnormals, both zeros and the extremes too: one-hot rows of x pick single weights, so the product
    is each weight (times its block scale) exactly, by a tile that reads the panel as stored (4 rows) and
    by the widening one (all rows). (AVX-512-BF16's dot products read bfloat16 subnormals as zero.)"""
    kernel = linear_cpu.LIBRARY.get()
    g = torch.Generator().manual_seed(0)
    weight = every_value(dtype, kernel.panel, 256, g)
    scale = torch.tensor([[2.0**-9, 3.0]]) if dtype == E4M3 else None  # (exact products with e4m3's 4 bits)
    packed = linear_cpu.pack(weight, scale)
    one_hot = torch.eye(256)
    expected = dequantize(weight, scale).T
    if dtype == torch.bfloat16 and kernel.bf16_dot:
        expected = torch.where(expected.abs() < torch.finfo(torch.bfloat16).tiny, 0.0, expected)
    assert torch.equal(
        torch.cat([linear_cpu.linear(one_hot[r : r + 4], packed, None) for r in range(0, 256, 4)]), expected
    )
    assert torch.equal(linear_cpu.linear(one_hot, packed, None), expected)


def checkpoint_fp8(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_column_parallel_shards_start_inside_scale_blocks(rows, kernel_target):
    """Output rows split over ranks as the published models are cut: 384 rows (3 blocks) over 2 ranks,
    rank 1's rows 192 ... 383 starting at row 64 of block 1; `in` 300, its last block partial."""
    weight, scale = checkpoint_fp8(384, 300, 0)
    full = dequantize(weight, scale)
    x = torch.randn(rows, 300)
    for r0 in (0, 192):
        cut, offset = shard_scale(scale, (r0, r0 + 192), (0, 300))
        assert offset == (r0 % 128, 0)
        packed = linear_cpu.pack(weight[r0 : r0 + 192], cut, offset=offset)
        expected = float32_product(x, full[r0 : r0 + 192])
        torch.testing.assert_close(linear_cpu.linear(x, packed, None), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_row_parallel_shards_start_inside_scale_blocks(rows, kernel_target):
    """Input columns split over 3 ranks, 101 each: shards start at column 101 (of block 0) and 74 of
    block 1, none on a group of 4 (the panels' zero rows in front); their products add up to the whole."""
    kernel = linear_cpu.LIBRARY.get()
    weight, scale = checkpoint_fp8(2 * kernel.panel, 303, 1)
    full = dequantize(weight, scale)
    x = torch.randn(rows, 303)
    parts = []
    for c0 in (0, 101, 202):
        cut, offset = shard_scale(scale, (0, 2 * kernel.panel), (c0, c0 + 101))
        packed = linear_cpu.pack(weight[:, c0 : c0 + 101], cut, offset=offset)
        assert packed.layout.lead == -(128 - c0 % 128) % 4
        parts.append(linear_cpu.linear(x[:, c0 : c0 + 101], packed, None))
        expected = float32_product(x[:, c0 : c0 + 101], full[:, c0 : c0 + 101])
        torch.testing.assert_close(parts[-1], expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sum(parts), float32_product(x, full), rtol=1e-5, atol=1e-4)


def test_fp8_shards_side_by_side_give_their_scales_per_row(kernel_target):
    """As q, k and v (or gate and up) fused in one weight: each shard's scales over its rows."""
    kernel = linear_cpu.LIBRARY.get()
    rows = 2 * kernel.panel  # each tensor's rank-1 shard: rows `rows` ... 2 * rows - 1
    (wq, sq), (wk, sk) = checkpoint_fp8(4 * rows, 200, 2), checkpoint_fp8(3 * rows, 200, 3)
    fused, per_row, plain = [], [], []
    for weight, scale in [(wq, sq), (wk, sk)]:
        cut, offset = shard_scale(scale, (rows, 2 * rows), (0, 200))
        fused.append(weight[rows : 2 * rows])
        per_row.append(row_scales(cut, rows, 128, offset[0]))
        plain.append(dequantize(weight, scale)[rows : 2 * rows])
    packed = linear_cpu.pack(torch.cat(fused), torch.cat(per_row), block=(1, 128))
    x = torch.randn(3, 200)
    expected = float32_product(x, torch.cat(plain))
    torch.testing.assert_close(linear_cpu.linear(x, packed, None), expected, rtol=1e-5, atol=1e-4)


def test_fp8_without_scales_is_scale_one_and_scales_must_fit(native_kernels):
    weight = every_value(E4M3, 32, 256, torch.Generator().manual_seed(0))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    # float32 sums of terms up to 448 x |x| in another order: rounding relative to the terms' magnitude
    magnitude = (x.abs() @ weight.float().abs().T).max().item()
    torch.testing.assert_close(
        linear_cpu.linear(x, linear_cpu.pack(weight), None),
        float32_product(x, weight.float()),
        rtol=1e-5,
        atol=1e-6 * magnitude,
    )
    with pytest.raises(ValueError, match=r"expected \(1, 3\)"):
        linear_cpu.pack(weight, torch.ones(1, 2), offset=(0, 100))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        linear_cpu.pack(weight.float(), torch.ones(1, 2))
    # panels whose columns do not share their scales: the kernel cannot take them
    assert linear_cpu.pack(weight, torch.arange(1.0, 33.0)[:, None].expand(32, 2), block=(1, 128)) is None


def test_float32_cpu_tower_is_prepacked_and_encodes_as_the_plain_weights_do(tiny_moe_dir, monkeypatch):
    """(So the transformers parity tests exercise the prepacked path.)"""
    config = ModelConfig.from_pretrained(tiny_moe_dir)
    packed = load_vision_model(config, CPU, torch.float32)
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    if not packable(torch.empty(0)) and linear_cpu.LIBRARY.get() is None:
        pytest.skip("neither oneDNN nor a C compiler here")
    assert linears and all((m.panels is not None or m.packed is not None) and m.weight.numel() == 0 for m in linears)

    monkeypatch.setattr(loader, "prepack_weights", lambda model: None)
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
