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
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
LANES = 16  # floats per vector in tiles.h: row widths must be multiples of it
CACHE_ENV = "VLM_SERVE_KERNEL_CACHE"  # where built kernels are kept (default ~/.cache/vlm_serve/kernels)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_serve" / "kernels"


@functools.cache
def cpu_library(name: str) -> ctypes.CDLL | None:
    """The shared library built from `<name>.c` in this folder, or None where it cannot be built. (torch,
    imported above, has loaded its libgomp: the library's OpenMP is the one torch runs on, one pool.)"""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: CPU kernel %s not built, using torch ops", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(text + " ".join([compiler, *FLAGS]).encode() + _cpu_flags()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU kernel %s could not be built or loaded, using torch ops: %s", name, detail.strip()[-500:])
        return None


def panels(weight: torch.Tensor) -> torch.Tensor:
    """Weights (..., out, in) as tiles.h's column panels, (..., out / width, in, width): `width` output
    columns of every input row together, 64 where they divide `out`, else 16 (`out` a multiple of 16)."""
    *lead, out, inp = weight.shape
    width = 4 * LANES if out % (4 * LANES) == 0 else LANES
    return weight.detach().reshape(*lead, out // width, width, inp).transpose(-1, -2).contiguous()


PTR, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def bound_library(name: str, signatures: dict[str, tuple]) -> ctypes.CDLL | None:
    """`cpu_library(name)` with the signatures of its functions set, once: {function: (restype, *argtypes)}."""
    lib = cpu_library(name)
    if lib is not None and not getattr(lib, "bound", False):
        for function, (restype, *argtypes) in signatures.items():
            getattr(lib, function).restype, getattr(lib, function).argtypes = restype, argtypes
        lib.bound = True
    return lib


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once each get a whole file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, f"-I{source.parent}", str(source), "-o", tmp, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
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


_buffers = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A scratch buffer of at least `numel` elements, kept per thread and dtype across layers and steps:
    a fresh one each call would cost its page faults again."""
    held = getattr(_buffers, str(dtype), None)
    if held is None or held.numel() < numel:
        held = torch.empty(numel, dtype=dtype)
        setattr(_buffers, str(dtype), held)
    return held
