"""The install sizes docs/cpu.md states are what the installed packages take (benchmarks/install_sizes.py
measures them from their file lists): a dependency that grows or shrinks makes this fail until the figure
is updated."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {  # each measured size, and where docs/cpu.md states it
    "base": r"The install takes ([\d.]+) GB",
    "torch": r"torch ([\d.]+) GB",
    "triton": r"triton ([\d.]+) GB",
    "transformers": r"transformers ([\d.]+) GB",
    "demo": r"demo extra adds ([\d.]+) GB",
    "test": r"test\s+extra ([\d.]+) GB",
}


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("install_sizes", ROOT / "benchmarks" / "install_sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sizes()


@pytest.mark.slow  # (measuring takes a few seconds)
@pytest.mark.parametrize("name", list(FIGURES))
def test_the_stated_size_is_the_measured_one(name, measured):
    found = re.search(FIGURES[name], (ROOT / "docs" / "cpu.md").read_text())
    assert found, f"docs/cpu.md no longer states the {name} size"
    stated = float(found.group(1))
    assert abs(stated - measured[name]) <= max(0.05, 0.1 * measured[name]), (
        f"docs/cpu.md says {stated} GB for {name}; the packages installed take {measured[name]:.2f} GB"
    )
