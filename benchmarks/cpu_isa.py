"""The environment that makes a run measure another x86 ISA than this machine's widest one, so that an
AVX-512 machine measures what an AVX2 one runs: our kernels built for x86-64-v3, and torch's own
kernels, oneDNN and MKL capped at AVX2. vLLM's CPU build (through vllm_launcher.py) then also loads its
AVX2 kernels instead of its AVX-512 ones. Also the CPU as `lscpu` names it, for the figures' header."""

from __future__ import annotations

import subprocess

ISAS = ["native", "avx2"]


def describe_cpu() -> tuple[str, str]:
    """This machine's CPU model and the widest vector ISA it runs, as `lscpu` reports them."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2 + FMA" if "avx2" in flags else "NEON" if "asimd" in flags else "?"
    return fields.get("Model name", "?").strip(), isa


def environment(isa: str) -> dict[str, str]:
    if isa == "native":
        return {}
    return {
        "VLM_SERVE_CPU_MARCH": "x86-64-v3",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "BENCH_CPU_ISA": isa,  # read by vllm_launcher.py
    }
