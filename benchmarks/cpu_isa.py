"""The environment that makes a run measure another x86 ISA than this machine's widest one, so that an
AVX-512 machine measures what an AVX2 one runs: our kernels built for x86-64-v3, and torch's own
kernels, oneDNN and MKL capped at AVX2. vLLM's CPU build (through vllm_launcher.py) then also loads its
AVX2 kernels instead of its AVX-512 ones."""

from __future__ import annotations

ISAS = ["native", "avx2"]


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
