"""The decoder's row-wise Triton kernels (kernels/rowwise_triton.py) give what the module-by-module torch
operations give, which CUDA runs in their place: RMSNorm with and without the residual add, QK norm with the
rotary embedding, silu(gate) * up; float32 to summation order, bfloat16 equal but for a rare unit in the last
place (a float32 sum taken in another order that lands by a rounding boundary). Rows of any stride, widths
that are no power of two, no rows at all. Compiled on a GPU, else under Triton's interpreter on CPU (whose
bfloat16 casts truncate: there bfloat16 is held to two units in the last place only)."""

from __future__ import annotations

import pytest

from helpers import run_triton_script

pytestmark = pytest.mark.server  # every test here runs its kernels in a process of its own

pytest.importorskip("triton", reason="Triton is not installed (it comes with xgrammar)")

COMMON = """
import torch
import torch.nn.functional as F
from vlm_serve.llm.kernels import rowwise_triton
from vlm_serve.llm.layers.rotary import apply_rotary, rotate_half

torch.manual_seed(0)
EPS = 1e-6

def rms_norm(x, w):  # Qwen3's: in float32, scaled after casting back
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

def assert_same(got, want, rounded_to=None, scale=None):
    # rounded_to: the dtype the values went through; scale: of the terms summed last (where they cancel; there
    # on an H200 29% of bfloat16 q and k differed from torch's by a unit of the terms' last place or two, and
    # the model's logits matched transformers' as closely as before: so only the bound is held)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if (rounded_to or got.dtype) == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    error = (got.float() - want.float()).abs()
    ulp = (want.float().abs() if scale is None else scale.float()) * 2**-7 * (2 if torch.cuda.is_available() else 4)
    assert (error <= ulp + 1e-6).all(), (error - ulp).max()
    # (Triton's interpreter casts to bfloat16 by truncating, not to nearest)
    if torch.cuda.is_available() and scale is None and got.numel():
        assert (got != want).float().mean() < 0.01, (got != want).float().mean()

def wide(rows, n, dtype):  # rows of a wider tensor: row stride past the width
    return torch.randn(rows, n + 24).to(dtype)[:, 5 : 5 + n]
"""

NORMS = """
for dtype in (torch.float32, torch.bfloat16):
    for rows, n in ((1, 64), (7, 4096), (3, 100), (0, 64)):
        x, residual = torch.randn(rows, n).to(dtype), torch.randn(rows, n).to(dtype)
        w = (1 + 0.1 * torch.randn(n)).to(dtype)
        out, stream = rowwise_triton.rms_norm(x, w, EPS)
        assert stream is None
        assert_same(out, rms_norm(x, w))
        out, stream = rowwise_triton.rms_norm(x, w, EPS, residual)
        assert_same(stream, residual + x)
        assert_same(out, rms_norm(residual + x, w))
        strided = wide(rows, n, dtype)
        assert_same(rowwise_triton.rms_norm(strided, w, EPS)[0], rms_norm(strided, w))
    # a float32 weight with bfloat16 rows: torch's product is float32
    x, w = torch.randn(4, 96).bfloat16(), 1 + 0.1 * torch.randn(96)
    assert_same(rowwise_triton.rms_norm(x, w, EPS)[0], rms_norm(x, w), rounded_to=torch.bfloat16)
    # (tokens, heads, d): every head a row
    x, w = torch.randn(3, 4, 32).to(dtype), (1 + 0.1 * torch.randn(32)).to(dtype)
    assert_same(rowwise_triton.rms_norm(x, w, EPS)[0], rms_norm(x, w))
print("ok")
"""

QK = """
for dtype in (torch.float32, torch.bfloat16):
    for tokens, heads, kv_heads, d in ((1, 4, 2, 32), (6, 32, 8, 128), (3, 6, 2, 64), (0, 4, 2, 32)):
        qkv = wide(tokens, (heads + 2 * kv_heads) * d, dtype)
        wq, wk = (1 + 0.1 * torch.randn(d)).to(dtype), (1 + 0.1 * torch.randn(d)).to(dtype)
        angles = torch.rand(tokens, d // 2) * 40
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        q, k = rowwise_triton.qk_norm_rope(qkv, heads, kv_heads, wq, wk, EPS, cos, sin)
        assert rowwise_triton.qk_norm_rope_handles(qkv.cuda() if torch.cuda.is_available() else qkv, d, cos, sin) \\
            == torch.cuda.is_available()
        for got, first, count, w in ((q, 0, heads, wq), (k, heads, kv_heads, wk)):
            normed = rms_norm(qkv[:, first * d : (first + count) * d].reshape(tokens, count, d), w)
            scale = normed.abs() * cos.abs().unsqueeze(1) + rotate_half(normed).abs() * sin.abs().unsqueeze(1)
            assert_same(got, apply_rotary(normed, cos, sin), scale=scale)
print("ok")
"""

SILU = """
for dtype in (torch.float32, torch.bfloat16):
    for rows, n in ((1, 48), (5, 3000), (2, 12288), (0, 48)):
        x = 3 * torch.randn(rows, 2 * n).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        assert_same(rowwise_triton.silu_and_mul(x), F.silu(gate) * up)
        strided = wide(rows, 2 * n, dtype)
        gate, up = strided.chunk(2, dim=-1)
        assert_same(rowwise_triton.silu_and_mul(strided), F.silu(gate) * up)
print("ok")
"""


def test_rms_norm_with_and_without_the_residual_add_equals_torchs():
    run_triton_script(COMMON + NORMS)


def test_qk_norm_with_the_rotary_embedding_equals_torchs():
    run_triton_script(COMMON + QK)


def test_silu_and_mul_equals_torchs():
    run_triton_script(COMMON + SILU)
