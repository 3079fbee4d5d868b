"""Python objects over ZMQ sockets between the server's processes. Multiprocessing's pickler is used, so a
CPU tensor in shared memory (pixel values, vision embeddings) crosses as a file descriptor and a CUDA
tensor as an IPC handle, not as a copy of its data."""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import zmq


def send_pyobj(socket: zmq.Socket, obj: Any, flags: int = 0) -> None:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    socket.send(buf.getvalue(), flags)


def recv_pyobj(socket: zmq.Socket, flags: int = 0) -> Any:
    return pickle.loads(socket.recv(flags))
