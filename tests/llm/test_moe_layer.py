"""The sparse MoE block at Qwen3-VL-235B's routing shape (128 experts, top-8, normalized top-k weights):
each token's output is the weighted sum of its experts' SwiGLU MLPs, whichever way the experts run (the
C kernel, on every ISA it is built for (cpu_targets.py), with the weights in float32, bfloat16, float16
or FP8 e4m3 with block scales (tensor-parallel shards of the published checkpoints' experts); or a loop
of per-expert matmuls on CPU, grouped GEMMs on CUDA), and expert-parallel ranks' parts add up to the
whole."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from vlm_serve.llm.kernels import CACHE_ENV, Target, build, moe_cpu
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.quantization import row_scales, shard_scale
from weight_formats import E4M3, as_multiplied, dequantize, quantize_fp8

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 64, 32


def block(start: int = 0, count: int = EXPERTS, source: SparseMoeBlock | None = None) -> SparseMoeBlock:
    """A block holding experts `start ... start + count` (an EP rank's share), random or `source`'s."""
    moe = SparseMoeBlock(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K)
    generator = torch.Generator().manual_seed(0)
    if source is None:
        moe.gate.weight.data = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.2
        moe.w13.data = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * HIDDEN**-0.5
        moe.w2.data = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * INTERMEDIATE**-0.5
        return moe
    moe.gate.weight.data = source.gate.weight.data
    moe.num_local_experts, moe.expert_start = count, start
    moe.w13 = torch.nn.Parameter(source.w13.data[start : start + count], requires_grad=False)
    moe.w2 = torch.nn.Parameter(source.w2.data[start : start + count], requires_grad=False)
    return moe


def reference(moe: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, as the model card defines the block."""
    return experts_reference(x, x @ moe.gate.weight.T, moe.w13, moe.w2)


def experts_reference(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, read: Callable = lambda t: t
) -> torch.Tensor:
    """(Equal logits, as bfloat16 ones often are: the lower-numbered expert first, as the kernel takes them.)
    `read`: what the product's inputs (x, then silu(gate) * up) are as the weights multiply them."""
    probs = F.softmax(logits, dim=-1)
    weights, experts = (t[:, :TOP_K] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist()):
            gate, up = (w13[e] @ read(x[t])).chunk(2)
            out[t] += w * (w2[e] @ read(F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_every_token_gets_the_weighted_sum_of_its_top_k_experts(tokens):
    moe = block()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-4, atol=1e-5)


def test_grouped_gemms_compute_what_the_expert_loop_does(monkeypatch):
    """The CUDA path's arithmetic (torch's grouped GEMM runs on CPU too, slowly)."""
    moe = block()
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    looped = moe(x)
    monkeypatch.setattr(moe, "_expert_loop", moe._grouped_mm)
    torch.testing.assert_close(moe(x), looped, rtol=1e-4, atol=1e-5)
    halves = block(0, EXPERTS // 2, moe)  # with pairs routed to another rank's experts
    monkeypatch.setattr(halves, "_expert_loop", halves._grouped_mm)
    torch.testing.assert_close(halves(x) + block(EXPERTS // 2, EXPERTS // 2, moe)(x), looped, rtol=1e-4, atol=1e-5)


def test_expert_parallel_ranks_parts_add_up_to_the_whole():
    moe = block()
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(2))
    quarters = [block(start, EXPERTS // 4, moe)(x) for start in range(0, EXPERTS, EXPERTS // 4)]
    torch.testing.assert_close(sum(quarters), moe(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("panels", ["whole panels", "one vector wide"])  # gate/up columns
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_cpu_kernel_routes_and_computes_what_the_expert_loop_does(tokens, panels, norm_topk_prob, kernel_target):
    kernel = moe_cpu.LIBRARY.get()
    intermediate = kernel.panel if panels == "whole panels" else (kernel.panel + kernel.lanes) // 2
    moe = SparseMoeBlock(HIDDEN, intermediate, EXPERTS, TOP_K, norm_topk_prob)
    generator = torch.Generator().manual_seed(tokens)
    moe.gate.weight.data = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.2
    moe.w13.data = torch.randn(EXPERTS, 2 * intermediate, HIDDEN, generator=generator) * HIDDEN**-0.5
    moe.w2.data = torch.randn(EXPERTS, HIDDEN, intermediate, generator=generator) * intermediate**-0.5
    x = torch.randn(tokens, HIDDEN, generator=generator)
    looped = moe(x)
    moe.prepack()
    assert moe.packed is not None
    torch.testing.assert_close(moe(x), looped, rtol=1e-4, atol=1e-5)


def tp_shard_experts(dtype: torch.dtype, intermediate: int, generator: torch.Generator) -> tuple:
    """Rank 1's shard at TP 4 of experts whose full intermediate size is 4 * `intermediate`, as the
    published checkpoints hold them (gate, up and down each in `dtype`, FP8 with 128 x 128 block scales):
    gate and up rows and down columns `intermediate` ... 2 * `intermediate` - 1, which start inside a
    scale block. Returns pack_experts' arguments and the shard's float32 w13 and w2."""
    full, rows = 4 * intermediate, (intermediate, 2 * intermediate)
    weights = [
        torch.randn(EXPERTS, *shape, generator=generator) * shape[1] ** -0.5
        for shape in [(full, HIDDEN), (full, HIDDEN), (HIDDEN, full)]
    ]
    if dtype != E4M3:
        gate, up, down = (w.to(dtype) for w in weights)
        w13, w2 = torch.cat([gate[:, slice(*rows)], up[:, slice(*rows)]], 1), down[:, :, slice(*rows)].contiguous()
        return (w13, w2), {}, w13.float(), w2.float()
    (gate, gs), (up, us), (down, ds) = (quantize_fp8(w) for w in weights)
    per_row = []
    for scale in (gs, us):  # gate and up side by side: their scales per row
        cut, offset = shard_scale(scale, rows, (0, HIDDEN))
        per_row.append(row_scales(cut, intermediate, 128, offset[0]))
    scale2, offset2 = shard_scale(ds, (0, HIDDEN), rows)
    w13 = torch.cat([gate[:, slice(*rows)], up[:, slice(*rows)]], 1)
    args = (w13, down[:, :, slice(*rows)].contiguous(), torch.cat(per_row, 1), scale2)
    plain13 = torch.cat([dequantize(gate, gs)[:, slice(*rows)], dequantize(up, us)[:, slice(*rows)]], 1)
    return args, {"block13": (1, 128), "offset2": offset2}, plain13, dequantize(down, ds)[:, :, slice(*rows)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, E4M3], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_the_cpu_kernel_reads_experts_in_their_format(dtype, tokens, kernel_target):
    """(1 and 3 tokens: an expert's few rows read the panels as stored; 300: some 19 rows an expert, which
    widen float16 and FP8 panels to float32 once for all their tiles.)"""
    kernel = moe_cpu.LIBRARY.get()
    generator = torch.Generator().manual_seed(tokens)
    args, options, w13, w2 = tp_shard_experts(dtype, kernel.panel, generator)
    packed = moe_cpu.pack_experts(*args, **options)
    assert packed is not None and packed.w13.dtype == packed.w2.dtype == dtype
    if dtype == E4M3:
        assert options["offset2"] == (0, kernel.panel % 128) and packed.layout2.first == 128 - kernel.panel % 128
    x, logits = torch.randn(tokens, HIDDEN, generator=generator), torch.randn(tokens, EXPERTS, generator=generator)
    y = moe_cpu.moe_forward(x, logits, TOP_K, True, 0, packed)
    read = lambda t: as_multiplied(t, dtype, kernel)  # noqa: E731
    expected = experts_reference(x.double(), logits.double(), w13.double(), w2.double(), read).float()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_block_reads_its_experts_as_stored(kernel_target):
    moe = block().to(torch.bfloat16)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    w13, w2 = moe.w13.float(), moe.w2.float()
    moe.prepack()
    assert moe.packed is not None and moe.packed.w13.dtype == torch.bfloat16
    y = moe(x)
    assert y.dtype == torch.bfloat16
    read = lambda t: as_multiplied(t, torch.bfloat16, moe.packed.kernel)  # noqa: E731
    expected = experts_reference(x.float(), moe.gate(x).float(), w13, w2, read)  # (the block's own routing)
    torch.testing.assert_close(y, expected.to(torch.bfloat16))


def test_the_cpu_kernel_leaves_pairs_of_other_ranks_experts_out(kernel_target):
    moe = block()
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))
    whole = moe(x)
    halves = [block(start, EXPERTS // 2, moe) for start in (0, EXPERTS // 2)]
    for half in halves:
        half.prepack()
    assert halves[0].packed is not None
    torch.testing.assert_close(halves[0](x) + halves[1](x), whole, rtol=1e-4, atol=1e-5)


def test_without_a_c_compiler_the_experts_run_through_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    moe = block()
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(5))
    moe.prepack()
    assert moe.packed is None
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-4, atol=1e-5)


def test_a_broken_kernel_in_the_cache_falls_back_to_torch(monkeypatch, tmp_path, native_kernels):
    built = build("moe_cpu", Target.from_env())  # this machine's library, named by what it was built from
    broken = tmp_path / "broken"  # (another path: the good one stays loaded in this process)
    broken.mkdir()
    (broken / built.name).write_bytes(b"not a shared library")
    monkeypatch.setenv(CACHE_ENV, str(broken))
    assert moe_cpu.LIBRARY.get() is None
