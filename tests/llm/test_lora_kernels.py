"""The batched LoRA kernels add each segment's adapter product to y in place, as a plain torch reference
computes it (float32 sums, rounded once into y's dtype), and leave the rows in no segment alone: the C
kernel (kernels/lora_cpu.py) on every ISA it is built for (cpu_targets.py), on 1 and 2 threads, for
float32 and bfloat16 x and y; the Triton kernel (kernels/lora_triton.py) where there is a CUDA device.
Segment layouts: one run, runs of one slot, runs of different slots interleaved, rows in no run, none;
ranks 1 to 16 of 16 (and 48, a fused projection's three parts), sizes that are no whole vectors, runs
longer than the kernel's tasks."""

from __future__ import annotations

import types

import pytest
import torch

from cpu_targets import require_kernels, targets
from vlm_serve.llm.kernels import Target, lora_cpu, lora_triton
from vlm_serve.llm.lora.layer import LoRABatch, LoRASlots

# (bfloat16 dot products are the weight kernels' build option: this kernel is the same either way)
ISAS = [param for param in targets() if param.id not in ("native-widened", "native-bf16-dot")]
ROWS, SLOTS = 120, 3
LAYOUTS = {
    "one run": [(0, ROWS, 1)],
    "runs of one slot": [(0, 5, 2), (5, 6, 2), (9, 23, 2), (23, ROWS, 2)],
    "slots interleaved": [(0, 3, 0), (3, 11, 2), (11, 12, 0), (15, 27, 1), (27, 33, 2), (33, ROWS, 0)],
    "rows in no run": [(4, 9, 1), (17, 18, 0), (30, 37, 2), (60, 110, 1)],
    "none": [],
}


