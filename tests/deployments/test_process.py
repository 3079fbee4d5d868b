"""Starting child processes: they are deaf to Ctrl-C from birth (the launcher decides how they stop), and a
stop signal never lands in the middle of a start, nor is lost there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers import run_process
from vlm_serve.process import starting_children

pytestmark = pytest.mark.server  # every test here starts processes


def test_children_started_in_the_block_are_born_with_the_stop_signals_blocked_and_this_process_handles_them_after_it():
    handled: list[int] = []
    sigint = signal.signal(signal.SIGINT, lambda s, f: handled.append(s))
    sigterm = signal.signal(signal.SIGTERM, lambda s, f: handled.append(s))
    try:
        with starting_children():
            child = subprocess.run(  # (not `run_process`, which gives the child Ctrl-C back)
                [
                    sys.executable,
                    "-c",
                    "import signal; print(sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))))",
                ],
                capture_output=True,
                text=True,
            )
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            assert handled == []
        assert sorted(handled) == [signal.SIGINT, signal.SIGTERM]  # neither is lost
        assert not set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) & {signal.SIGINT, signal.SIGTERM}
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, sigint)
    assert child.stdout == f"{sorted([int(signal.SIGINT), int(signal.SIGTERM)])}\n"


def test_a_child_drops_the_ctrl_c_of_its_birth_and_obeys_its_sigterm_once_its_handlers_are_set():
    script = """
import sys
from vlm_serve.process import init_child_process
sys.stdin.readline()  # (the test has sent its signals)
try:
    init_child_process("born-blocked")
except SystemExit:
    print("stopped by SIGTERM")
    raise
print("not stopped")
"""
    with starting_children():
        child = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        child.send_signal(signal.SIGINT)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert (child.returncode, out, err) == (0, "stopped by SIGTERM\n", "")


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
