"""C kernels for the CPU, built on first use with the system's C compiler for this machine's ISA and
cached on disk.

Built here rather than shipped prebuilt: the package stays pure Python, every machine gets code for its
own ISA and tuning (`-march=native`, as vLLM's CPU build and llama.cpp's default build do), and the same
portable source (simd.h: the vector width and register blocking follow the ISA) serves x86-64 from SSE to
AVX-512 and Arm. A build takes a few seconds, once per machine; the first start says so while it builds.

A kernel that cannot be had — no compiler, a failed build, a build this CPU cannot run — is one warning
line per process, saying which and why, and its callers keep their torch paths. A failed build is
remembered (keyed by the sources, the compiler and its flags, and the CPU) and not tried again.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "VLM_SERVE_KERNEL_CACHE"  # where built kernels are kept (default ~/.cache/vlm_serve/kernels)
BUILD_FORMAT = b"2"  # of what a build leaves in the cache (2: the compiler's warnings in `<library>.out`)
MARCH_ENV = "VLM_SERVE_CPU_MARCH"  # the -march they are built for (default native: this machine's CPU)
# bfloat16 weights multiply x rounded to bfloat16 where the -march has AVX-512-BF16 (tiles.h's BF16_DOT):
# bfloat16 compute for a bfloat16 checkpoint, as vLLM's and oneDNN's CPU paths do. 0: widen the weights to
# float32 instead (float32 compute on bfloat16 weights, what `--dtype float32` computes, at half its bytes)
BF16_DOT_ENV = "VLM_SERVE_CPU_BF16_DOT"
FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
SOURCES = Path(__file__).parent

PTR, I64, I32, F32, STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_char_p
# what every library exports besides its kernels (simd.h, tiles.h)
COMMON = {
    "kernel_isa": (STR,),
    "kernel_lanes": (I32,),
    "kernel_panel": (I32,),
    "kernel_int_panel": (I32,),
    "kernel_runs_here": (I32,),
    "kernel_bf16_dot": (I32,),
}


class Unavailable(Exception):
    """Why a kernel library cannot be had here."""


class Target(NamedTuple):
    """What the kernels are built with and for, and where they are kept: a C compiler (`$CC`, default
    `cc`), its -march (`$VLM_SERVE_CPU_MARCH`, default native), the cache folder, and whether bfloat16
    weights may use AVX-512-BF16's dot products (`$VLM_SERVE_CPU_BF16_DOT`)."""

    compiler: str
    march: str
    cache: str  # "" for the default folder (`cache_dir`)
    bf16_dot: bool = False

    @classmethod
    def from_env(cls) -> Target:
        return cls(
            os.environ.get("CC") or "cc",
            os.environ.get(MARCH_ENV) or "native",
            os.environ.get(CACHE_ENV, ""),
            os.environ.get(BF16_DOT_ENV, "1") != "0",
        )

    def command(self, source: Path, output: str) -> list[str]:
        dot = ["-DVLM_SERVE_BF16_DOT"] if self.bf16_dot else []
        return [
            self.compiler,
            f"-march={self.march}",
            *FLAGS,
            *dot,
            f"-I{source.parent}",
            str(source),
            "-o",
            output,
            "-lm",
        ]

    def open(self, path: Path, signatures: dict[str, tuple]) -> CpuKernel:
        return CpuKernel(ctypes.CDLL(str(path)), signatures)


