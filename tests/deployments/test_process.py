"""Starting child processes: they ignore Ctrl-C from birth (the launcher decides how they stop), and a
SIGTERM never lands in the middle of a start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import run_process
from vlm_serve.process import starting_children

pytestmark = pytest.mark.server  # every test here starts processes


def test_children_started_in_the_block_ignore_ctrl_c_and_a_sigterm_waits_for_its_end():
    terminated: list[int] = []
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # (pytest may run with SIGINT ignored)
    sigterm = signal.signal(signal.SIGTERM, lambda s, f: terminated.append(s))
    try:
        with starting_children():
            child = subprocess.run(  # (not `run_process`, which gives the child Ctrl-C back)
                [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
                capture_output=True,
                text=True,
            )
            os.kill(os.getpid(), signal.SIGTERM)
            assert terminated == []
        assert terminated == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process takes Ctrl-C again
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, sigint)
    assert child.stdout == "True\n"


def test_a_child_stopped_while_it_exits_ends_with_its_own_code_and_no_second_traceback():
    """(A launcher stopping an encoder rank whose start had just failed printed "cannot release un-acquired
    lock" from inside the rank's log flush.)"""
    script = """
import logging, os, signal
from vlm_serve.process import exit_now, init_child_process
init_child_process("exiting")
flush = logging.shutdown
logging.shutdown = lambda: (os.kill(os.getpid(), signal.SIGTERM), flush())
exit_now(3)
"""
    child = run_process([sys.executable, "-c", script], capture_output=True, text=True)
    assert (child.returncode, child.stderr) == (3, "")
