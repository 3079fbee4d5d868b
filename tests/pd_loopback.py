"""A prefill/decode pair in one process, for tests of the PD schedulers: two `Engine`s (one per side)
whose transfer backends copy KV between their pools directly (`LoopbackBackend`), so that the schedulers'
queues and their answers are tested without a network; the real backends have their own tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_serve.disaggregation.transfer import KVPoll, KVReceiver, KVSender, TransferBackend
from vlm_serve.engine import Engine, Submission
from vlm_serve.messages.backend import BootstrapInfo
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.scheduler import scheduler as scheduler_module


@dataclass
class Room:
    """One request's transfer as both sides see it."""

    slots: list[int] | None = None  # the decode side's destination
    meta: bytes | None = None
    received: int = 0  # prompt positions copied
    failure: str | None = None


@dataclass
class Hub:
    """The two sides' pools and the rooms between them; `fail_rooms` fail at their first send."""

    pools: dict[str, object] = field(default_factory=dict)
    rooms: dict[str, Room] = field(default_factory=dict)
    fail_rooms: set[str] = field(default_factory=set)

    def room(self, key: str) -> Room:
        return self.rooms.setdefault(key, Room())


class LoopbackSender(KVSender):
    def __init__(self, hub: Hub, room: str) -> None:
        self.hub, self.key, self.room = hub, room, hub.room(room)

    @property
    def failure(self) -> str | None:  # type: ignore[override]
        return self.room.failure

    def poll(self) -> KVPoll:
        if self.room.failure is not None:
            return KVPoll.FAILED
        if self.room.slots is None:
            return KVPoll.BOOTSTRAPPING
        return KVPoll.SUCCESS if self.room.meta is not None else KVPoll.WAITING_FOR_INPUT

    @property
    def num_slots(self) -> int:
        return len(self.room.slots)

    def send(self, slots: list[int], start: int, meta: bytes | None = None) -> None:
        if self.key in self.hub.fail_rooms:
            self.room.failure = "injected failure"
            return
        assert start == self.room.received, f"room {self.key}: positions from {self.room.received} due, not {start}"
        src, dst = self.hub.pools["prefill"], self.hub.pools["decode"]
        to = torch.tensor(self.room.slots[start : start + len(slots)])
        for a, b in zip(src.buffers(), dst.buffers(), strict=True):
            b[to] = a[torch.tensor(slots, dtype=torch.int64)]
        self.room.received = start + len(slots)
        if meta is not None:
            self.room.meta = meta

    def abort(self) -> None:
        if self.room.meta is None:
            self.room.failure = self.room.failure or "aborted by the prefill side"


class LoopbackReceiver(KVReceiver):
    def __init__(self, hub: Hub, room: str) -> None:
        self.room = hub.room(room)

    @property
    def failure(self) -> str | None:  # type: ignore[override]
        return self.room.failure

    @property
    def meta(self) -> bytes | None:  # type: ignore[override]
        return self.room.meta

    def poll(self) -> KVPoll:
        if self.room.failure is not None:
            return KVPoll.FAILED
        if self.room.slots is None:
            return KVPoll.WAITING_FOR_INPUT
        return KVPoll.SUCCESS if self.room.meta is not None else KVPoll.TRANSFERRING

    def init(self, slots: list[int], meta_index: int) -> None:
        self.room.slots = slots

    def abort(self) -> None:
        if self.room.meta is None:
            self.room.failure = self.room.failure or "aborted by the decode side"


class LoopbackBackend(TransferBackend):
    def __init__(self, hub: Hub, mode: str, pool: object) -> None:
        self.hub = hub
        hub.pools[mode] = pool

    def sender(self, bootstrap: BootstrapInfo) -> KVSender:
        return LoopbackSender(self.hub, bootstrap.room)

    def receiver(self, bootstrap: BootstrapInfo) -> KVReceiver:
        return LoopbackReceiver(self.hub, bootstrap.room)

    @property
    def num_rooms(self) -> int:
        return len(self.hub.rooms)

    def close(self) -> None:
        pass


class PDPair:
    """A prefill and a decode `Engine` of the same checkpoint, joined by a loopback hub; `submit` sends a
    request to both with one room, as sglang-router sends it, and `result` is the decode side's answer."""

    def __init__(self, model, monkeypatch, decode_options: dict | None = None, **options) -> None:
        self.hub = Hub()
        # the loopback copies between the pools themselves: the "layout" it gets is the pool
        monkeypatch.setattr(scheduler_module.KVLayout, "of", staticmethod(lambda pool, meta: pool), raising=False)
        monkeypatch.setattr(
            scheduler_module,
            "create_transfer_backend",
            lambda args, mode, rank, pool: LoopbackBackend(self.hub, mode, pool),
        )
        self.prefill = Engine(model, disaggregation_mode="prefill", **options)
        self.decode = Engine(model, disaggregation_mode="decode", **{**options, **(decode_options or {})})
        self.next_room = 0  # the room the next request gets

    def submit(self, x: ProcessedInput, sides: tuple[str, ...] = ("prefill", "decode"), **sampling) -> list[Submission]:
        """The request on both sides (prefill's, decode's), or on those named, with a new room."""
        room, self.next_room = self.next_room, self.next_room + 1
        bootstrap = [BootstrapInfo("loopback", 0, f"{room}/{i}") for i in range(sampling.get("n", 1))]
        return [getattr(self, side).submit(x, bootstrap=bootstrap, **sampling) for side in sides]

    def run(self, *submissions: Submission) -> None:
        """Steps both engines until every submission is done."""
        while not all(s.done for s in submissions):
            self.prefill.step()
            self.decode.step()

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()
