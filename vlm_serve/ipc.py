"""Python objects over ZMQ sockets between the server's processes. Multiprocessing's pickler is used, so a
CPU tensor in shared memory (pixel values, vision embeddings) crosses as a file descriptor and a CUDA
tensor as an IPC handle, not as a copy of its data.

A file descriptor is not in the message itself: unpickling fetches it from the sender, through
multiprocessing's resource sharer (a thread of the sender that hands it over a socket, after an
authentication handshake). A receiver that stopped in the middle of that exchange would leave the sender's
thread printing a traceback, so `recv_pyobj` holds SIGINT and SIGTERM back until the message is read.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import zmq

from vlm_serve.process import stop_signals_deferred


def zmq_context() -> zmq.Context:
    """A context whose sockets drop the messages still unsent when they close. ZMQ's default is to wait
    for them forever, and a process stopping while a peer that has gone is sent to would never end: a
    context collected as its owner unwinds (a `return`, a SystemExit) closes its sockets."""
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    return context


def send_pyobj(socket: zmq.Socket, obj: Any, flags: int = 0) -> None:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    socket.send(buf.getvalue(), flags)


def recv_pyobj(socket: zmq.Socket, flags: int = 0) -> Any:
    """The next object on `socket`, read whole: a stop signal that arrives meanwhile is handled after."""
    data = socket.recv(flags)
    with stop_signals_deferred():
        return pickle.loads(data)
