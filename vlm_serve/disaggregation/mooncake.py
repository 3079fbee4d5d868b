"""The Mooncake transfer backend: KV and records written by Mooncake's transfer engine straight into the
decode rank's registered buffers, over TCP, or RDMA where `--disaggregation-ib-device` names a device.

Each rank starts one engine (P2P handshake: no metadata server) and registers its KV buffers, its
metadata buffer and a staging buffer for outgoing records, once. A sender's `send` hands the work to the
backend's transfer thread, so the scheduler never waits on the network. There, the slots are cut into
runs contiguous on both sides (with pages, whole pages at least), each run becomes one write per KV
buffer, and the writes go out in batches of at most `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` (1024)
pieces: the engine refuses more queued per peer, and a refused batch leaves the connection unusable.
With the last piece the record goes into the decode rank's metadata slot; once the batch is written
the decode side is told. A write that fails (-1: the peer is unreachable, or gone) fails the room, and
the decode side is told why, after any write already under way for the room.

Needs the `pd` extra (`pip install -e ".[pd]"`, the `mooncake-transfer-engine-non-cuda` wheel) and the
system library libibverbs1, which the engine links even for TCP.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from vlm_serve.disaggregation.bootstrap import Address
from vlm_serve.disaggregation.control import ControlBackend, Done, Failed, Sender, Timeouts
from vlm_serve.disaggregation.transfer import KVLayout, KVPoll, Mode

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

INSTALL = 'pip install -e ".[pd]" and apt-get install libibverbs1'
QUEUE_LIMIT_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
DEFAULT_QUEUE_LIMIT = 1024


def transfer_engine_class() -> type[TransferEngine]:
    """Mooncake's `TransferEngine`, or an ImportError that says how to install it."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # (read when the library loads; its info lines are many)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            f"the mooncake transfer backend needs Mooncake's transfer engine ({exc}): {INSTALL}; or choose "
            "--disaggregation-transfer-backend fake (no KV moves: for tests)"
        ) from exc
    return TransferEngine


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source starts, destination starts, lengths) of the runs over which both slot lists go up by one."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks)) if len(src) else breaks
    lengths = np.diff(np.concatenate((starts, [len(src)])))
    return src[starts], dst[starts], lengths


def pieces(here: KVLayout, there: KVLayout, src: list[int], dst: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that write slots `src` of `here` into slots
    `dst` of `there`: one piece per contiguous run and KV buffer."""
    starts, dst_starts, lengths = contiguous_runs(np.asarray(src, np.int64), np.asarray(dst, np.int64))
    slot_bytes = np.asarray(here.slot_bytes, np.int64)[:, None]
    srcs = np.asarray(here.buffer_ptrs, np.int64)[:, None] + starts * slot_bytes
    dsts = np.asarray(there.buffer_ptrs, np.int64)[:, None] + dst_starts * slot_bytes
    lens = np.broadcast_to(lengths * slot_bytes, srcs.shape)
    return srcs.ravel().tolist(), dsts.ravel().tolist(), lens.ravel().tolist()


class MooncakeBackend(ControlBackend):
    """A rank's end of PD transfers through Mooncake's transfer engine."""

    def __init__(
        self,
        mode: Mode,
        tp_rank: int,
        tp_size: int,
        host: str,
        layout: KVLayout,
        bootstrap: Address | None = None,
        ib_device: str | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.engine = _start_engine(host, ib_device)
        self._record = ctypes.create_string_buffer(max(1, layout.meta_slot_bytes))  # an outgoing record, staged
        self._regions = [
            *zip(layout.buffer_ptrs, layout.buffer_lens),
            (layout.meta_ptr, layout.meta_slots * layout.meta_slot_bytes),
            (ctypes.addressof(self._record), len(self._record)),
        ]
        for ptr, size in self._regions:
            if self.engine.register_memory(ptr, size) != 0:
                raise RuntimeError(f"Mooncake's transfer engine could not register {size} bytes at {ptr:#x}")
        self._stopping = False
        self.queue_limit = int(os.environ.get(QUEUE_LIMIT_ENV, DEFAULT_QUEUE_LIMIT))
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="pd-transfer", daemon=True)
        self._worker.start()
        session = f"{host}:{self.engine.get_rpc_port()}"
        super().__init__(mode, tp_rank, tp_size, host, layout, bootstrap, session, timeouts)

    def close(self) -> None:
        """Stops the transfer thread (writes not begun are dropped) and the control plane; the buffers are
        unregistered, so that no peer writes into them once their owner frees them."""
        if self._worker.is_alive():
            self._stopping = True
            self._jobs.put(None)
            self._worker.join()
            for ptr, _ in self._regions:
                self.engine.unregister_memory(ptr)
        super().close()

    def _transfer(self, sender: Sender, src: list[int], dst: list[int], record: bytes | None) -> None:
        self._jobs.put(lambda: self._write(sender, src, dst, record))

    def _notify(self, sender: Sender, msg: Failed) -> None:
        self._jobs.put(lambda: self._send(sender.peer_addr, msg))  # (after the room's writes already queued)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _write(self, sender: Sender, src: list[int], dst: list[int], record: bytes | None) -> None:
        """On the transfer thread: one `send`'s KV, and the record if it is the last."""
        dest = sender.dest
        there = dest.rank.layout
        srcs, dsts, lens = pieces(self.layout, there, src, dst)
        if record is not None and len(record) > there.meta_slot_bytes:
            reason = f"the metadata record takes {len(record)} bytes, the decode side's slot {there.meta_slot_bytes}"
            self._fail(sender, reason, tell=True)
            return
        if record:
            ctypes.memmove(self._record, record, len(record))
            srcs.append(ctypes.addressof(self._record))
            dsts.append(there.meta_ptr + dest.meta_index * there.meta_slot_bytes)
            lens.append(len(record))
        for i in range(0, len(lens), self.queue_limit):
            if sender.state == KVPoll.FAILED or self._stopping:  # (aborted, or closing: the rest is not needed)
                return
            batch = slice(i, i + self.queue_limit)
            status = self.engine.batch_transfer_sync_write(dest.rank.session, srcs[batch], dsts[batch], lens[batch])
            if status != 0:
                reason = f"writing KV to the decode rank at {dest.rank.session} failed (unreachable or gone?)"
                self._fail(sender, reason, tell=True)
                return
            sender.bytes_sent += sum(lens[batch])
        if record is not None:
            self._succeed(sender, Done(sender.room, len(record)))


def _start_engine(host: str, ib_device: str | None) -> TransferEngine:
    """An engine listening on `host`: RDMA on `ib_device` where one is given, else TCP."""
    engine = transfer_engine_class()()
    protocol = "rdma" if ib_device else "tcp"
    # Its start-up always logs an error ("Local segment descriptor not found"), harmless: what it writes
    # to stderr meanwhile is shown only if it fails.
    with tempfile.TemporaryFile("w+") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            status = engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if status != 0:
            log.seek(0)
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host} ({protocol}): {log.read().strip()}")
    return engine
