"""The code reads one way: ruff's linter (pyflakes, import order) and formatter, as pyproject.toml sets them,
find nothing to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # every test here runs ruff

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing_to_change(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
