"""4- and 8-bit integer weights in the CPU kernels' panels (tiles.h's W_U4 / W_U8): the linear and MoE kernels
compute what torch computes with the dequantized weights, (codes - zero) * scale per group, in float32 (x
rounded to bfloat16 for 4-bit weights where the kernels have AVX-512-BF16's dot products, as for bfloat16
weights: tiles.h's tile_int4_dot), on every ISA the kernels are built for (cpu_targets.py): groups of 32 to 128 columns and per channel,
symmetric and with zero points, a last group in part, panels whole and one vector wide, one row to more
than a tile widens. A row's result is the same bits whatever rows are batched with it. And the check is
not blind: a wrong nibble order, a zero point off by one, a scale of the wrong group each fail it. W8A8's
int8 weights times x rounded to int8 per row (int8.h: VNNI, AVX2's vpmaddubsw, Arm's sdot or portable C)
compute what torch computes on x so rounded, to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.llm.kernels import linear_cpu, moe_cpu
from vlm_serve.llm.layers.quantized import quantize_per_token
from vlm_serve.quantization.int_packing import dequantize, pack_nibbles

SHAPES = [  # (out, in, group, symmetric)
    (64, 128, 32, True), (96, 192, 64, False), (128, 256, 128, True), (48, 96, None, False), (40, 104, 32, False),
    (64, 48, 16, True),
]  # fmt: skip


def integers(out: int, inp: int, bits: int, group: int | None, symmetric: bool, seed: int = 0, stack=()):
    """Random codes (..., out, in), float16-valued scales and zero points (None: symmetric) per group."""
    g = torch.Generator().manual_seed(seed + out * inp + bits)
    groups = 1 if group is None else -(-inp // group)
    codes = torch.randint(0, 1 << bits, (*stack, out, inp), generator=g, dtype=torch.uint8)
    scale = (torch.rand(*stack, out, groups, generator=g) * 0.05 + 0.001).half().float()
    zero = None if symmetric else torch.randint(0, 1 << bits, (*stack, out, groups), generator=g).to(torch.int16)
    return codes, scale, zero


def packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_nibbles(codes) if bits == 4 else codes


def reference(codes, scale, zero, bits, group) -> torch.Tensor:
    return dequantize(codes, scale, (1 << (bits - 1)) if zero is None else zero, group)


def as_multiplied(x: torch.Tensor, bits: int, kernel) -> torch.Tensor:
    """x as the kernel multiplies it by `bits`-bit codes: rounded to bfloat16 for 4 bits with BF16_DOT."""
    return x.bfloat16().float() if bits == 4 and kernel.bf16_dot else x


def close(y: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((y - want).abs() <= 1e-5 * want.abs().max() + 1e-6).all())


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_integer_panels_compute_the_dequantized_product(shape, bits, rows, kernel_target):
    out, inp, group, symmetric = shape
    codes, scale, zero = integers(out, inp, bits, group, symmetric)
    panels = linear_cpu.pack_int(packed(codes, bits), bits, scale, zero, group)
    assert panels is not None and panels.format == linear_cpu.INT_FORMATS[bits]
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(out)
    want = as_multiplied(x, bits, panels.kernel) @ reference(codes, scale, zero, bits, group).T + bias
    assert close(linear_cpu.linear(x, panels, bias), want)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_stored_in_16_bits_are_read_as_stored(dtype, bits, rows, kernel_target):
    codes, scale, zero = integers(96, 192, bits, 32, False)
    scale = scale.to(dtype)
    panels = linear_cpu.pack_int(packed(codes, bits), bits, scale, zero, 32)
    assert panels.layout.scale_format == linear_cpu.FORMATS[dtype]
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    want = as_multiplied(x, bits, panels.kernel) @ reference(codes, scale, zero, bits, 32).T
    assert close(linear_cpu.linear(x, panels, None), want)


def test_groups_of_32_4_bit_codes_are_held_in_at_most_115_percent_of_their_checkpoint_bytes(native_kernels):
    out, inp = 256, 512
    codes, scale, zero = integers(out, inp, 4, 32, False)
    panels = linear_cpu.pack_int(pack_nibbles(codes), 4, scale.bfloat16(), zero, 32)
    held = sum(t.numel() * t.element_size() for t in (panels.weight, panels.layout.scale))
    stored = out * inp // 2 + scale.numel() * 2 + zero.numel() // 2  # (int4 codes, bfloat16 scales, int4 zeros)
    assert held <= 1.15 * stored, held / stored


def test_a_zero_point_past_a_byte_is_left_to_torch(native_kernels):
    codes, scale, zero = integers(64, 128, 8, 32, False)
    zero[0, 0] = 256  # (GPTQ's first format stores 8-bit zero points less one: 255 reads as 256)
    assert linear_cpu.pack_int(codes, 8, scale, zero, 32) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(bits, kernel_target):
    codes, scale, zero = integers(128, 320, bits, 64, False)
    panels = linear_cpu.pack_int(packed(codes, bits), bits, scale, zero, 64)
    x = torch.randn(70, 320, generator=torch.Generator().manual_seed(1))
    whole = linear_cpu.linear(x, panels, None)  # (past the tiles: the widened path)
    for n in (1, 2, 3, 5, 13):
        assert torch.equal(linear_cpu.linear(x[:n], panels, None), whole[:n]), n


FAULTS = {
    "nibble order": lambda codes, scale, zero: (((codes & 0xF) << 4 | codes >> 4), scale, zero),
    "zero point off by one": lambda codes, scale, zero: (codes, scale, zero + 1),
    "scale of the wrong group": lambda codes, scale, zero: (codes, scale.roll(1, dims=-1), zero),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_planted_fault_fails_the_check(fault, native_kernels):
    codes, scale, zero = integers(64, 256, 4, 32, False)
    x = torch.randn(3, 256)
    right = linear_cpu.pack_int(pack_nibbles(codes), 4, scale, zero, 32)
    want = as_multiplied(x, 4, right.kernel) @ reference(codes, scale, zero, 4, 32).T
    assert close(linear_cpu.linear(x, right, None), want)
    bad_codes, bad_scale, bad_zero = FAULTS[fault](pack_nibbles(codes), scale, zero)
    wrong = linear_cpu.pack_int(bad_codes, 4, bad_scale, bad_zero, 32)
    assert not close(linear_cpu.linear(x, wrong, None), want)


def experts_reference(x, logits, top_k, w13, w2, rounded=lambda x: x) -> torch.Tensor:
    """The experts' sum as SparseMoeBlock's torch path computes it: top-k by softmax, renormalized; each
    product's input as `rounded` gives it."""
    probs = logits.softmax(-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = chosen[t, k]
            gate, up = (rounded(x[t]) @ w13[e].T).chunk(2)
            out[t] += weights[t, k] * (rounded(torch.nn.functional.silu(gate) * up) @ w2[e].T)
    return out


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("bits", [4, 8])
def test_integer_experts_compute_the_dequantized_layer(bits, tokens, kernel_target):
    experts, hidden, inter, group = 8, 64, 48, 16
    c13, s13, z13 = integers(2 * inter, hidden, bits, group, False, stack=(experts,))
    c2, s2, z2 = integers(hidden, inter, bits, group, True, seed=1, stack=(experts,))
    packs = moe_cpu.pack_int_experts((packed(c13, bits), s13, z13), (packed(c2, bits), s2, None), bits, group)
    assert packs is not None
    g = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, experts, generator=g)
    w13, w2 = reference(c13, s13, z13, bits, group), reference(c2, s2, None, bits, group)
    want = experts_reference(x, logits, 2, w13, w2, lambda x: as_multiplied(x, bits, packs.kernel))
    got = moe_cpu.moe_forward(x, logits, 2, True, 0, packs)
    assert ((got - want).abs() <= 1e-4 * want.abs().max()).all()


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("shape", [(64, 256), (48, 100), (128, 320)], ids=str)
def test_w8a8_panels_compute_the_product_of_x_rounded_to_int8(shape, rows, kernel_target):
    out, inp = shape
    g = torch.Generator().manual_seed(out + inp)
    q = torch.randint(-127, 128, (out, inp), generator=g)
    scale = torch.rand(out, 1, generator=g) * 0.01
    panels = linear_cpu.pack_int((q + 128).to(torch.uint8), 8, scale, None, None, int8_activations=True)
    assert panels.format == linear_cpu.W_I8
    x = torch.randn(rows, inp, generator=g)
    x[0, :3] = 0  # (a row's zeros, and below a row of zeros)
    if rows > 1:
        x[1] = 0
    want = quantize_per_token(x) @ (q.float() * scale).T
    got = linear_cpu.linear(x, panels, None)
    assert close(got, want)
    assert torch.equal(linear_cpu.linear(x[:1], panels, None), got[:1])  # (exact integer sums: any batch)


def test_w8a8_experts(kernel_target):
    experts, hidden, inter = 8, 64, 48
    g = torch.Generator().manual_seed(5)
    q13, q2 = (
        torch.randint(-127, 128, (experts, 2 * inter, hidden), generator=g),
        torch.randint(-127, 128, (experts, hidden, inter), generator=g),
    )
    s13, s2 = torch.rand(experts, 2 * inter, 1, generator=g) * 0.02, torch.rand(experts, hidden, 1, generator=g) * 0.02
    packs = moe_cpu.pack_int_experts(
        ((q13 + 128).to(torch.uint8), s13, None), ((q2 + 128).to(torch.uint8), s2, None), 8, None, True
    )
    x, logits = torch.randn(6, hidden, generator=g), torch.randn(6, experts, generator=g)
    want = experts_reference(x, logits, 2, q13.float() * s13, q2.float() * s2, quantize_per_token)
    got = moe_cpu.moe_forward(x, logits, 2, True, 0, packs)
    assert ((got - want).abs() <= 1e-4 * want.abs().max()).all()
