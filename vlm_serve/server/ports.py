"""The ZMQ addresses of the server's channels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_serve.encoder.pool import PoolAddresses


@dataclass
class PortArgs:
    """ZMQ addresses of the server's channels (ipc:// sockets in a private temporary folder)."""

    scheduler_input: str  # HTTP process -> scheduler rank 0
    detokenizer_input: str  # scheduler rank 0 -> detokenizer
    tokenizer_input: str  # detokenizer -> HTTP process
    encoder: PoolAddresses | None = None  # the encoder pool (scheduler rank 0 <-> encoder ranks)
