"""The control plane both transfer backends share: finding the peer rank, saying where the KV goes, and
learning how each room's transfer ended. Backends differ only in how bytes move (`_transfer`).

Decode rank r finds prefill rank r through the prefill server's bootstrap server (a thread per prefill
server looked up; the answer is kept for later rooms). The two ranks then talk over ZMQ: each rank binds
one PULL socket (its `control_addr`) and PUSHes to its peers'. Messages are JSON, each with its sender's
address:

- decode → prefill: `Destination` (room R's KV goes to these slots, its record to this metadata slot;
  the decode rank's `RankInfo` comes with it), and `Heartbeat` while the decode rank waits on the prefill
  rank, which answers in kind;
- prefill → decode: `Done` (every byte of R arrived; the record travels inside it where the backend did
  not write it into the metadata slot);
- either way: `Failed` (R failed or was aborted on the sender's side, and why).

A destination may arrive before the prefill scheduler has made the room's sender (the router sends the
request to both servers at once): it waits for it, for up to the waiting timeout, after which the decode
side is told that no such request came. A room that fails before its peer knows where it is leaves a note
for as long, so that a peer that turns up later is told at once. A live room's state is dropped as soon
as it ends, so a server that has seen millions of rooms holds only those in flight.

One control thread per rank reads the socket and, every `Timeouts.sweep` seconds, fails the rooms past
their deadlines, expires what waits for rooms that never came, and sends heartbeats. The scheduler's
calls (`poll`, `send`, `init`, `abort`) never wait on the network.

Timeouts, in seconds (`Timeouts.of`: from `--disaggregation-timeout`, the waiting one, and at most it):
- bootstrap (30): a decode rank finding its prefill rank;
- waiting (300): a prefill request waiting for its decode side's destination (the decode server may be
  full), and a destination waiting for its prefill request;
- heartbeat (10): a prefill rank silent this long is taken for dead, and the rooms waiting on it fail.
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import threading
import time
from abc import abstractmethod
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Union

import zmq

from vlm_serve.disaggregation.bootstrap import Address, RankInfo, lookup_rank, not_found, register_rank
from vlm_serve.disaggregation.transfer import KVLayout, KVPoll, KVReceiver, KVSender, Mode, TransferBackend
from vlm_serve.ipc import zmq_context
from vlm_serve.messages.backend import BootstrapInfo

if TYPE_CHECKING:
    from vlm_serve.config import DisaggregationSettings

logger = logging.getLogger(__name__)

ENDED = (KVPoll.SUCCESS, KVPoll.FAILED)


@dataclass(frozen=True)
class Timeouts:
    """How long each side waits, in seconds (see the module docstring)."""

    bootstrap: float = 30.0
    waiting: float = 300.0
    heartbeat: float = 10.0

    @classmethod
    def of(cls, settings: DisaggregationSettings) -> Timeouts:
        wait = settings.disaggregation_timeout
        return cls(bootstrap=min(cls.bootstrap, wait), waiting=wait, heartbeat=min(cls.heartbeat, wait))

    @property
    def sweep(self) -> float:
        """Seconds between the control thread's rounds of deadlines and heartbeats."""
        return min(0.5, self.bootstrap / 4, self.waiting / 4, self.heartbeat / 4)


@dataclass
class Destination:
    """Decode → prefill: room's KV goes to these slots (prompt positions 0, 1, ...), its record to the
    metadata slot `meta_index`, of the decode rank `rank`."""

    room: str
    slots: list[int]
    meta_index: int
    rank: RankInfo


@dataclass
class Done:
    """Prefill → decode: all of room's KV arrived, and its record of `record_len` bytes."""

    room: str
    record_len: int
    record: bytes | None = None  # the record itself, where the backend did not write it into the metadata slot


@dataclass
class Failed:
    """Either way: room failed, or was aborted, on the sender's side."""

    room: str
    reason: str


@dataclass
class Heartbeat:
    """Decode → prefill while rooms wait on the prefill rank, which answers with one."""


Message = Union[Destination, Done, Failed, Heartbeat]
MESSAGES: dict[str, type[Message]] = {cls.__name__: cls for cls in (Destination, Done, Failed, Heartbeat)}


