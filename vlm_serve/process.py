"""What every child process of the server does first: take a name that `ps` and `top` show, and leave
Ctrl-C to the launcher."""

from __future__ import annotations

import ctypes
import signal
from typing import Any

_PR_SET_NAME = 15


def init_child_process(name: str) -> None:
    """Names the process (at most 15 characters show) and lets the launcher decide how it stops: Ctrl-C
    reaches the whole process group, so it is ignored here; SIGTERM (the launcher's request) exits
    through `finally` blocks."""
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
