"""The CPU kernels against the machine's roofs and against torch, for one ISA: GFLOP/s of the linear and
MoE kernels at decode and prefill batch sizes.

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

Decode streams every layer's weights from memory: each timed call uses the next of enough copies of
the weights to fill 256 MB (more than any last-level cache measured), so no call finds its weights in cache
(and each MoE call brings new tokens, so other experts). Each figure is the
median of `--repeats` calls after a warm-up; GB/s counts the weight bytes the call reads.

    python benchmarks/bench_kernels.py --isa avx2 [--threads 2] [--repeats 30]
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
    args = parser.parse_args()
    os.environ.update(environment(args.isa))  # before torch loads oneDNN and MKL
    march = os.environ.get("VLM_SERVE_CPU_MARCH", "native")
    import torch

    torch.set_num_threads(args.threads)
    from vlm_serve.llm.kernels import linear_cpu

    kernel = linear_cpu.LIBRARY.get()
    if kernel is None:
        sys.exit("the CPU kernels did not build (see the warning above)")
    cpu, _ = describe_cpu()
    print(f"CPU: {cpu}, {args.threads} threads; kernels built for -march={march}: {kernel.isa}, {kernel.lanes} "
          f"floats per vector; torch/oneDNN/MKL: {'capped at AVX2' if args.isa == 'avx2' else 'their own choice'}")
    fma, bandwidth = roofs(torch, march, args.threads)
    print(f"roofs: FMA {fma:.0f} GFLOP/s, memory read {bandwidth:.1f} GB/s\n")
    bench_linear(torch, args.repeats, fma)
    bench_moe(torch, args.repeats, fma)


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
            print(f"{f'{inp}x{out} {name}':<34}{rows:>5}{cells[0]:>18}{cells[1]:>18}{t_theirs / t_ours:>7.2f}x"
                  f"{100 * flops / t_ours / 1e9 / fma:>11.0f}%")  # fmt: skip
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
                    moe.w13.data = moe.packed.w13.transpose(-1, -2).reshape(EXPERTS, 2 * inter, hidden).contiguous()
                    moe.w2.data = moe.packed.w2.transpose(-1, -2).reshape(EXPERTS, hidden, inter).contiguous()
            flops, nbytes = 2 * tokens * TOP_K * 3 * hidden * inter, active * 3 * hidden * inter * 4
            cells = [f"{flops / t / 1e9:8.1f} ({nbytes / t / 1e9:5.1f})" for t in (t_ours, t_theirs)]
            print(f"{f'{name} H {hidden} I {inter}':<34}{tokens:>6}{cells[0]:>18}{cells[1]:>18}"
                  f"{t_theirs / t_ours:>7.2f}x{100 * flops / t_ours / 1e9 / fma:>11.0f}%")  # fmt: skip
    print()


if __name__ == "__main__":
    main()
