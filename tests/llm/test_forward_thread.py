"""The overlap loop's forward thread: once idle it lets its OpenMP team go (so that the forwards of another
engine in the same process do not run beside more OpenMP threads than cores), and work queued afterwards
still runs, in order."""

from __future__ import annotations

import threading
import time
import types

import torch

from vlm_serve.llm import overlap


def test_an_idle_forward_thread_releases_its_openmp_team_and_still_takes_work(monkeypatch):
    released = threading.Event()
    callers = []

    def release():
        callers.append(threading.current_thread().name)
        released.set()

    monkeypatch.setattr(overlap, "release_thread_team", release)
    thread = overlap.ForwardThread(types.SimpleNamespace(device=torch.device("cpu")), forward=lambda batch: batch)
    try:
        assert thread.submit(lambda: "first").result(timeout=10) == "first"
        assert released.wait(timeout=10 + overlap.IDLE_RELEASE_S)
        assert callers[0] == "forward"
        ran = [thread.submit(lambda i=i: i) for i in range(3)]
        assert [f.result(timeout=10) for f in ran] == [0, 1, 2]
    finally:
        thread.shutdown()


def test_a_busy_forward_thread_keeps_its_team(monkeypatch):
    calls = []
    monkeypatch.setattr(overlap, "release_thread_team", lambda: calls.append(1))
    thread = overlap.ForwardThread(types.SimpleNamespace(device=torch.device("cpu")), forward=lambda batch: batch)
    try:
        # all queued at once: once it has the first, the thread never waits for work
        work = [thread.submit(time.sleep, overlap.IDLE_RELEASE_S / 10) for _ in range(20)]
        work[0].result(timeout=10)
        calls.clear()  # (it may have waited for the first longer than that)
        work[-1].result(timeout=10)
        assert calls == []
    finally:
        thread.shutdown()
