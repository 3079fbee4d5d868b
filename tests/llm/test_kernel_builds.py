"""How the CPU kernels are built: from the same sources for every ISA users have (x86-64 levels v2, v3
and v4 on any x86 machine, aarch64 where a cross compiler is installed); once per machine, by one of the
processes starting together; and a kernel that cannot be had is one line saying which and why, never
the compiler's output, with a failed build remembered rather than tried again at every start."""

from __future__ import annotations

import logging
import platform
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import start_process
from vlm_serve.llm.kernels import SOURCES, CpuKernel, KernelLibrary, Target, Unavailable, build, linear_cpu

KERNELS = sorted(source.stem for source in SOURCES.glob("*.c"))


def matrix() -> list:
    """(compiler, -march) pairs every kernel must build for."""
    x86 = "cc" if platform.machine() == "x86_64" else "x86_64-linux-gnu-gcc"
    arm = "cc" if platform.machine() == "aarch64" else "aarch64-linux-gnu-gcc"
    pairs = [(x86, level) for level in ("x86-64-v2", "x86-64-v3", "x86-64-v4")]
    pairs += [(arm, "armv8-a"), (arm, "armv8.2-a+sve")]  # (with SVE enabled, the NEON code still builds)
    return [
        pytest.param(
            compiler,
            march,
            id=march,
            marks=[]
            if shutil.which(compiler)
            else [pytest.mark.skip(reason=f"{compiler} not installed (apt-get install gcc-aarch64-linux-gnu)")],
        )
        for compiler, march in pairs
    ]


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("compiler,march", matrix())
def test_every_kernel_builds_for_every_isa_without_a_warning(compiler, march):
    """Each source built for the ISA as any process builds it (all at once, into this machine's kernel
    cache, once per version of the sources and compiler); the compiler must say nothing at all: warnings
    are bugs waiting for another ISA."""
    target = Target(compiler, march, "")
    for name in KERNELS:
        built = build(name, target)  # (Unavailable, naming the first error, where it fails)
        said = built.with_suffix(".out")
        assert built.exists() and not said.exists(), f"{name} for -march={march}:\n{said.read_text()}"


@pytest.fixture
def compiler_log(tmp_path) -> Path:
    """A file each compiler call below appends its arguments to."""
    return tmp_path / "calls"


def fake_compiler(tmp_path: Path, log: Path, body: str) -> str:
    path = tmp_path / "fake-cc"
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "fake 1.0" && exit 0\necho "$@" >> {log}\n{body}\n')
    path.chmod(0o755)
    return str(path)


def test_a_failed_build_is_one_line_naming_the_first_error_and_is_not_tried_again(tmp_path, compiler_log, caplog):
    broken = fake_compiler(
        tmp_path,
        compiler_log,
        textwrap.dedent("""\
        echo "In file included from linear_cpu.c:8:" >&2
        echo "tiles.h:37:9: error: impossible constraint in 'asm'" >&2
        echo "tiles.h:40:9: error: something else" >&2
        exit 1"""),
    )
    target = Target(broken, "native", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING, logger="vlm_serve.llm.kernels")

    first = KernelLibrary("linear_cpu", linear_cpu.LIBRARY.signatures)
    assert isinstance(first.load(target), Unavailable)
    assert first.load(target) is first.load(target)  # (said once per process)
    unavailable = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(unavailable) == 1 and "\n" not in unavailable[0]
    assert "linear_cpu" in unavailable[0] and "tiles.h:37:9: error: impossible constraint in 'asm'" in unavailable[0]
    assert "something else" not in unavailable[0]
    builds = compiler_log.read_text().count("\n")
    assert builds == len(KERNELS)  # every kernel tried once, together

    again = KernelLibrary("linear_cpu", linear_cpu.LIBRARY.signatures)  # as in the next process started
    assert isinstance(again.load(target), Unavailable)
    assert compiler_log.read_text().count("\n") == builds


def test_without_a_compiler_the_line_says_so(tmp_path, caplog):
    target = Target(str(tmp_path / "no-such-cc"), "native", str(tmp_path))
    library = KernelLibrary("linear_cpu", linear_cpu.LIBRARY.signatures)
    assert isinstance(library.load(target), Unavailable)
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU kernel linear_cpu unavailable (no C compiler: {tmp_path / 'no-such-cc'} not found; install gcc or set "
        "CC): using torch ops"
    ]


def test_a_build_this_cpu_cannot_run_is_not_used(tmp_path, monkeypatch, native_kernels):
    """(A cache shared with another machine, or $VLM_SERVE_CPU_MARCH naming an ISA this CPU lacks.)"""
    describe = CpuKernel.describe

    def built_for_another_cpu(kernel: CpuKernel) -> None:
        describe(kernel)
        kernel.runs_here = False

    monkeypatch.setattr(CpuKernel, "describe", built_for_another_cpu)
    library = KernelLibrary("linear_cpu", linear_cpu.LIBRARY.signatures)
    reason = library.load(Target.from_env())
    assert isinstance(reason, Unavailable) and "which this CPU cannot run" in str(reason)


def test_a_build_that_warns_keeps_what_the_compiler_said_beside_the_library(tmp_path, compiler_log):
    warns = fake_compiler(
        tmp_path,
        compiler_log,
        textwrap.dedent("""\
        echo "linear_cpu.c:3:5: warning: unused variable 'x'" >&2
        for a; do [ "$prev" = -o ] && echo built > "$a"; prev="$a"; done"""),
    )
    built = build("linear_cpu", Target(warns, "native", str(tmp_path / "cache")))
    assert built.read_text() == "built\n"
    assert built.with_suffix(".out").read_text() == "linear_cpu.c:3:5: warning: unused variable 'x'\n"


@pytest.mark.server
@pytest.mark.slow
def test_processes_starting_together_build_the_kernels_once(tmp_path, compiler_log, native_kernels):
    """(The compiler here takes a second per library and hands out this machine's own builds.)"""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    for name in KERNELS:
        shutil.copy(build(name, Target.from_env()), prebuilt / f"{name}.so")
    counting = fake_compiler(
        tmp_path,
        compiler_log,
        textwrap.dedent(f"""\
        for a; do [ "$prev" = -o ] && out="$a"; case "$a" in *.c) source="$a";; esac; prev="$a"; done
        sleep 1
        cp {prebuilt}/"$(basename "$source" .c)".so "$out"
        """),
    )
    start = textwrap.dedent(f"""\
        from vlm_serve.llm.kernels import Target, linear_cpu
        assert not isinstance(linear_cpu.LIBRARY.load(Target({counting!r}, "native", {str(tmp_path / "cache")!r})), Exception)
    """)
    processes = [start_process([sys.executable, "-c", start]) for _ in range(3)]
    assert [p.wait(timeout=300) for p in processes] == [0, 0, 0]
    assert compiler_log.read_text().count("\n") == len(KERNELS)
