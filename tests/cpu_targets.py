"""The ISAs the CPU kernels are tested for: the widest this machine runs (`-march=native`), x86-64-v3
(AVX2 + FMA) on any x86 machine, and aarch64 (NEON) under qemu-user where its cross compiler and qemu are
installed; where the CPU has AVX-512-BF16, native both ways for bfloat16 weights: multiplying x rounded to
bfloat16 with its dot products (the default) and widened to float32 (`$VLM_SERVE_CPU_BF16_DOT=0`). A kernel that does not build for one of them
fails the test that needs it.

An aarch64 library cannot be loaded into this x86 process, so it is driven from one: a small aarch64
program (generated from the library's signatures) loads it under qemu-aarch64 and runs each call sent
to it over a pipe, the tensor arguments' bytes going there and back. The kernels' Python wrappers run
unchanged, on either kind of library.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import as_test_child, run_process
from vlm_serve.llm.kernels import (
    COMMON,
    F32,
    I32,
    I64,
    PTR,
    STR,
    CpuKernel,
    KernelLibrary,
    Target,
    Unavailable,
    _cpu_flags,
    attention_cpu,
    decoder_cpu,
    linear_cpu,
    lora_cpu,
    moe_cpu,
    rowwise_cpu,
)

LIBRARIES = [
    linear_cpu.LIBRARY,
    moe_cpu.LIBRARY,
    attention_cpu.LIBRARY,
    rowwise_cpu.LIBRARY,
    decoder_cpu.LIBRARY,
    lora_cpu.LIBRARY,
]
CROSS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"  # the cross compiler's libc and libgomp, for qemu to load
DRIVERS: list[subprocess.Popen] = []  # the running drivers of the loaded libraries: they end with pytest


class EmulatedTarget(Target):
    """aarch64 kernels built by the cross compiler, run under qemu-aarch64."""

    def open(self, path: Path, signatures: dict[str, tuple]) -> CpuKernel:
        return EmulatedKernel(path, signatures)


class EmulatedKernel(CpuKernel):
    """A kernel library run by a driver program under qemu: calls go over its stdin, results come back
    over its stdout (what `driver_source` reads and writes)."""

    def __init__(self, path: Path, signatures: dict[str, tuple]) -> None:
        self.signatures = {**COMMON, **signatures}
        text = driver_source(self.signatures)
        driver = path.with_suffix(f".{hashlib.sha256(text.encode()).hexdigest()[:8]}.driver")
        if not driver.exists():
            source = driver.with_suffix(".c")
            source.write_text(text)
            run_process([CROSS[0], "-O1", str(source), "-o", str(driver), "-ldl"], check=True, capture_output=True)
        command = [CROSS[1], "-L", SYSROOT, str(driver), str(path)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=as_test_child
        )  # (not `start_process`: the loaded library keeps it, and it ends with its stdin, as pytest exits)
        DRIVERS.append(self.process)
        self.describe()

    def bind(self, function: str, *first):
        return functools.partial(getattr(self, function), *first)  # (tensors, sent at every call)

    def c_values(self, function: str, start: int, args: tuple) -> tuple:
        return args

    def __getattr__(self, function: str):  # (the library's functions: relayed to the driver)
        if function not in self.__dict__.get("signatures", {}):
            raise AttributeError(function)
        return lambda *args: self.invoke(function, args)

    def invoke(self, function: str, args: tuple):
        restype, *argtypes = self.signatures[function]
        request, buffers = [struct.pack("<i", list(self.signatures).index(function))], []
        for arg, kind in zip(args, argtypes, strict=True):
            if kind is PTR and arg is None:
                request.append(struct.pack("<q", -1))
            elif kind is PTR:
                buffers.append(storage_from(arg))
                request += [struct.pack("<q", buffers[-1].numel()), buffers[-1].numpy().tobytes()]
            else:
                request.append(struct.pack({I64: "<q", I32: "<i", F32: "<f"}[kind], arg))
        self.process.stdin.write(b"".join(request))
        self.process.stdin.flush()
        for buffer in buffers:
            buffer.copy_(torch.frombuffer(bytearray(self.read(buffer.numel())), dtype=torch.uint8))
        if restype is STR:
            return self.read(struct.unpack("<q", self.read(8))[0])
        value = struct.unpack("<q", self.read(8))[0]
        return None if restype is None else value

    def read(self, n: int) -> bytes:
        data = self.process.stdout.read(n)
        if len(data) != n:
            raise RuntimeError(f"the emulated kernel stopped (exit code {self.process.poll()})")
        return data


def storage_from(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's storage from its first element on (what a kernel may reach through its
    pointer), as a uint8 tensor sharing that memory."""
    storage = tensor.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    return whole[tensor.data_ptr() - storage.data_ptr() :]


