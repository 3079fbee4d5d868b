"""Messages between the server's processes: a stop signal never cuts the reading of one in half.

Reading a message that holds shared-memory tensors fetches their file descriptors from the sender's
process (multiprocessing's resource sharer); a receiver stopped in the middle left the sender printing
a traceback. Here unpickling sends the signal itself, as Ctrl-C or SIGTERM landing during the fetch."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator

import pytest
import zmq

from helpers import run_process
from vlm_serve.ipc import recv_pyobj, send_pyobj

_unpickled: list[str] = []  # what each `_SignalledWhileRead` got to do, in order


class _SignalledWhileRead:
    """Unpickled, it sends `sig` to this process, then finishes, or fails as a fetch from a sender that
    has exited does."""

    def __init__(self, sig: signal.Signals, fails: bool = False) -> None:
        self.sig, self.fails = sig, fails

    def __setstate__(self, state: dict) -> None:
        os.kill(os.getpid(), state["sig"])
        if state["fails"]:
            raise ConnectionResetError("the sender is gone")
        _unpickled.append("whole")


@pytest.fixture
def channel() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://messages")
    push.connect("inproc://messages")
    yield push, pull
    context.destroy(linger=0)


@pytest.fixture
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM raises SystemExit, as in the server's child processes (`init_child_process`), and SIGINT
    KeyboardInterrupt, as in a Python process that did not start with it ignored (pytest may have:
    `nohup pytest &`)."""

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(0)

    sigterm = signal.signal(signal.SIGTERM, exit_)
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, sigterm)
    signal.signal(signal.SIGINT, sigint)


@pytest.mark.parametrize(
    "sig, stop", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)], ids=["ctrl-c", "sigterm"]
)
def test_a_stop_signal_during_a_read_is_handled_once_the_message_is_whole(channel, stop_signals_raise, sig, stop):
    push, pull = channel
    _unpickled.clear()
    handler = signal.getsignal(sig)
    send_pyobj(push, _SignalledWhileRead(sig))
    with pytest.raises(stop):
        recv_pyobj(pull)
    assert _unpickled == ["whole"]
    assert signal.getsignal(sig) is handler


def test_a_stop_wins_over_the_failed_read_it_came_with(channel, stop_signals_raise):
    """Stopped together with the sender of a message it was reading: the receiver stops, quietly, rather
    than failing on the sender's absence."""
    push, pull = channel
    send_pyobj(push, _SignalledWhileRead(signal.SIGTERM, fails=True))
    with pytest.raises(SystemExit):
        recv_pyobj(pull)


@pytest.mark.server
def test_a_process_ends_although_its_last_message_was_never_read(tmp_path):
    """A server's child that stops while a peer that has gone is sent to (an encoder rank whose pool's
    scheduler was killed): the context is collected as the function returns, and the process ends."""
    program = f"""
import zmq
from vlm_serve.ipc import zmq_context

def send_to_nobody():
    context = zmq_context()
    socket = context.socket(zmq.PUSH)
    socket.connect("ipc://{tmp_path}/nobody")
    socket.send(b"never read")

send_to_nobody()
"""
    run_process([sys.executable, "-c", program], check=True, timeout=60)