class CpuKernel:
    """A loaded kernel library. Its functions are called with tensors (passed by their data pointers),
    None (a null pointer), ints and floats, as their signatures {function: (restype, *argtypes)} say."""

    def __init__(self, lib: ctypes.CDLL, signatures: dict[str, tuple]) -> None:
        self.lib = lib
        self.signatures = {**COMMON, **signatures}
        for function, (restype, *argtypes) in self.signatures.items():
            c_function = getattr(lib, function)
            c_function.restype, c_function.argtypes = restype, argtypes
            # bound once: a decode step makes some 200 calls, each of which would otherwise look it up
            setattr(self, function, _with_pointers(c_function))
        self.describe()

    def describe(self) -> None:
        self.runs_here = bool(self.kernel_runs_here())
        self.isa, self.lanes, self.panel = self.kernel_isa().decode(), self.kernel_lanes(), self.kernel_panel()
        self.int_panel = self.kernel_int_panel()  # (integer codes' panels are wider: tiles.h's PANEL_INT)
        # bfloat16 weights multiply x rounded to bfloat16 (AVX-512-BF16's dot products, tiles.h's BF16_DOT)
        self.bf16_dot = bool(self.kernel_bf16_dot())

    def bind(self, function: str, *first) -> Callable:
        """`function` with its first arguments fixed, made C values once (a layer's weights, which every
        step passes): a call converts only the rest."""
        call = functools.partial(getattr(self, function), *self.c_values(function, 0, first))
        call.held = first  # (the tensors whose pointers it holds)
        return call

    def c_values(self, function: str, start: int, args: tuple) -> tuple:
        """`function`'s arguments from position `start` on as C values (tensors as their pointers): passed
        as they are, at no cost per call. The tensors must outlive them."""
        argtypes = self.signatures[function][1 + start :]
        if len(args) > len(argtypes):
            raise TypeError(f"{function} takes {start + len(argtypes)} arguments, not {start + len(args)}")
        return tuple(kind(a.data_ptr() if isinstance(a, torch.Tensor) else a) for a, kind in zip(args, argtypes))

    def panels(self, weight: torch.Tensor, width: int | None = None, lead: int = 0) -> torch.Tensor:
        """Weights (..., out, in) as tiles.h's column panels in their own dtype, (..., out / width, groups,
        width, G): `width` output columns of every input row together (`self.panel` where it divides
        `out`, else one vector: `out` a multiple of `self.lanes`), and the rows in groups of G = 4 / bytes
        per weight (one 32-bit lane holds a column's G weights of a group), padded with zeros: `lead`
        rows before the first, the last group filled up."""
        *stack, out, inp = weight.shape
        width = width or (self.panel if out % self.panel == 0 else self.lanes)
        g = 4 // weight.element_size()
        groups = -(-(lead + inp) // g)
        weight = weight.detach()
        if groups * g != inp:  # (zeros as bits: float8 has no zero-fill kernels)
            bits = weight.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[weight.element_size()])
            padded = bits.new_zeros(*stack, out, groups * g)
            padded[..., lead : lead + inp] = bits
            weight = padded.view(weight.dtype)
        return weight.reshape(*stack, out // width, width, groups, g).transpose(-3, -2).contiguous()


def _with_pointers(c_function):
    """c_function, called with tensors passed as their data pointers."""
    tensor = torch.Tensor

    def call(*args):
        return c_function(*[a.data_ptr() if isinstance(a, tensor) else a for a in args])

    return call


class KernelLibrary:
    """One kernel source, `<name>.c` in this folder, and the signatures of its functions."""

    def __init__(self, name: str, signatures: dict[str, tuple]) -> None:
        self.name, self.signatures = name, signatures
        self.loaded: dict[Target, CpuKernel | Unavailable] = {}

    def get(self) -> CpuKernel | None:
        """The library built for the current target (`Target.from_env`), or None where it cannot be had."""
        kernel = self.load(Target.from_env())
        return kernel if isinstance(kernel, CpuKernel) else None

    def load(self, target: Target) -> CpuKernel | Unavailable:
        """The library built for `target`, or why it cannot be had (said once, as a warning)."""
        if target not in self.loaded:
            try:
                self.loaded[target] = _load(self, target)
            except Unavailable as e:
                logger.warning("CPU kernel %s unavailable (%s): using torch ops", self.name, e)
                self.loaded[target] = e
        return self.loaded[target]


def _load(library: KernelLibrary, target: Target) -> CpuKernel:
    path = build(library.name, target)
    try:
        kernel = target.open(path, library.signatures)
    except OSError as e:
        raise Unavailable(f"{path} does not load: {e}") from None
    if not kernel.runs_here:
        raise Unavailable(f"built for -march={target.march} ({kernel.isa}), which this CPU cannot run")
    return kernel


def build(name: str, target: Target) -> Path:
    """The shared library of `<name>.c` for `target`, from the cache. The first request for a library
    that is neither built nor failed builds every missing one at once (in parallel, a few seconds), under
    a lock file: processes starting together build them once."""
    compiler = shutil.which(target.compiler)
    if compiler is None:
        raise Unavailable(f"no C compiler: {target.compiler} not found; install gcc or set CC")
    folder = Path(target.cache) if target.cache else cache_dir()
    # read once: what is compiled is what the libraries' names were hashed from
    texts = {path.name: path.read_bytes() for path in sorted(SOURCES.glob("*.[ch]"))}
    outputs = {file: _outputs(file, texts, target, compiler, folder) for file in texts if file.endswith(".c")}
    built, failed = outputs[f"{name}.c"]
    if not built.exists() and not failed.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            missing = {file: out for file, out in outputs.items() if not out[0].exists() and not out[1].exists()}
            if missing:
                _compile(target, missing, texts, folder)
    if failed.exists():
        raise Unavailable(f"the build failed: {_first_error(failed.read_text())}; the compiler's output is in {failed}")
    return built


def _outputs(file: str, texts: dict[str, bytes], target: Target, compiler: str, folder: Path) -> tuple[Path, Path]:
    """Where the library of source `file` is kept, and where the compiler's output goes if its build
    fails (if it succeeds with warnings, they are in the library's `.out`): named by a hash of what the
    build depends on."""
    others = [text for name, text in texts.items() if name != file]  # (headers, and sources another includes)
    command = " ".join(target.command(Path(file), "")).encode()
    parts = [BUILD_FORMAT, texts[file], *others, command, _compiler_version(compiler), _cpu_flags()]
    key = hashlib.sha256(b"\0".join(parts))
    stem = Path(file).stem
    return folder / f"{stem}-{key.hexdigest()[:16]}.so", folder / f"{stem}-{key.hexdigest()[:16]}.log"


def _compile(target: Target, outputs: dict[str, tuple[Path, Path]], texts: dict[str, bytes], folder: Path) -> None:
    logger.warning(
        "building the CPU kernels for this machine (-march=%s), once: they are kept in %s", target.march, folder
    )
    # built in a folder of their own and renamed into place: a reader never sees half a file
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for file, text in texts.items():
            (Path(tmp) / file).write_bytes(text)
        running = {
            file: subprocess.Popen(
                target.command(Path(tmp) / file, f"{tmp}/{file}.so"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for file in outputs
        }
        for file, process in running.items():
            output = process.communicate()[0].decode(errors="replace").replace(f"{tmp}/", "")
            built, failed = outputs[file]
            if process.returncode == 0:
                if output:  # (warnings: kept beside the library, which the build tests read)
                    built.with_suffix(".out").write_text(output)
                os.replace(f"{tmp}/{file}.so", built)
            else:
                failed.write_text(" ".join(target.command(SOURCES / file, str(built))) + "\n" + output)


def _first_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines()[1:]]
    return next((line for line in lines if "error" in line), lines[0] if lines else "no output")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_serve" / "kernels"


@functools.cache
def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return b""


def _cpu_flags() -> bytes:
    """What -march=native depends on, so a cache shared between machines keeps one build per CPU."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""


# the OpenMP runtime torch and these kernels use (none if torch was built without it)
_openmp = ctypes.CDLL(None) if hasattr(ctypes.CDLL(None), "omp_pause_resource_all") else None
OMP_PAUSE_SOFT = 1


def set_thread_team(threads: int) -> None:
    """Sets the calling thread's OpenMP team size, which torch's ops and these kernels (through
    `torch.get_num_threads()`) take. Unlike `torch.set_num_threads` it leaves the process-wide MKL setting
    and other threads alone: two threads of one process can compute side by side on their own cores."""
    if _openmp is not None:
        torch.get_num_threads()  # (torch sets a thread's team size at its first op there: that comes first)
        _openmp.omp_set_num_threads(threads)


def release_thread_team() -> None:
    """Lets the calling thread's idle OpenMP team go to sleep (~0.4 us if it has none)."""
    if _openmp is not None:
        _openmp.omp_pause_resource_all(OMP_PAUSE_SOFT)


_buffers = threading.local()


def scratch(numel: int, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """A scratch buffer of at least `numel` elements, kept per thread, dtype and name across layers and
    steps: a fresh one each call would cost its page faults again."""
    key = f"{dtype}{name}"
    held = getattr(_buffers, key, None)
    if held is None or held.numel() < numel:
        held = torch.empty(numel, dtype=dtype)
        setattr(_buffers, key, held)
    return held