def driver_source(signatures: dict[str, tuple]) -> str:
    """A C program that loads the library named by its argument and, for each request on stdin (the
    function's index, then each argument: pointers as a byte count (-1 for NULL) and the bytes), calls
    the function and writes back every buffer and the result."""
    ctype = {PTR: "void *", I64: "int64_t", I32: "int", F32: "float", STR: "const char *", None: "void"}
    read = {PTR: "ptr()", I64: "i64()", I32: "i32()", F32: "f32()"}
    cases = []
    for index, (name, (restype, *argtypes)) in enumerate(signatures.items()):
        args = [f"{ctype[kind]} a{i} = {read[kind]};" for i, kind in enumerate(argtypes)]
        pointer = f'({ctype[restype]} (*)({", ".join(ctype[k] for k in argtypes) or "void"}))dlsym(lib, "{name}")'
        call = f"({pointer})({', '.join(f'a{i}' for i in range(len(argtypes)))})"
        result = {None: f"{call};", STR: f"text = {call};"}.get(restype, f"value = {call};")
        cases.append(f"        case {index}: {{ {' '.join(args)} {result} break; }}")
    return DRIVER.replace("CASES", "\n".join(cases))


DRIVER = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *held[64];
static int64_t sizes[64];
static int count;

static void get(void *p, size_t n) { if (fread(p, 1, n, stdin) != n) exit(0); }
static void *ptr(void) {
    int64_t n;
    get(&n, 8);
    if (n < 0) return NULL;
    void *p = aligned_alloc(64, (n + 64) / 64 * 64);
    get(p, n);
    held[count] = p, sizes[count++] = n;
    return p;
}
static int64_t i64(void) { int64_t v; get(&v, 8); return v; }
static int i32(void) { int32_t v; get(&v, 4); return v; }
static float f32(void) { float v; get(&v, 4); return v; }

int main(int argc, char **argv) {
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (lib == NULL) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    for (;;) {
        int32_t function;
        get(&function, 4);
        int64_t value = 0;
        const char *text = NULL;
        count = 0;
        switch (function) {
CASES
        default: return 2;
        }
        for (int i = 0; i < count; i++) fwrite(held[i], 1, sizes[i], stdout), free(held[i]);
        if (text != NULL) {
            int64_t n = strlen(text);
            fwrite(&n, 8, 1, stdout), fwrite(text, 1, n, stdout);
        } else {
            fwrite(&value, 8, 1, stdout);
        }
        fflush(stdout);
    }
}
"""


def targets() -> list:
    """pytest params: one per ISA the kernels are tested for here."""
    native = Target.from_env()
    params = [pytest.param(native, id="native")]
    if "avx512_bf16" in _cpu_flags().decode().split():  # (bfloat16 weights the other way too, tiles.h's BF16_DOT)
        other = "native-widened" if native.bf16_dot else "native-bf16-dot"
        params.append(pytest.param(native._replace(bf16_dot=not native.bf16_dot), id=other))
    if platform.machine() == "x86_64":
        params.append(pytest.param(Target.from_env()._replace(march="x86-64-v3"), id="x86-64-v3"))
    if platform.machine() != "aarch64":
        missing = [tool for tool in CROSS if shutil.which(tool) is None]
        marks = [pytest.mark.server]  # (its kernels run in a driver process under qemu)
        if missing:
            marks.append(pytest.mark.skip(reason=f"{' and '.join(missing)} not installed"))
        emulated = EmulatedTarget(CROSS[0], "armv8-a", Target.from_env().cache)
        params.append(pytest.param(emulated, id="aarch64-qemu", marks=marks))
    return params


def require_kernels(target: Target, libraries: list[KernelLibrary] = LIBRARIES) -> None:
    """Fails the test, naming the reason, where a kernel does not build for `target` (skips it only where
    there is no C compiler at all)."""
    if shutil.which(target.compiler) is None:
        pytest.skip(f"no C compiler ({target.compiler} not found)")
    for library in libraries:
        kernel = library.load(target)
        if isinstance(kernel, Unavailable):
            pytest.fail(f"CPU kernel {library.name} for -march={target.march}: {kernel}")
