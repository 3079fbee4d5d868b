"""The CUDA GEMMs of kernels/gemm_triton.py: of block-scaled FP8 weights, the product of the activations
and the dequantized weights; grouped by expert, each expert's rows times its weights. On a GPU the kernel runs compiled; elsewhere Triton's interpreter
runs it on CPU (it checks the arithmetic, masks and scale indexing, not the speed). Each check is a script
run in a subprocess, since Triton reads TRITON_INTERPRET when a kernel is defined."""

from __future__ import annotations

import pytest

from helpers import run_triton_script

pytestmark = pytest.mark.server  # every test here runs its kernel in a process of its own

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")

# what the scripts share: a TP shard of an FP8 weight, as `LinearBase` keeps it
SHARD = """
import torch
from vlm_serve.quantization import dequantize_rows, quantize_fp8_blocks, shard_scales

def fp8_shard(n, k, row0, col0):
    \"\"\"Rows row0 ... + n and columns col0 ... + k of a random FP8 weight: (weight, row scales, offset).\"\"\"
    quantized, scale_inv = quantize_fp8_blocks(torch.randn(row0 + n + 5, col0 + k + 7))
    scales, offset = shard_scales(scale_inv, (128, 128), (row0, n), (col0, k))
    return quantized[row0 : row0 + n, col0 : col0 + k].contiguous(), scales, offset

torch.manual_seed(0)
"""


def run_kernel_script(script: str) -> None:
    """On a GPU `tl.dot` multiplies float32 in TF32 (10-bit mantissas), hence the wider tolerance there."""
    run_triton_script(
        SHARD + script, on_gpu="TOL = dict(rtol=1e-2, atol=5e-2)\n", on_cpu="TOL = dict(rtol=1e-4, atol=1e-4)\n"
    )


CHECK = """
from vlm_serve.llm.kernels.gemm_triton import fp8_linear

for rows, n, k, row0, col0, bias in [(1, 64, 128, 0, 0, False), (5, 96, 200, 64, 32, True), (33, 130, 70, 3, 100, True)]:
    weight, scales, offset = fp8_shard(n, k, row0, col0)
    x = torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    expected = torch.nn.functional.linear(x, dequantize_rows(weight, scales, 128, offset, torch.float32), b)
    got = fp8_linear(x, weight, scales, 128, offset, b)
    assert got.shape == expected.shape, (rows, n, k)
    assert torch.allclose(got, expected, **TOL), (rows, n, k, (got - expected).abs().max())
print("ok")
"""


def test_the_triton_fp8_gemm_equals_the_product_with_dequantized_weights():
    run_kernel_script(CHECK)


GROUPED = """
from vlm_serve.llm.kernels.gemm_triton import fp8_grouped_linear

experts, n, k = 5, 96, 200
shards = [fp8_shard(n, k, 0, 64) for _ in range(experts)]  # (each starts 64 columns into a scale block)
weights, scales, offset = torch.stack([s[0] for s in shards]), torch.stack([s[1] for s in shards]), shards[0][2]
for counts in ([3, 0, 17, 1, 0], [0, 0, 0, 0, 2], [40, 1, 0, 0, 0]):
    rows = sum(counts) + 3  # (3 rows routed to other ranks' experts, after the groups: left unwritten)
    xs = torch.randn(rows, k)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = fp8_grouped_linear(xs, weights, scales, ends, 128, offset)
    start = 0
    for e, count in enumerate(counts):
        expected = xs[start : start + count] @ dequantize_rows(weights[e], scales[e], 128, offset, torch.float32).T
        assert torch.allclose(got[start : start + count], expected, **TOL), (counts, e)
        start += count
print("ok")
"""


def test_the_grouped_fp8_gemm_multiplies_each_experts_rows_by_that_expert():
    run_kernel_script(GROUPED)


