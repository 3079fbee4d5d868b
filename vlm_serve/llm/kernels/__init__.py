"""C kernels for the CPU, compiled on first use with the system's C compiler for this machine's CPU
(`-march=native`, as vLLM's CPU build targets the host ISA) and cached on disk. Without a working
compiler `cpu_library` returns None and callers keep their torch paths."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
CACHE_ENV = "VLM_SERVE_KERNEL_CACHE"  # where built kernels are kept (default ~/.cache/vlm_serve/kernels)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_serve" / "kernels"


@functools.cache
def cpu_library(name: str) -> ctypes.CDLL | None:
    """The shared library built from `<name>.c` in this folder, or None where it cannot be built.

    torch is imported first, so the library's OpenMP is the one torch runs on (one thread pool)."""
    import torch  # noqa: F401  (loads torch's libgomp before ours asks for it)

    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: CPU kernel %s not built, using torch ops", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    key = hashlib.sha256(source.read_bytes() + " ".join([compiler, *FLAGS]).encode() + _cpu_flags()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU kernel %s could not be built or loaded, using torch ops: %s", name, detail.strip()[-500:])
        return None


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once each get a whole file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_flags() -> bytes:
    """What -march=native depends on, so a cache shared between machines keeps one build per CPU."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
