"""Starting and stopping the server's processes: SIGTERM stops every child, a child that dies takes
the server to unhealthy and then down, and a bad --config is refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from helpers import descendants, process_name, start_server


def _gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (OSError, IndexError):
        return "Z"


def test_sigterm_stops_the_server_and_every_child(tiny_moe_dir):
    server = start_server(tiny_moe_dir, "--vit-dp", "1")
    children = descendants(server.process.pid)
    names = {process_name(pid) for pid in children}
    assert {"vlm-scheduler-0", "vlm-detokenizer", "vlm-encoder-0"} <= names
    assert server.stop() == 0
    assert _gone(children), "children outlived the server"


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
    assert _gone(children), "children outlived the server"


def test_an_unknown_setting_in_the_config_file_is_refused_before_anything_starts(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_running_requests: 8\nno_such_setting: 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "vlm_serve.cli", "serve", "--config", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "no_such_setting" in result.stderr
