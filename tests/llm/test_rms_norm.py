"""The decoder layer's row-by-row ops compute what their torch formulas compute, through the C kernel on
float32 CPU tensors (RMSNorm reads q and k in place, as head-by-head views inside the qkv output), on
every ISA the kernel is built for (cpu_targets.py), and through torch elsewhere: RMSNorm, RMSNorm
followed by the rotary embedding, SiLU-and-multiply, and the vision tower's rotary embedding."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.llm.kernels import rowwise_cpu
from vlm_serve.llm.layers.activation import silu_and_mul
from vlm_serve.llm.layers.norm import RMSNorm, qkv_heads
from vlm_serve.llm.layers.rotary import apply_rotary


def formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def norm(n: int) -> RMSNorm:
    layer = RMSNorm(n, eps=1e-6)
    layer.weight.data.normal_(generator=torch.Generator().manual_seed(n))
    return layer


@pytest.mark.parametrize("shape", [(1, 64), (7, 512), (300, 48), (5, 4, 64)])
def test_contiguous_rows(shape, kernel_target):
    layer, x = norm(shape[-1]), 3 * torch.randn(shape)
    torch.testing.assert_close(layer(x), formula(x, layer.weight, 1e-6))


def test_heads_inside_the_qkv_output_are_read_in_place(kernel_target):
    tokens, heads, kv_heads, dim = 6, 8, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    layer = norm(dim)
    for part, count in ((q, heads), (k, kv_heads)):
        view = part.view(tokens, count, dim)
        assert not view.is_contiguous()
        torch.testing.assert_close(layer(view), formula(view, layer.weight, 1e-6))


def test_bfloat16_goes_through_torch():
    layer, x = norm(64), torch.randn(3, 64, dtype=torch.bfloat16)
    assert rowwise_cpu.kernel_for(x) is None
    torch.testing.assert_close(layer.to(torch.bfloat16)(x), formula(x, layer.weight, 1e-6))


def test_norm_with_rotary_is_the_norm_then_the_rotation(kernel_target):
    tokens, heads, dim = 5, 4, 64
    qkv = torch.randn(tokens, 3 * heads * dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.randn(tokens, dim // 2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    layer = norm(dim)
    torch.testing.assert_close(layer.with_rotary(q, cos, sin), apply_rotary(formula(q, layer.weight, 1e-6), cos, sin))


@pytest.mark.parametrize("width", [48, 40])  # (a tail past the last whole vector)
def test_silu_and_mul(width, kernel_target):
    x = 4 * torch.randn(9, 2 * width)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (the kernel; torch)
def test_add_and_norm_is_the_sum_and_its_norm(dtype, kernel_target):
    layer, residual, x = norm(96), torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    total, normed = layer.to(dtype).add_and_norm(residual, x)
    torch.testing.assert_close(total, residual + x, rtol=0, atol=0)
    torch.testing.assert_close(normed, formula(residual + x, layer.weight, 1e-6))
    assert layer.add_and_norm(None, x)[0] is x  # no residual yet: x is the stream


def test_q_and_k_heads_are_normed_and_rotated_in_one_call_as_one_by_one(kernel_target):
    tokens, heads, kv_heads, dim = 3, 8, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.randn(tokens, dim // 2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q_norm, k_norm = norm(dim), norm(dim)
    k_norm.weight.data += 1
    q, k, v = qkv_heads(qkv, heads, kv_heads, q_norm, k_norm, cos, sin)
    want_q, want_k, want_v = (
        part.view(tokens, -1, dim) for part in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    )
    torch.testing.assert_close(q, apply_rotary(formula(want_q, q_norm.weight, 1e-6), cos, sin))
    torch.testing.assert_close(k, apply_rotary(formula(want_k, k_norm.weight, 1e-6), cos, sin))
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 6, 64), (300, 16, 80), (37, 2, 16)])
def test_the_vision_towers_q_and_k_are_turned_in_one_pass_as_its_formula_does(tokens, heads, dim, kernel_target):
    """(Both halves of each head: dimension j with j + dim / 2, by (tokens, dim / 2) angles, read in place
    from the tower's qkv output, (tokens, 3, heads, dim).)"""
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=g)
    angles = 50 * torch.rand(tokens, dim // 2, generator=g)
    cos, sin = angles.cos(), angles.sin()
    got = rowwise_cpu.rotate_halves(rowwise_cpu.LIBRARY.get(), qkv, 2 * heads, dim, cos, sin)
    q, k, _ = qkv.view(tokens, 3, heads, dim).unbind(1)
    for part, x in zip((got[:, :heads], got[:, heads:]), (q, k)):
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        torch.testing.assert_close(part, torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1), rtol=1e-6, atol=1e-6)
