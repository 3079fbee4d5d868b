"""The CPU kernels against the machine's roofs and against torch, for one ISA: GFLOP/s of the linear and
MoE kernels at decode and prefill batch sizes, and the weight formats side by side.

`--isa native` builds the kernels for this machine (`-march=native`) and leaves torch, oneDNN and MKL
their own choice; `--isa avx2` builds them for x86-64-v3 (AVX2 + FMA) and caps the others at AVX2
(cpu_isa.py), so that an AVX-512 machine measures what an AVX2 one runs. The ISA the kernels were built
for and the CPU (`lscpu`) are printed with the figures.

- Roofs, measured here, built like the kernels: FMA (independent multiply-adds on registers, every
  core, the ISA's vector width) and memory read bandwidth (vector loads over 1 GB, every core).
- Linear (y = x @ w^T, float32): our kernel (linear_cpu.c, panels) against oneDNN with its prepacked
  weight, what a float32 linear runs without the kernel. Shapes of the benchmark models' layers.
- MoE experts (128 experts, top 8, the small and medium MoE's shapes): our kernel (moe_cpu.c) against
  the torch path of the same layer (a matmul per active expert each way).
- Weight formats: time and GB/s of weights read for float32, bfloat16 and FP8 (e4m3, 128 x 128 block
  scales, quantized as the published checkpoints are) panels, on a 4096 x 4096 linear and on
  Qwen3-VL-235B-A22B's experts as a TP-8 rank holds them (hidden 4096, intermediate 1536 / 8), at 1, 16
  and 128 rows, with the speed-up over float32 (at batch 1 reading the weights is the bound: bfloat16
  reads half of float32's bytes, FP8 a quarter). bfloat16 panels multiply x rounded to bfloat16 with
  AVX-512-BF16's dot products where the CPU has them (tiles.h's BF16_DOT; `VLM_SERVE_CPU_BF16_DOT=0`
  turns them off), else widen the weights to float32; the header says which.

Decode streams every layer's weights from memory: each timed call uses the next of enough copies of
the weights to fill 256 MB (more than any last-level cache measured), so no call finds its weights in cache
(and each MoE call brings new tokens, so other experts). Each figure is the
median of `--repeats` calls after a warm-up; GB/s counts the weight bytes the call reads.

    python benchmarks/bench_kernels.py --isa avx2 [--threads 2] [--repeats 30] [--sections formats]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_isa import ISAS, describe_cpu, environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", choices=ISAS, default="native")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS)
    args = parser.parse_args()
    os.environ.update(environment(args.isa))  # before torch loads oneDNN and MKL
    march = os.environ.get("VLM_SERVE_CPU_MARCH", "native")
    import torch

    torch.set_num_threads(args.threads)
    from vlm_serve.llm.kernels import linear_cpu

    kernel = linear_cpu.LIBRARY.get()
    if kernel is None:
        sys.exit("the CPU kernels did not build (see the warning above)")
    cpu, widest = describe_cpu()
    print(
        f"CPU: {cpu} ({widest}), {args.threads} threads; kernels built for -march={march}: {kernel.isa}, "
        f"{kernel.lanes} floats per vector, bfloat16 weights "
        f"{'times x in bfloat16 (AVX-512-BF16 dot products)' if kernel.bf16_dot else 'widened to float32'}; "
        f"torch/oneDNN/MKL: "
        f"{'capped at AVX2' if args.isa == 'avx2' else 'their own choice'}"
    )
    fma, bandwidth = roofs(torch, march, args.threads)
    print(f"roofs: FMA {fma:.0f} GFLOP/s, memory read {bandwidth:.1f} GB/s\n")
    if "linear" in args.sections:
        bench_linear(torch, args.repeats, fma)
    if "moe" in args.sections:
        bench_moe(torch, args.repeats, fma)
    if "formats" in args.sections:
        bench_formats(torch, args.repeats, bandwidth)


SECTIONS = ["linear", "moe", "formats"]


ROOFS = """
    #include <omp.h>
    #include "simd.h"

    /* flops of `iters` rounds of 12 independent vector multiply-adds on every thread */
    double fma_flops(int64_t iters, int threads, float *sink) {
        #pragma omp parallel num_threads(threads)
        {
            vec a[12];
            for (int i = 0; i < 12; i++) a[i] = splat((float)i);
            const vec x = splat(0.999999f), y = splat(1e-6f);
            for (int64_t n = 0; n < iters; n++)
                for (int i = 0; i < 12; i++) a[i] = a[i] * x + y;
            float s = 0;
            for (int i = 0; i < 12; i++) s += a[i][0];
            sink[omp_get_thread_num()] = s;
        }
        return 2.0 * LANES * 12 * iters * threads;
    }

    /* reads x[0 : n] (n a multiple of 4 * LANES), each thread a contiguous share, as the kernels read weights */
    void read_all(const float *x, int64_t n, int threads, float *sink) {
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i += 4 * LANES) {
            vec s = load(x + i) + load(x + i + LANES) + load(x + i + 2 * LANES) + load(x + i + 3 * LANES);
            if (s[0] == 12345.0f) sink[omp_get_thread_num()] = s[1]; /* (keeps the loads) */
        }
    }
