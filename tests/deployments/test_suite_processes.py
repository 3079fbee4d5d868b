"""The suite's rule for the processes its tests start: each takes Ctrl-C even where the suite itself was
started with SIGINT ignored (`nohup pytest &`, a background job of a script) and ends if pytest dies;
none outlives its test, failed or not; and one left running anyway fails the session, named."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import run_process, stop_processes, survivors

pytestmark = pytest.mark.server  # every test here starts processes (an inner pytest session, its children)

_CHILD = """
import ctypes, signal
PR_GET_PDEATHSIG = 2
on_parent_death = ctypes.c_int()
ctypes.CDLL("libc.so.6").prctl(PR_GET_PDEATHSIG, ctypes.byref(on_parent_death))
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, on_parent_death.value)
"""


def test_a_process_a_test_starts_takes_ctrl_c_though_pytest_ignores_it_and_gets_sigterm_when_pytest_dies():
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = run_process([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert child.stdout.split() == ["True", str(int(signal.SIGTERM))], child.stderr


_SESSION = """
import os, subprocess
from pathlib import Path
import pytest
from helpers import descendants, start_server, survivors

OUT = Path(os.environ["OUT"])


@pytest.mark.server
def test_fails_while_its_server_runs():
    server = start_server(Path(os.environ["MODEL"]), "--vit-dp", "1")
    (OUT / "server").write_text(" ".join(map(str, [server.process.pid, *descendants(server.process.pid)])))
    assert False, "failed with its server up"


def test_next_finds_none_of_its_processes_running():
    assert survivors([int(pid) for pid in (OUT / "server").read_text().split()], timeout=0) == []


@pytest.mark.server
def test_leaves_running_a_process_started_without_the_helpers():
    (OUT / "sleeper").write_text(str(subprocess.Popen(["sleep", "300"]).pid))


def test_runs_a_command_though_not_marked_server():
    subprocess.run(["true"], check=True)
"""


def test_a_failed_test_leaves_no_server_running_and_a_process_left_running_fails_the_session(tiny_moe_dir, tmp_path):
    """A session of four tests under this suite's conftest.py: one fails while its server (with its
    children) runs, and by the next test none of them is left; one leaves a process running that it
    started past the helpers, which fails the session at its end, named, and is stopped; one not marked
    `server` runs a command, which fails it."""
    (tmp_path / "test_session.py").write_text(_SESSION)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    server: starts processes\n")
    tests = str(Path(__file__).parent.parent)  # (the suite's conftest.py and helpers)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
        "MODEL": str(tiny_moe_dir),
        "OUT": str(tmp_path),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "test_session.py"]
    session = run_process(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    started = [int(pid) for name in ("server", "sleeper") for pid in (tmp_path / name).read_text().split()]
    try:
        summary = session.stdout.strip().splitlines()[-1]
        assert summary.startswith("2 failed, 2 passed, 1 error"), session.stdout
        assert "AssertionError: failed with its server up" in session.stdout
        assert "FAILED test_session.py::test_runs_a_command_though_not_marked_server" in session.stdout
        assert "the test started the command 'true' but is not marked `server`" in session.stdout
        sleeper = (tmp_path / "sleeper").read_text()
        assert f"processes left running by the tests (now stopped):\n{sleeper} sleep: sleep 300\n" in session.stdout
        assert survivors(started, timeout=0) == []
    finally:
        stop_processes(started)
