"""The ZMQ addresses of the server's channels, and free TCP ports."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_serve.vision.pool import PoolAddresses


@dataclass
class PortArgs:
    """ZMQ addresses of the server's channels (ipc:// sockets in a private temporary folder)."""

    scheduler_input: str  # HTTP process -> scheduler rank 0
    detokenizer_input: str  # scheduler rank 0 -> detokenizer
    tokenizer_input: str  # detokenizer -> HTTP process
    encoder: PoolAddresses | None = None  # the encoder pool (scheduler rank 0 <-> encoder ranks)


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