@pytest.fixture(params=ISAS)
def cpu_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    """lora_cpu built for each ISA in turn (a build that fails fails the test)."""
    monkeypatch.setattr(Target, "from_env", lambda: request.param)
    require_kernels(request.param, [lora_cpu.LIBRARY])
    lora_cpu.kernel.cache_clear()  # (looked up once per process: here once per ISA)
    yield request.param
    lora_cpu.kernel.cache_clear()


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def reference(
    x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segments: list, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """y with the products added, in double rounded once; and the scale of each sum's rounding error,
    |y| + (|x| @ |A|.T) @ |B|.T (where y and the product nearly cancel, the error is of the operands' size)."""
    expected, scale = y.clone(), y.double().abs()
    for start, end, slot in segments:
        a, b = A[slot, :rank].double().T, B[slot, :, :rank].double().T
        delta = (x[start:end].double() @ a) @ b
        expected[start:end] = (y[start:end].double() + delta).float().to(y.dtype)
        scale[start:end] += (x[start:end].double().abs() @ a.abs()) @ b.abs()
    return expected, scale


def operands(rows: int, inp: int, out: int, ranks: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    y = (4 * torch.randn(rows, out, generator=g)).to(dtype)
    A = torch.randn(SLOTS, ranks, inp, generator=g) * inp**-0.5
    B = torch.randn(SLOTS, out, ranks, generator=g)
    return x, y, A, B


def assert_rounded_once(
    got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, untouched: torch.Tensor
) -> None:
    """float32: the reference's values to float32 rounding of sums taken in another order (of the operands'
    scale). bfloat16: the reference's values, but where the float32 sum lands within its rounding error of a
    rounding boundary (a few in a thousand at most: rounding twice or truncating moves half of them), one
    unit in the last place away, or where y and the product nearly cancel, float32's error. Rows in no
    segment: as they were."""
    assert torch.equal(got[untouched], expected[untouched])
    error = (got.double() - expected.double()).abs()
    float32_error = 1e-5 * scale.to(error.device)
    if got.dtype == torch.float32:
        assert (error <= float32_error).all(), (error - float32_error).max()
        return
    ulp = expected.double().abs() * 2**-7
    assert (error <= torch.maximum(ulp, float32_error)).all(), (error - torch.maximum(ulp, float32_error)).max()
    assert (got != expected).float().mean() < 0.005, (got != expected).sum()


def untouched_rows(rows: int, segments: list) -> torch.Tensor:
    inside = torch.zeros(rows, dtype=torch.bool)
    for start, end, _ in segments:
        inside[start:end] = True
    return ~inside


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inp,out", [(72, 200), (200, 72)])
def test_each_segment_gets_its_slots_product(layout, dtype, inp, out, cpu_kernel, threads):
    segments = LAYOUTS[layout]
    x, y, A, B = operands(ROWS, inp, out, 16, dtype)
    expected, scale = reference(x, y, A, B, segments, 16)
    lora_cpu.add_lora(x, y, A, B, segments)
    assert_rounded_once(y, expected, scale, untouched_rows(ROWS, segments))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [16, 48])
def test_only_the_leading_ranks_are_used(dtype, ranks, cpu_kernel, threads):
    """Every rank 1 ... 16; the ranks past `rank` hold NaN, which must reach no sum."""
    segments = LAYOUTS["slots interleaved"]
    for rank in range(1, 17):
        x, y, A, B = operands(ROWS, 72, 200, ranks, dtype, seed=rank)
        A[:, rank:], B[:, :, rank:] = float("nan"), float("nan")
        expected, scale = reference(x, y, A, B, segments, rank)
        lora_cpu.add_lora(x, y, A, B, segments, rank)
        assert_rounded_once(y, expected, scale, untouched_rows(ROWS, segments))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_few_rows_of_wide_layers(dtype, rows, cpu_kernel, threads):
    """Decode sizes, where both threads share each row's ranks and outputs."""
    x, y, A, B = operands(rows, 2048, 2056, 16, dtype)
    segments = [(0, rows, 2)]
    expected, scale = reference(x, y, A, B, segments, 16)
    lora_cpu.add_lora(x, y, A, B, segments)
    assert_rounded_once(y, expected, scale, untouched_rows(rows, segments))


def test_strided_rows_and_a_view_of_y_are_updated_in_place(cpu_kernel):
    wide_x, wide_y = torch.randn(ROWS, 100), torch.randn(ROWS, 300)
    x, y = wide_x[:, 3:75], wide_y[:, 50:250]  # (rows 100 and 300 floats apart)
    before = wide_y.clone()
    _, _, A, B = operands(ROWS, 72, 200, 16, torch.float32)
    segments = LAYOUTS["rows in no run"]
    expected, scale = reference(x, y, A, B, segments, 16)
    lora_cpu.add_lora(x, y, A, B, segments)
    assert_rounded_once(y, expected, scale, untouched_rows(ROWS, segments))
    assert torch.equal(wide_y[:, :50], before[:, :50]) and torch.equal(wide_y[:, 250:], before[:, 250:])
    y_t = torch.randn(200, ROWS).T  # (columns not contiguous)
    expected, scale = reference(x, y_t, A, B, segments, 16)
    lora_cpu.add_lora(x, y_t, A, B, segments)
    assert_rounded_once(y_t, expected, scale, untouched_rows(ROWS, segments))


def test_segments_out_of_row_order_are_taken(cpu_kernel):
    segments = LAYOUTS["slots interleaved"][::-1]
    x, y, A, B = operands(ROWS, 72, 200, 16, torch.float32)
    expected, scale = reference(x, y, A, B, segments, 16)
    lora_cpu.add_lora(x, y, A, B, segments)
    assert_rounded_once(y, expected, scale, untouched_rows(ROWS, segments))


@pytest.mark.parametrize(
    "segments",
    [
        [(0, ROWS + 1, 0)],
        [(5, 3, 0)],
        [(0, 4, SLOTS)],
        [(0, 4, -1)],
        [(0, 10, 0), (8, 12, 1)],
        [(8, 12, 1), (0, 10, 0)],
    ],
    ids=["past the rows", "backwards", "slot past the slots", "negative slot", "overlapping", "overlapping unordered"],
)
def test_segments_that_do_not_fit_are_refused_and_nothing_is_added(segments, cpu_kernel):
    x, y, A, B = operands(ROWS, 72, 200, 16, torch.float32)
    before = y.clone()
    with pytest.raises(ValueError, match="segments"):
        lora_cpu.add_lora(x, y, A, B, segments)
    assert torch.equal(y, before)


def test_operands_that_do_not_fit_are_refused(native_kernels):
    x, y, A, B = operands(ROWS, 72, 200, 16, torch.float32)
    for args, rank in [
        ((x, y.bfloat16(), A, B), None),
        ((x.half(), y.half(), A, B), None),
        ((x, y, A.double(), B), None),
        ((x[:, :70], y, A, B), None),
        ((x, y[:, :100], A, B), None),
        ((x, y, A, B[:2]), None),
        ((x, y, A, B), 17),
    ]:
        with pytest.raises(ValueError):
            lora_cpu.add_lora(*args, [(0, 4, 0)], rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_what_the_layers_torch_path_adds(dtype, native_kernels):
    """`LoRASlots.add_delta`, the torch path: its delta rounded into y's dtype before the add (the kernel
    rounds once), so for bfloat16 within a unit in the last place of y's values (|y| ~ 4: 2^-5)."""
    linear = types.SimpleNamespace(in_features=72, out_features=200, device="cpu")
    slots = LoRASlots(linear, num_slots=SLOTS, max_rank=16, num_parts=1)
    x, y, slots.A, slots.B = operands(ROWS, 72, 200, 16, dtype)
    batch = LoRABatch(tuple(LAYOUTS["slots interleaved"]))
    expected = slots.add_delta(x, y.clone(), batch)
    lora_cpu.add_lora(x, y, slots.A, slots.B, batch.segments)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-4)
    torch.testing.assert_close(y, expected, **tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_gets_each_segment_its_slots_product(layout, dtype):
    if not lora_triton.available():
        pytest.skip("Triton is not installed")
    segments = LAYOUTS[layout]
    for rows, inp, out, rank in [(ROWS, 72, 200, 16), (ROWS, 200, 72, 5), (ROWS, 1024, 2056, 48)]:
        x, y, A, B = (t.cuda() for t in operands(rows, inp, out, 48, dtype))
        A[:, rank:], B[:, :, rank:] = float("nan"), float("nan")
        expected, scale = reference(x, y, A, B, segments, rank)
        lora_triton.add_lora(x, y, A, B, segments, rank)
        assert_rounded_once(y.cpu(), expected.cpu(), scale, untouched_rows(rows, segments))