def encode(src: str, msg: Message) -> bytes:
    body = asdict(msg)
    if isinstance(msg, Done) and msg.record is not None:
        body["record"] = base64.b64encode(msg.record).decode()
    return json.dumps({"src": src, "type": type(msg).__name__, "body": body}).encode()


def decode(data: bytes) -> tuple[str, Message]:
    """(sender's control address, message)"""
    envelope = json.loads(data)
    cls, body = MESSAGES[envelope["type"]], envelope["body"]
    if cls is Destination:
        body["rank"] = RankInfo.from_json(body["rank"])
    elif cls is Done and body["record"] is not None:
        body["record"] = base64.b64decode(body["record"])
    return envelope["src"], cls(**body)


class Sender(KVSender):
    def __init__(self, backend: ControlBackend, room: str) -> None:
        self.backend, self.room = backend, room
        self.state = KVPoll.BOOTSTRAPPING
        self.dest: Destination | None = None
        self.record_sent = False
        self.deadline = time.monotonic() + backend.timeouts.waiting

    @property
    def peer_addr(self) -> str | None:
        return None if self.dest is None else self.dest.rank.control_addr

    def poll(self) -> KVPoll:
        return self.state

    @property
    def num_slots(self) -> int:
        if self.dest is None:
            raise RuntimeError(f"room {self.room}: the decode side has not said where its KV goes yet")
        return len(self.dest.slots)

    def send(self, slots: list[int], start: int, meta: bytes | None = None) -> None:
        with self.backend.lock:
            if self.state == KVPoll.FAILED:
                return  # (the scheduler learns it from poll)
            if self.dest is None or self.record_sent:
                when = "before the decode side's destination" if self.dest is None else "after the record"
                raise RuntimeError(f"room {self.room}: send() {when}")
            if start < 0 or start + len(slots) > len(self.dest.slots):
                raise ValueError(
                    f"room {self.room}: positions {start}..{start + len(slots) - 1} are not in the prompt's "
                    f"{len(self.dest.slots)}"
                )
            self.state, self.record_sent = KVPoll.TRANSFERRING, meta is not None
            dst = self.dest.slots[start : start + len(slots)]
        self.backend._transfer(self, slots, dst, meta)

    def abort(self) -> None:
        self.backend._fail(self, "the prefill server aborted the request", tell=True)


class Receiver(KVReceiver):
    def __init__(self, backend: ControlBackend, bootstrap: BootstrapInfo) -> None:
        self.backend, self.room, self.bootstrap = backend, bootstrap.room, bootstrap
        self.state = KVPoll.BOOTSTRAPPING
        self.peer: RankInfo | None = None  # the prefill rank, once found
        self.meta_index = -1
        self.deadline = time.monotonic() + backend.timeouts.bootstrap

    @property
    def peer_addr(self) -> str | None:
        return None if self.peer is None else self.peer.control_addr

    def poll(self) -> KVPoll:
        return self.state

    def init(self, slots: list[int], meta_index: int) -> None:
        b = self.backend
        with b.lock:
            if self.state == KVPoll.FAILED:
                return
            if self.state != KVPoll.WAITING_FOR_INPUT:
                raise RuntimeError(f"room {self.room}: init() while {self.state.name}")
            if not 0 <= meta_index < b.layout.meta_slots:
                raise ValueError(f"room {self.room}: metadata slot {meta_index} not in 0..{b.layout.meta_slots - 1}")
            self.state, self.meta_index = KVPoll.TRANSFERRING, meta_index
            if not b._send(self.peer.control_addr, Destination(self.room, slots, meta_index, b.info)):
                b._fail(self, f"the prefill rank at {self.peer.control_addr} takes no more messages", tell=False)

    def abort(self) -> None:
        self.backend._fail(self, "the decode server aborted the request", tell=True)

    def timeout_reason(self) -> str:
        server = (self.bootstrap.host, self.bootstrap.port)
        return not_found(server, f"no prefill rank {self.backend.info.tp_rank} found", self.backend.timeouts.bootstrap)


@dataclass
class _Early:
    """Prefill side: what came for a room that has no sender (yet, or any more), until `deadline`."""

    deadline: float
    dest: Destination | None = None  # the decode side's, waiting for the room's sender
    failure: str | None = None  # why the room failed: a destination that comes later is told