"""


def roofs(torch, march: str, threads: int) -> tuple[float, float]:
    """GFLOP/s of independent vector multiply-adds and GB/s of reading 1 GB, on every thread, built like
    the kernels."""
    import ctypes

    from vlm_serve.llm.kernels import SOURCES, Target

    with tempfile.TemporaryDirectory() as folder:
        c, so = Path(folder) / "roofs.c", Path(folder) / "roofs.so"
        c.write_text(ROOFS)
        shutil.copy(SOURCES / "simd.h", folder)
        command = Target.from_env()._replace(march=march).command(c, str(so))
        subprocess.run(command, check=True, capture_output=True)
        lib = ctypes.CDLL(str(so))
    lib.fma_flops.restype, lib.fma_flops.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.read_all.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    sink = (ctypes.c_float * 256)()
    big = torch.ones(256 * 2**20)  # 1 GB
    fma, read = 0.0, 0.0
    for _ in range(5):
        start = time.perf_counter()
        flops = lib.fma_flops(20_000_000, threads, sink)
        fma = max(fma, flops / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        lib.read_all(big.data_ptr(), big.numel(), threads, sink)
        read = max(read, big.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return fma, read


def copies_for(nbytes: int) -> int:
    """Weight copies that fill 256 MB, more than the caches of the machines measured, so that cycling
    through them reads memory."""
    return max(2, -(-256 * 2**20 // nbytes))


def timed(repeats: int, run) -> float:
    """Median seconds of `run(i)` for i = 3 ... repeats + 2, after `run(0 ... 2)` as warm-up."""
    for i in range(3):
        run(i)
    times = []
    for i in range(3, repeats + 3):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


LINEAR_SHAPES = [  # (in, out) of the benchmark models' layers
    (512, 3072, "small dense gate/up"),
    (1024, 6144, "medium dense gate/up"),
    (3072, 1024, "medium dense down"),
    (4096, 4096, "a 4096 x 4096 projection"),
]
ROWS = [1, 4, 16, 64, 256]


def bench_linear(torch, repeats: int, fma: float) -> None:
    from vlm_serve.llm.kernels import linear_cpu
    from vlm_serve.llm.layers.linear import onednn_linear, onednn_weight

    print("linear, float32: GFLOP/s (GB/s of weights read), ours / oneDNN")
    print(f"{'shape':<34}{'rows':>5}{'ours':>18}{'oneDNN':>18}{'ratio':>8}{'% FMA roof':>12}")
    for inp, out, name in LINEAR_SHAPES:
        count = copies_for(inp * out * 4)
        weights = [torch.randn(out, inp) * inp**-0.5 for _ in range(count)]
        ours = [linear_cpu.pack(w) for w in weights]
        theirs = [onednn_weight(w) for w in weights]
        del weights
        for rows in ROWS:
            x = torch.randn(rows, inp)
            t_ours = timed(repeats, lambda i: linear_cpu.linear(x, ours[i % count], None))
            t_theirs = timed(repeats, lambda i: onednn_linear(x, theirs[i % count]))
            flops, nbytes = 2 * rows * inp * out, 4 * inp * out
            cells = [f"{flops / t / 1e9:8.1f} ({nbytes / t / 1e9:5.1f})" for t in (t_ours, t_theirs)]
            print(
                f"{f'{inp}x{out} {name}':<34}{rows:>5}{cells[0]:>18}{cells[1]:>18}{t_theirs / t_ours:>7.2f}x"
                f"{100 * flops / t_ours / 1e9 / fma:>11.0f}%"
            )
    print()


MOE_SHAPES = [(512, 128, "small MoE"), (768, 96, "medium MoE")]  # (hidden, expert intermediate)
EXPERTS, TOP_K = 128, 8


def bench_moe(torch, repeats: int, fma: float) -> None:
    from vlm_serve.llm.layers.moe import SparseMoeBlock

    print(f"MoE experts ({EXPERTS} experts, top {TOP_K}), float32: GFLOP/s (GB/s of weights read), ours / torch")
    print(f"{'shape':<34}{'tokens':>6}{'ours':>18}{'torch':>18}{'ratio':>8}{'% FMA roof':>12}")
    for hidden, inter, name in MOE_SHAPES:
        count = copies_for(EXPERTS * 3 * hidden * inter * 4)
        layers = []
        for seed in range(count):
            g = torch.Generator().manual_seed(seed)
            moe = SparseMoeBlock(hidden, inter, EXPERTS, TOP_K)
            moe.gate.weight.data = torch.randn(EXPERTS, hidden, generator=g) * 0.2
            moe.w13.data = torch.randn(EXPERTS, 2 * inter, hidden, generator=g) * hidden**-0.5
            moe.w2.data = torch.randn(EXPERTS, hidden, inter, generator=g) * inter**-0.5
            layers.append(moe)
        for tokens in [1, 4, 16, 64, 256]:
            # new tokens every call, as in decode: other experts, not the ones the last call left in cache
            xs = [torch.randn(tokens, hidden) for _ in range(repeats + 3)]
            with torch.no_grad():
                active = sum(torch.topk(layers[0].gate(x), TOP_K).indices.unique().numel() for x in xs) / len(xs)
                for moe in layers:
                    moe.packed = None
                t_theirs = timed(repeats, lambda i: layers[i % count](xs[i]))
                for moe in layers:
                    moe.prepack()
                t_ours = timed(repeats, lambda i: layers[i % count](xs[i]))
                for moe in layers:  # back to plain weights for the next batch size's torch run
                    moe.w13.data, moe.w2.data = unpanel(moe.packed.w13, hidden), unpanel(moe.packed.w2, inter)
            flops, nbytes = 2 * tokens * TOP_K * 3 * hidden * inter, active * 3 * hidden * inter * 4
            cells = [f"{flops / t / 1e9:8.1f} ({nbytes / t / 1e9:5.1f})" for t in (t_ours, t_theirs)]
            print(
                f"{f'{name} H {hidden} I {inter}':<34}{tokens:>6}{cells[0]:>18}{cells[1]:>18}"
                f"{t_theirs / t_ours:>7.2f}x{100 * flops / t_ours / 1e9 / fma:>11.0f}%"
            )
    print()


def unpanel(panels, inp: int):
    """Float32 panels (..., out / width, in, width, 1) back to the weights (..., out, in)."""
    return panels.squeeze(-1).transpose(-1, -2).flatten(-3, -2)[..., :inp].contiguous()


FORMAT_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float8_e4m3fn": "FP8 e4m3"}
FORMAT_ROWS = [1, 16, 128]
MOE_235B_TP8 = (4096, 1536 // 8)  # Qwen3-VL-235B-A22B's experts as a TP-8 rank holds them


def quantize_fp8(torch, weight, block: int = 128):
    """(..., out, in) float32 weights as FP8 checkpoints hold them: e4m3 values and a float32 scale per
    block of block x block (weight_scale_inv, ceil(out / block) x ceil(in / block)), the block's largest
    magnitude / 448."""
    *stack, out, inp = weight.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = weight.new_zeros(*stack, rows * block, cols * block)
    padded[..., :out, :inp] = weight
    blocks = padded.unflatten(-2, (rows, block)).unflatten(-1, (cols, block))
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn).flatten(-4, -3).flatten(-2, -1)
    return q[..., :out, :inp].contiguous(), scale


def in_format(torch, weight, name: str):
    """The weight in format `name` and its block scales (FP8), or None."""
    if name == "float8_e4m3fn":
        return quantize_fp8(torch, weight)
    return weight.to(getattr(torch, name)), None


def bench_formats(torch, repeats: int, bandwidth: float) -> None:
    from vlm_serve.llm.kernels import linear_cpu, moe_cpu

    print(
        "weight formats: ms per call (GB/s of weights read), speed-up over float32; the formats' calls "
        "alternate, so that they share the machine's other load alike"
    )
    print(f"{'':<40}{'rows':>5}" + "".join(f"{FORMAT_NAMES[name]:>24}" for name in FORMAT_NAMES))
    out = inp = 4096
    packed, sizes = {}, {}
    for name in FORMAT_NAMES:
        count = copies_for(out * inp * torch.empty(0, dtype=getattr(torch, name)).element_size())
        packed[name] = [
            linear_cpu.pack(*in_format(torch, torch.randn(out, inp) * inp**-0.5, name)) for _ in range(count)
        ]
        sizes[name] = nbytes(packed[name][0].weight, packed[name][0].layout.scale)
    for i, rows in enumerate(FORMAT_ROWS):
        x = torch.randn(rows, inp)
        calls = {name: (lambda i, p=p: linear_cpu.linear(x, p[i % len(p)], None)) for name, p in packed.items()}
        times = timed_together(repeats, calls)
        label = f"linear {out} x {inp}" if i == 0 else ""
        print(
            f"{label:<40}{rows:>5}"
            + "".join(format_cell(times[name], sizes[name], times["float32"]) for name in FORMAT_NAMES)
        )
    print(f"{'  weights in memory, MB':<45}" + "".join(f"{sizes[name] / 1e6:>24.1f}" for name in FORMAT_NAMES))
    del packed

    hidden, inter = MOE_235B_TP8
    experts, sizes = {}, {}
    for name in FORMAT_NAMES:
        generator = torch.Generator().manual_seed(0)
        w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=generator) * hidden**-0.5
        w2 = torch.randn(EXPERTS, hidden, inter, generator=generator) * inter**-0.5
        (w13, s13), (w2, s2) = in_format(torch, w13, name), in_format(torch, w2, name)
        experts[name] = moe_cpu.pack_experts(w13, w2, s13, s2)
        del w13, w2
        e = experts[name]
        sizes[name] = nbytes(e.w13, e.layout13.scale) + nbytes(e.w2, e.layout2.scale)
    for i, tokens in enumerate(FORMAT_ROWS):
        # new tokens every call, as in decode: other experts, not the ones the last call left in cache
        xs = [torch.randn(tokens, hidden) for _ in range(repeats + 3)]
        logits = [torch.randn(tokens, EXPERTS) for _ in range(repeats + 3)]
        active = sum(torch.topk(g, TOP_K).indices.unique().numel() for g in logits) / len(logits) / EXPERTS
        calls = {
            name: (lambda i, e=e: moe_cpu.moe_forward(xs[i], logits[i], TOP_K, True, 0, e))
            for name, e in experts.items()
        }
        times = timed_together(repeats, calls)
        label = f"MoE experts H {hidden} I {inter} x{EXPERTS}, top {TOP_K}" if i == 0 else ""
        print(
            f"{label:<40}{tokens:>5}"
            + "".join(format_cell(times[name], sizes[name] * active, times["float32"]) for name in FORMAT_NAMES)
        )
    print(f"{'  weights in memory, MB':<45}" + "".join(f"{sizes[name] / 1e6:>24.1f}" for name in FORMAT_NAMES))
    print(f"(memory read roof: {bandwidth:.1f} GB/s)\n")


def nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


def timed_together(repeats: int, runs: dict) -> dict[str, float]:
    """`timed` for several runs at once, their calls alternating: median seconds of each."""
    for i in range(3):
        for run in runs.values():
            run(i)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(3, repeats + 3):
        for name, run in runs.items():
            start = time.perf_counter()
            run(i)
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def format_cell(t: float, nbytes: float, t_float32: float) -> str:
    return f"{t * 1e3:8.2f} ({nbytes / t / 1e9:5.1f}) {t_float32 / t:4.2f}x"


if __name__ == "__main__":
    main()