GROUPED_HALF = """
from vlm_serve.llm.kernels.gemm_triton import grouped_linear

experts, n, k = 5, 96, 200
weights = torch.randn(experts, n, k).to(DTYPE)
for counts in ([1, 0, 1, 1, 0], [0, 0, 0, 0, 2], [40, 1, 0, 0, 17]):
    rows = sum(counts) + 3  # (3 rows routed to other ranks' experts, after the groups: left unwritten)
    xs = torch.randn(rows, k).to(DTYPE)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = grouped_linear(xs, weights, ends)
    start = 0
    for e, count in enumerate(counts):
        expected = xs[start : start + count].float() @ weights[e].float().T
        assert torch.allclose(got[start : start + count].float(), expected, **HALF_TOL), (counts, e)
        start += count
print("ok")
"""


def test_the_grouped_gemm_of_half_precision_experts_multiplies_each_experts_rows_by_that_expert():
    """(Decode's shape first: one row for each of several experts.)"""
    run_triton_script(
        SHARD + GROUPED_HALF,
        on_gpu="DTYPE = torch.bfloat16\nHALF_TOL = dict(rtol=2e-2, atol=1e-1)\n",
        on_cpu="import torch\nDTYPE = torch.float32\nHALF_TOL = dict(rtol=1e-4, atol=1e-4)\n",
    )


MOE = """
from vlm_serve.llm.kernels import gemm_triton
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.quantization import Fp8Config, row_scales

experts, hidden, inter = 16, 64, 160  # (the down projection's input spans two scale blocks)
moe = SparseMoeBlock(hidden, inter, experts, 4)
moe.gate.weight.data = torch.randn(experts, hidden) * 0.3
fp8 = [quantize_fp8_blocks(torch.randn(2 * inter, hidden) * hidden**-0.5) for _ in range(experts)]
fp8_down = [quantize_fp8_blocks(torch.randn(hidden, inter) * inter**-0.5) for _ in range(experts)]
moe.fp8 = Fp8Config()
moe.w13 = torch.nn.Parameter(torch.stack([w for w, _ in fp8]), requires_grad=False)
moe.w2 = torch.nn.Parameter(torch.stack([w for w, _ in fp8_down]), requires_grad=False)
moe.w13_scale = torch.stack([row_scales(s, 2 * inter) for _, s in fp8])
moe.w2_scale = torch.stack([row_scales(s, hidden) for _, s in fp8_down])
x = torch.randn(9, hidden)
loop, grouped_gemm = moe._expert_loop, moe._grouped_mm
moe._expert_loop = moe._grouped_mm = loop  # (not prepacked: each expert dequantized, a matmul each)
looped = moe(x)
moe._expert_loop = moe._grouped_mm = grouped_gemm
calls = []
gemm_triton.fp8_grouped_linear = lambda *args, gemm=gemm_triton.fp8_grouped_linear: calls.append(1) or gemm(*args)
grouped = moe(x)
assert len(calls) == 2, calls  # gate_up, then down
assert torch.allclose(grouped, looped, **TOL), (grouped - looped).abs().max()
print("ok")
"""


@pytest.mark.slow
def test_fp8_experts_on_cuda_take_the_grouped_fp8_gemm_each_way():
    run_kernel_script(MOE)


# integer weights as `layers.quantized.IntWeight` holds them
INTEGERS = """
from vlm_serve.quantization.int_packing import dequantize, pack_nibbles
from vlm_serve.llm.layers.quantized import quantize_per_token

def integers(stack, n, k, bits, group, symmetric):
    groups = 1 if group is None else -(-k // group)
    codes = torch.randint(0, 1 << bits, (*stack, n, k), dtype=torch.uint8)
    scale = torch.rand(*stack, n, groups) * 0.05
    zero = None if symmetric else torch.randint(0, 1 << bits, (*stack, n, groups)).to(torch.int16)
    packed = pack_nibbles(codes) if bits == 4 else codes
    real = dequantize(codes, scale, (1 << (bits - 1)) if zero is None else zero, group)
    return packed, scale, zero, real
"""