class ControlBackend(TransferBackend):
    """One rank's end of the control plane; a subclass moves the bytes (`_transfer`)."""

    def __init__(
        self,
        mode: Mode,
        tp_rank: int,
        tp_size: int,
        host: str,
        layout: KVLayout,
        bootstrap: Address | None = None,
        session: str = "",
        timeouts: Timeouts | None = None,
    ) -> None:
        """Binds this rank's control socket on `host` and starts the control thread; a prefill rank then
        registers with the bootstrap server at `bootstrap` (if given)."""
        self.mode, self.layout = mode, layout
        self.timeouts = timeouts or Timeouts()
        self.lock = threading.RLock()  # the rooms and every state in them
        self._rooms: dict[str, Sender | Receiver] = {}  # live ones
        self._early: dict[str, _Early] = {}
        self._lookups: dict[Address, Future[RankInfo]] = {}  # decode: each prefill server's rank, found or being
        self._heard: dict[str, float] = {}  # decode: when each prefill rank that rooms wait on last spoke
        self._ctx = zmq_context()
        self._inbox = self._ctx.socket(zmq.PULL)
        port = self._inbox.bind_to_random_port(f"tcp://{host}")
        self.info = RankInfo(tp_rank, tp_size, f"tcp://{host}:{port}", session, layout)
        self._outboxes: dict[str, zmq.Socket] = {}
        self._out_lock = threading.Lock()  # (ZMQ sockets are not thread-safe)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-control", daemon=True)
        self._thread.start()
        if bootstrap is not None:
            try:
                register_rank(bootstrap, self.info, self.timeouts.bootstrap)
            except BaseException:
                self.close()
                raise

    # -- the scheduler's side

    def sender(self, bootstrap: BootstrapInfo) -> Sender:
        if self.mode != "prefill":
            raise RuntimeError("a decode rank makes receivers, not senders")
        sender, room = Sender(self, bootstrap.room), bootstrap.room
        with self.lock:
            if room in self._rooms:
                sender.state, sender.failure = KVPoll.FAILED, f"room {room} is already in use on this rank"
                return sender
            early = self._early.pop(room, None)
            if early is not None and early.failure is not None:  # (ended before it began: nothing to keep)
                sender.state, sender.failure = KVPoll.FAILED, early.failure
                return sender
            self._rooms[room] = sender
            if early is not None:
                self._accept(sender, early.dest)
        return sender

    def receiver(self, bootstrap: BootstrapInfo) -> Receiver:
        if self.mode != "decode":
            raise RuntimeError("a prefill rank makes senders, not receivers")
        receiver = Receiver(self, bootstrap)
        with self.lock:
            if bootstrap.room in self._rooms:
                receiver.state, receiver.failure = (
                    KVPoll.FAILED,
                    f"room {bootstrap.room} is already in use on this rank",
                )
                return receiver
            self._rooms[bootstrap.room] = receiver
            lookup = self._lookup(bootstrap)
            if lookup is not None:
                lookup.add_done_callback(lambda done: self._found(receiver, done))
        return receiver

    @property
    def num_rooms(self) -> int:
        with self.lock:
            return len(self._rooms) + len(self._early)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join()
        with self._out_lock:
            for socket in self._outboxes.values():
                socket.close(linger=0)
            self._outboxes.clear()
        self._inbox.close(linger=0)
        self._ctx.term()

    # -- what backends provide

    @abstractmethod
    def _transfer(self, sender: Sender, src: list[int], dst: list[int], record: bytes | None) -> None:
        """Moves the KV of slots `src` here to slots `dst` of the decode rank, without blocking; with the
        record (the last piece), ends the room with `_succeed` once everything arrived."""

    def _lookup(self, bootstrap: BootstrapInfo) -> Future[RankInfo] | None:
        """The prefill rank of `bootstrap`'s server: found, or being looked up on a thread of its own."""
        server = (bootstrap.host, bootstrap.port)
        lookup = self._lookups.get(server)
        if lookup is None or (lookup.done() and lookup.exception() is not None):
            lookup = self._lookups[server] = Future()
            threading.Thread(target=self._find, args=(server, lookup), name="pd-lookup", daemon=True).start()
        return lookup

    def _notify(self, sender: Sender, msg: Failed) -> None:
        """Tells the decode side that a room failed (a backend whose writes may still be under way for the
        room orders this after them)."""
        self._send(sender.peer_addr, msg)

    # -- rooms ending

    def _succeed(self, sender: Sender, done: Done) -> None:
        with self.lock:
            if self._end(sender, KVPoll.SUCCESS):
                self._send(sender.peer_addr, done)

    def _fail(self, room: Sender | Receiver, reason: str, tell: bool) -> None:
        """Fails a live room; `tell`: its peer learns why, where it is known."""
        with self.lock:
            if not self._end(room, KVPoll.FAILED, reason) or not tell or room.peer_addr is None:
                return
            if isinstance(room, Sender):
                self._notify(room, Failed(room.room, reason))
            else:
                self._send(room.peer_addr, Failed(room.room, reason))

    def _end(self, room: Sender | Receiver, state: KVPoll, reason: str | None = None) -> bool:
        """Ends a live room and drops it (False if it had ended)."""
        if room.state in ENDED:
            return False
        room.state, room.failure = state, reason
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]
        if isinstance(room, Sender) and room.dest is None and state == KVPoll.FAILED:
            self._early[room.room] = _Early(time.monotonic() + self.timeouts.waiting, failure=reason)
        return True

    # -- the control thread

    def _run(self) -> None:
        next_sweep = 0.0
        while not self._closed.is_set():
            if self._inbox.poll(min(100, int(self.timeouts.sweep * 1000))):
                self._read_inbox()
            if time.monotonic() >= next_sweep:
                with self.lock:
                    self._sweep(time.monotonic())
                next_sweep = time.monotonic() + self.timeouts.sweep

    def _read_inbox(self) -> None:
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                src, msg = decode(data)
                with self.lock:
                    self._handle(src, msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the control plane
                logger.exception("PD control: could not handle a message of %d bytes", len(data))

    def _handle(self, src: str, msg: Message) -> None:
        if src in self._heard:
            self._heard[src] = time.monotonic()
        room = self._rooms.get(getattr(msg, "room", ""))
        prefill = self.mode == "prefill"
        if isinstance(msg, Heartbeat) and prefill:
            self._send(src, Heartbeat())
        elif isinstance(msg, Destination) and isinstance(room, Sender):
            self._accept(room, msg)
        elif isinstance(msg, Destination) and prefill:
            self._wait_for_sender(msg)
        elif isinstance(msg, Done) and isinstance(room, Receiver) and room.state == KVPoll.TRANSFERRING:
            room.meta = msg.record if msg.record is not None else self._read_record(room.meta_index, msg.record_len)
            self._end(room, KVPoll.SUCCESS)
        elif isinstance(msg, Failed) and room is not None:
            self._fail(room, f"{'decode' if prefill else 'prefill'} side: {msg.reason}", tell=False)
        elif isinstance(msg, Failed) and prefill:  # (its sender may come later: it fails at once)
            self._early[msg.room] = _Early(
                time.monotonic() + self.timeouts.waiting, failure=f"decode side: {msg.reason}"
            )

    def _accept(self, sender: Sender, dest: Destination) -> None:
        """A destination for a live sender: WAITING_FOR_INPUT, unless the two ranks cannot pair."""
        if sender.dest is not None:
            return
        sender.dest = dest
        problem = self._mismatch(dest.rank) or self._out_of_range(dest)
        if problem:
            self._fail(sender, problem, tell=True)
        else:
            sender.state = KVPoll.WAITING_FOR_INPUT

    def _wait_for_sender(self, dest: Destination) -> None:
        early = self._early.pop(dest.room, None)
        if early is not None and early.failure is not None:
            self._send(dest.rank.control_addr, Failed(dest.room, early.failure))
        else:
            self._early[dest.room] = _Early(time.monotonic() + self.timeouts.waiting, dest=dest)

    def _sweep(self, now: float) -> None:
        """Deadlines and heartbeats (under the lock)."""
        for room in list(self._rooms.values()):
            if room.state == KVPoll.BOOTSTRAPPING and now > room.deadline:
                if isinstance(room, Sender):
                    reason = (
                        f"the decode server did not say where room {room.room}'s KV goes in {self.timeouts.waiting:g} s"
                    )
                else:
                    reason = room.timeout_reason()
                self._fail(room, reason, tell=True)
        for name, early in list(self._early.items()):
            if now > early.deadline:
                del self._early[name]
                if early.dest is not None:
                    reason = f"the prefill server got no request for room {name} in {self.timeouts.waiting:g} s"
                    self._send(early.dest.rank.control_addr, Failed(name, reason))
        if self.mode == "decode":
            self._beat(now)

    def _beat(self, now: float) -> None:
        """Heartbeats to the prefill ranks that live rooms wait on; those silent too long fail their rooms."""
        peers = {room.peer_addr for room in self._rooms.values()} - {None}
        self._heard = {addr: self._heard.get(addr, now) for addr in peers}
        silent = {addr for addr, heard in self._heard.items() if now - heard > self.timeouts.heartbeat}
        for room in list(self._rooms.values()):
            if room.peer_addr in silent:
                reason = f"the prefill rank at {room.peer_addr} stopped answering ({self.timeouts.heartbeat:g} s)"
                self._fail(room, reason, tell=False)
        for server, lookup in list(self._lookups.items()):  # (a prefill server that comes back is looked up again)
            if lookup.done() and lookup.exception() is None and lookup.result().control_addr in silent:
                del self._lookups[server]
        for addr in peers - silent:
            self._send(addr, Heartbeat())

    # -- decode side: the bootstrap

    def _find(self, server: Address, lookup: Future[RankInfo]) -> None:
        try:
            lookup.set_result(lookup_rank(server, self.info.tp_rank, self.timeouts.bootstrap, self._closed))
        except Exception as exc:  # noqa: BLE001 - the rooms waiting on it fail with it
            lookup.set_exception(exc)

    def _found(self, receiver: Receiver, lookup: Future[RankInfo]) -> None:
        error = lookup.exception()
        with self.lock:
            if error is not None:
                self._fail(receiver, str(error), tell=False)
                return
            if receiver.peer is not None:
                return
            receiver.peer = lookup.result()
            if receiver.state == KVPoll.FAILED:  # (aborted meanwhile: the prefill side learns it now)
                self._send(receiver.peer_addr, Failed(receiver.room, receiver.failure))
            elif problem := self._mismatch(receiver.peer):
                self._fail(receiver, problem, tell=True)
            else:
                receiver.state = KVPoll.WAITING_FOR_INPUT

    # -- helpers

    def _mismatch(self, peer: RankInfo) -> str | None:
        """Why this rank cannot pair with `peer` (None if it can)."""
        prefill, decode = (self.info, peer) if self.mode == "prefill" else (peer, self.info)
        if prefill.tp_size != decode.tp_size:
            return f"the prefill server has TP size {prefill.tp_size}, the decode server {decode.tp_size}: they must be equal"
        if prefill.layout.slot_bytes != decode.layout.slot_bytes:
            return (
                f"the prefill rank's KV slots ({_slots(prefill.layout)}) are not the decode rank's "
                f"({_slots(decode.layout)}): both servers must serve the same model with the same KV dtype, "
                "and both or neither with an EAGLE-3 draft (its KV is one more layer)"
            )
        return None

    @staticmethod
    def _out_of_range(dest: Destination) -> str | None:
        layout = dest.rank.layout
        slots = min(n // size for n, size in zip(layout.buffer_lens, layout.slot_bytes))
        if dest.slots and not 0 <= min(dest.slots) <= max(dest.slots) < slots:
            return f"room {dest.room}'s destination slots are not all in the decode rank's pool of {slots}"
        if not 0 <= dest.meta_index < layout.meta_slots:
            return f"room {dest.room}'s metadata slot {dest.meta_index} is not in the decode rank's {layout.meta_slots}"
        return None

    def _read_record(self, index: int, length: int) -> bytes:
        size = self.layout.meta_slot_bytes
        return ctypes.string_at(self.layout.meta_ptr + index * size, min(length, size))

    def _send(self, addr: str, msg: Message) -> bool:
        """Queues `msg` for the rank at `addr` (False if this rank is closed or the peer's queue is full)."""
        data = encode(self.info.control_addr, msg)
        with self._out_lock:
            if self._closed.is_set():
                return False
            socket = self._outboxes.get(addr)
            if socket is None:
                socket = self._outboxes[addr] = self._ctx.socket(zmq.PUSH)
                socket.connect(addr)
            try:
                socket.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True


def _slots(layout: KVLayout) -> str:
    sizes = sorted(set(layout.slot_bytes))
    return f"{len(layout.slot_bytes)} buffers of {'/'.join(map(str, sizes))} bytes per slot"
