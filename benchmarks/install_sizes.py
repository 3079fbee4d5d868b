"""What installing vlm_serve takes on disk, measured from the installed packages' own file lists: the base
install (torch, triton and transformers apart), and what the demo and test extras add to it. docs/cpu.md
states these figures; tests/project/test_install_sizes.py fails when they drift from this measurement.

    python benchmarks/install_sizes.py
"""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

GB = 1e9


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: str, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """What `dist` requires (with `extras`) on this machine: requirements whose markers hold here."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        envs = [{"extra": extra} for extra in ("", *extras)]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def closure(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """`dist` and every installed distribution it pulls in, with `extras`, by canonical name."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonical(name)
        if key in seen and not wanted:
            continue
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # (a requirement this machine does not have installed)
        seen.add(key)
        todo.extend((req.name, tuple(req.extras)) for req in requirements(name, wanted))
    return seen


def size(name: str) -> int:
    """The bytes of a distribution's installed files (its RECORD)."""
    total = 0
    for file in metadata.distribution(name).files or []:
        path = file.locate()
        if path.is_file():
            total += path.stat().st_size
    return total


def sizes() -> dict[str, float]:
    """In GB: the base install, and within it torch (with what it pulls in that nothing else of ours needs
    first: sympy, networkx ...), triton and transformers; what the demo extra adds to it; what the test
    extra adds to the base and the demo."""
    base = closure("vlm_serve")
    demo = closure("vlm_serve", ("demo",)) - base
    test = closure("vlm_serve", ("test",)) - base - demo
    torch = closure("torch") - {"triton"}
    gb = lambda names: sum(size(n) for n in names) / GB  # noqa: E731
    return {
        "base": gb(base),
        "torch": gb(torch),
        "triton": gb({"triton"} & base),
        "transformers": gb({"transformers"} & base),
        "demo": gb(demo),
        "test": gb(test),
    }


if __name__ == "__main__":
    for name, gigabytes in sizes().items():
        print(f"{name}: {gigabytes:.2f} GB")
