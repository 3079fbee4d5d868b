"""The `suite` part: the test files that run models (`SUITE`), under pytest on the device, each on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vlm_serve.tools.gpu_check.check import Check

SUITE = [  # in order of value: a lent GPU's time may end before the last
    "tests/llm/test_cuda_paths.py", "tests/parity/test_model_parity.py", "tests/deployments/test_server.py",
    "tests/vision/test_encoder_pool.py", "tests/llm/test_gemm_triton.py", "tests/llm/test_moe_layer.py",
    "tests/engine/test_engine.py", "tests/tools/test_builtin_model.py", "tests/scheduler/test_speculative.py",
    "tests/vision/test_vision_passes.py", "tests/parity/test_low_precision.py", "tests/llm/test_lora_kernels.py",
    "tests/llm/test_rowwise_triton.py", "tests/llm/test_decode_syncs.py",
]  # fmt: skip


def run_suite(check: Check, timeout: int, files: list[str]) -> None:
    """Each test file under pytest on its own, so that each one's failures are on record as it ends."""
    files = [f for f in files if Path(f).is_file()]
    if not files:
        check.record("suite", False, "no tests/ folder here: run the kit from the repository's root")
        return
    for file in files:
        command = [
            sys.executable,
            "-m",
            "pytest",
            file,
            "-q",
            "--tb=line",
            "-rfE",
            "-p",
            "no:cacheprovider",
            f"--timeout={timeout}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        with open(check.out / "suite.log", "a") as log:
            log.write(f"==== {file}\n{result.stdout[-20000:]}{result.stderr[-5000:]}\n")
        lines = result.stdout.strip().splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        check.record(Path(file).stem, result.returncode == 0, "; ".join([*lines[-1:], *failed[:3]])[:1500])
