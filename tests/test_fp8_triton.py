"""The CUDA GEMM of block-scaled FP8 weights (kernels/fp8_triton.py) computes the product of the
activations and the dequantized weights. No GPU is needed: Triton's interpreter runs the kernel on CPU
(it checks the arithmetic, masks and scale indexing, not the speed), in a subprocess since Triton reads
TRITON_INTERPRET when a kernel is defined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")

CHECK = """
import torch
from vlm_serve.llm.kernels.fp8_triton import fp8_linear
from vlm_serve.quantization import dequantize_rows, quantize_fp8_blocks, shard_scales

torch.manual_seed(0)
for rows, n, k, row0, col0, bias in [(1, 64, 128, 0, 0, False), (5, 96, 200, 64, 32, True), (33, 130, 70, 3, 100, True)]:
    full = torch.randn(row0 + n + 5, col0 + k + 7)
    quantized, scale_inv = quantize_fp8_blocks(full)
    weight = quantized[row0 : row0 + n, col0 : col0 + k].contiguous()
    scales, offset = shard_scales(scale_inv, (128, 128), (row0, n), (col0, k))
    x = torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    expected = torch.nn.functional.linear(x, dequantize_rows(weight, scales, 128, offset, torch.float32), b)
    got = fp8_linear(x, weight, scales, 128, offset, b)
    assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (rows, n, k, (got - expected).abs().max())
print("ok")
"""


def test_the_triton_fp8_gemm_equals_the_product_with_dequantized_weights():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
