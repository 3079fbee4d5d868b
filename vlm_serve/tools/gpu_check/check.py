"""What every part writes: its results as they come (`Check`: named pass/fail lines and figures under OUT),
and the environment a run records."""

from __future__ import annotations

import importlib.util
import json
import platform
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


class Check:
    """Collects a part's results: named pass/fail lines and figures, written to OUT as they come."""

    def __init__(self, out: Path, part: str) -> None:
        self.out, self.part = out, part
        self.results: list[dict] = []

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append({"name": name, "ok": ok, "detail": detail})
        print(f"[{self.part}] {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        (self.out / f"{self.part}.json").write_text(json.dumps(self.results, indent=1))

    def run(self, name: str, fn: Callable[[], str | None]) -> None:
        """`fn()` passes unless it raises; what it returns is the detail."""
        try:
            self.record(name, True, fn() or "")
        except Exception as exc:  # noqa: BLE001 - every failure is a result to report, not a stop
            self.record(name, False, f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            with open(self.out / f"{self.part}.log", "a") as log:
                log.write(f"---- {name}\n{traceback.format_exc()}\n")


def environment(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "flashinfer": importlib.util.find_spec("flashinfer") is not None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        info.update(cpu=platform.processor() or platform.machine())
    return info
