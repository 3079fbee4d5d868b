"""Starting and stopping the server's processes: SIGTERM or Ctrl-C stops every child silently (also
while it starts), a child that dies takes the server to unhealthy and then down, and a bad --config is
refused before anything starts."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from helpers import descendants, process_name, run_process, spawn_serve, start_server, survivors
from vlm_serve.server.http_server import ServerState, _Server

STOPS = {  # signal, sent to the whole process group
    "sigterm": (signal.SIGTERM, False),  # kill, docker stop
    "sigterm-to-group": (signal.SIGTERM, True),  # a service manager (systemd's default KillMode)
    "ctrl-c": (signal.SIGINT, True),  # a terminal
}


@pytest.mark.server
@pytest.mark.parametrize("vit_dp", [1, 2])
@pytest.mark.parametrize("stop", STOPS)
def test_a_stop_ends_the_server_and_every_child_silently(tiny_moe_dir, stop, vit_dp):
    """Exit code 0, no process left, and not a line printed after the signal: no encoder rank taken for
    dead and restarted, no child's exit taken for a failure, no leaked semaphore, no traceback."""
    server = start_server(tiny_moe_dir, "--vit-dp", str(vit_dp))
    children = descendants(server.process.pid)
    names = {process_name(pid) for pid in children}
    assert {"vlm-scheduler-0", "vlm-detokenizer", *(f"vlm-encoder-{i}" for i in range(vit_dp))} <= names
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    loads = [line.split()[0] for line in lines if line.startswith("vlm_serve:encoder_load")]
    assert loads == [f'vlm_serve:encoder_load_patches{{rank="{i}"}}' for i in range(vit_dp)]
    assert server.stop(*STOPS[stop]) == 0, "".join(server.output)
    assert server.after_stop == []
    assert survivors(children) == []


@pytest.mark.server
def test_ctrl_c_while_the_server_starts_stops_it_silently(tiny_moe_dir):
    """Ctrl-C while the model loads (and the encoder ranks' fork server imports torch): exit code 130, no
    process left, and no KeyboardInterrupt traceback from any of them."""
    server = spawn_serve(tiny_moe_dir, "--vit-dp", "2")
    deadline = time.monotonic() + 120
    while not any(process_name(pid) == "vlm-scheduler-0" for pid in descendants(server.process.pid)):
        assert server.process.poll() is None and time.monotonic() < deadline, "".join(server.output)
        time.sleep(0.05)
    children = descendants(server.process.pid)
    assert server.stop(signal.SIGINT, group=True) == 130, "".join(server.output)
    assert server.after_stop == []
    assert survivors(children) == []


class _ChildrenGone:
    """A server's children once they have all exited, as a signal to the whole process group leaves them."""

    encoders = None

    def __init__(self) -> None:
        self.restarts = 0

    def restart_encoders(self) -> None:
        self.restarts += 1

    def dead(self) -> str:
        return "the scheduler TP0 process exited (code 0)"


def test_children_that_exit_while_the_server_stops_are_neither_restarted_nor_a_failure():
    """The watchdog's side of a stop by a signal to the process group (which the tests above reach only
    when its tick falls in the server's shutdown)."""
    children, state, failed = _ChildrenGone(), ServerState(), []
    server = _Server(uvicorn.Config(app=None), SimpleNamespace(fail_all=failed.append), state, children)
    server.should_exit = True  # what uvicorn's handler of SIGTERM and SIGINT does
    asyncio.run(server.watch_children())
    assert children.restarts == 0 and state.failure == "" and failed == []


@pytest.mark.server
def test_a_child_that_dies_makes_the_server_unhealthy_then_stops_it(tiny_moe_dir):
    server = start_server(tiny_moe_dir, "--vit-dp", "1")
    children = descendants(server.process.pid)
    assert httpx.get(server.url + "/health").status_code == 200
    scheduler = next(pid for pid in children if process_name(pid) == "vlm-scheduler-0")
    os.kill(scheduler, signal.SIGKILL)
    statuses = []
    while server.process.poll() is None and len(statuses) < 100:
        try:
            statuses.append(httpx.get(server.url + "/health", timeout=1).status_code)
        except httpx.TransportError:
            break
        time.sleep(0.1)
    assert 503 in statuses
    assert server.process.wait(30) == 1
    assert "exited" in "".join(server.output)
    assert survivors(children) == []


@pytest.mark.server
def test_an_unknown_setting_in_the_config_file_is_refused_before_anything_starts(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_running_requests: 8\nno_such_setting: 1\n")
    result = run_process(
        [sys.executable, "-m", "vlm_serve.cli", "serve", "--config", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "no_such_setting" in result.stderr