INT_CHECK = """
from vlm_serve.llm.kernels.gemm_triton import int_linear

for bits, group, symmetric, i8 in [(4, 32, True, False), (4, 64, False, False), (4, None, True, False),
                                   (8, 32, False, False), (8, None, True, False), (8, None, True, True)]:
    for rows, n, k, bias in [(1, 64, 128, False), (5, 96, 192, True), (33, 130, 64, True)]:
        codes, scale, zero, real = integers((), n, k, bits, group, symmetric)
        x = torch.randn(rows, k)
        b = torch.randn(n) if bias else None
        expected = torch.nn.functional.linear(quantize_per_token(x) if i8 else x, real, b)
        got = int_linear(x, codes, scale, zero, bits, group, i8, b)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, **TOL), (bits, group, symmetric, i8, rows, (got - expected).abs().max())
print("ok")
"""


def test_the_triton_integer_gemm_equals_the_product_with_dequantized_weights():
    """W4A16 and W8A16 (groups and per channel, symmetric or with zero points), and W8A8 (int8 dot products
    of x rounded per row)."""
    run_kernel_script(INTEGERS + INT_CHECK)


INT_GROUPED = """
from vlm_serve.llm.kernels.gemm_triton import int_grouped_linear

experts, n, k = 5, 96, 128
for bits, group, symmetric, i8 in [(4, 32, False, False), (8, None, True, True)]:
    codes, scale, zero, real = integers((experts,), n, k, bits, group, symmetric)
    for counts in ([3, 0, 17, 1, 0], [0, 0, 0, 0, 2]):
        rows = sum(counts) + 3  # (rows routed to other ranks' experts: left unwritten)
        xs = torch.randn(rows, k)
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        got = int_grouped_linear(xs, codes, scale, zero, bits, group, ends, i8)
        start = 0
        for e, count in enumerate(counts):
            inputs = xs[start : start + count]
            expected = (quantize_per_token(inputs) if i8 else inputs) @ real[e].T
            assert torch.allclose(got[start : start + count], expected, **TOL), (bits, counts, e)
            start += count
print("ok")
"""


def test_the_grouped_integer_gemm_multiplies_each_experts_rows_by_that_expert():
    run_kernel_script(INTEGERS + INT_GROUPED)


INT_MOE = """
from vlm_serve.llm.kernels import gemm_triton
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.layers.quantized import IntWeight
from vlm_serve.quantization import IntScheme

experts, hidden, inter = 16, 64, 96
calls = []
gemm_triton.int_grouped_linear = lambda *a, gemm=gemm_triton.int_grouped_linear: calls.append(1) or gemm(*a)
for scheme in (IntScheme(4, 32, False), IntScheme(8, None, True, int8_activations=True)):
    moe = SparseMoeBlock(hidden, inter, experts, 4)
    moe.gate.weight.data = torch.randn(experts, hidden) * 0.3
    c13, s13, z13, _ = integers((experts,), 2 * inter, hidden, scheme.bits, scheme.group_size, scheme.symmetric)
    c2, s2, z2, _ = integers((experts,), hidden, inter, scheme.bits, scheme.group_size, scheme.symmetric)
    moe.w13_int, moe.w2_int = IntWeight(scheme, c13, s13 * 0.5, z13), IntWeight(scheme, c2, s2 * 0.5, z2)
    x = torch.randn(9, hidden)
    loop, grouped_gemm = moe._expert_loop, moe._grouped_mm
    moe._expert_loop = moe._grouped_mm = loop  # (each expert dequantized, a matmul each)
    looped = moe(x)
    moe._expert_loop = moe._grouped_mm = grouped_gemm
    calls.clear()
    grouped = moe(x)
    assert len(calls) == 2, calls  # gate_up, then down
    assert torch.allclose(grouped, looped, **TOL), (scheme, (grouped - looped).abs().max())
print("ok")
"""


@pytest.mark.slow
def test_integer_experts_on_cuda_take_the_grouped_integer_gemm_each_way():
    """(W8A8's experts round each product's input to int8 per row either way.)"""
    run_kernel_script(INTEGERS + INT_MOE)
