"""What the PD schedulers ask of a KV transfer backend, whichever moves the bytes.

Each TP rank of each server makes one `TransferBackend` with its KV pool's layout (`KVLayout`). Rank r
of a prefill server pairs with rank r of a decode server (equal TP sizes). Per request:

- the decode side makes a `KVReceiver` for the request's room: it looks up the prefill rank through the
  prefill server's bootstrap server, and once the scheduler has pre-allocated the request's KV slots it
  says where the KV goes (`init`);
- the prefill side makes a `KVSender` for the same room: once the decode side's destination has
  arrived (`poll` is WAITING_FOR_INPUT), the scheduler sends the prompt's KV slot by slot range as its
  chunks are computed (`send`), the last piece with the metadata record;
- both sides poll until SUCCESS or FAILED (`failure` says why); the receiver then holds the record
  (`meta`).

Backends share the control plane (the bootstrap lookup, the handshake, the states, the timeouts:
`control.py`) and differ in how bytes move: Mooncake writes the KV and the record into the decode rank's
registered buffers (`mooncake.py`); the fake backend moves no KV at all (the decode side decodes from
whatever its slots hold: for tests of the queues and their failures, with injection: `fake.py`) and
hands the record over with its completion message. No call of the scheduler's waits on the network.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from vlm_serve.kv_cache.memory_pool import TokenToKVPool
    from vlm_serve.messages.backend import BootstrapInfo

Mode = Literal["prefill", "decode"]


class KVPoll(enum.IntEnum):
    """Where a transfer stands; a group of TP ranks agrees on the minimum of their states."""

    FAILED = 0
    BOOTSTRAPPING = 1  # prefill: waiting for the decode side's destination; decode: finding the prefill rank
    WAITING_FOR_INPUT = 2  # prefill: the destination is known, KV can be sent; decode: waiting for `init`
    TRANSFERRING = 3  # decode: destination sent, KV on its way; prefill: some KV sent, not all of it done
    SUCCESS = 4  # every slot and the metadata record arrived


@dataclass(frozen=True)
class KVLayout:
    """One TP rank's KV pool as bytes: every layer's K buffer then every layer's V buffer, each indexed by
    KV slot, and the metadata buffer of `meta_slots` records of `meta_slot_bytes` each."""

    buffer_ptrs: list[int]  # base address of each buffer
    buffer_lens: list[int]  # bytes of each buffer
    slot_bytes: list[int]  # bytes of one KV slot in each buffer
    page_size: int
    meta_ptr: int
    meta_slots: int
    meta_slot_bytes: int

    @classmethod
    def of(cls, pool: TokenToKVPool, meta: torch.Tensor) -> KVLayout:
        """The layout of `pool`'s buffers and of `meta`, a (records, bytes per record) tensor. The tensors
        must outlive every backend made with it: the layout holds their addresses, not them."""
        buffers = pool.buffers()
        if not all(b.is_contiguous() for b in [*buffers, meta]):
            raise ValueError("KV and metadata buffers must be contiguous to be transferred as bytes")
        return cls(
            buffer_ptrs=[b.data_ptr() for b in buffers],
            buffer_lens=[b.numel() * b.element_size() for b in buffers],
            slot_bytes=[b[0].numel() * b.element_size() for b in buffers],
            page_size=pool.page_size,
            meta_ptr=meta.data_ptr(),
            meta_slots=meta.shape[0],
            meta_slot_bytes=meta[0].numel() * meta.element_size(),
        )


class KVSender(ABC):
    """The prefill side of one request's transfer."""

    failure: str | None = None  # why poll() says FAILED
    bytes_sent: int = 0  # KV and record bytes written to the decode side so far (none by the fake backend)

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    @abstractmethod
    def num_slots(self) -> int:
        """KV slots the decode side pre-allocated (the prompt's length); known from WAITING_FOR_INPUT on."""

    @abstractmethod
    def send(self, slots: list[int], start: int, meta: bytes | None = None) -> None:
        """Sends the KV of prompt positions start ... start + len(slots) - 1, held in these slots of this
        rank's pool, to the decode side's slots for the same positions. With `meta` (the last piece),
        the record goes to the decode side's metadata slot after the KV, and SUCCESS means all arrived."""

    @abstractmethod
    def abort(self) -> None:
        """Gives up on the transfer; the decode side learns it failed (as far as it can be told)."""


class KVReceiver(ABC):
    """The decode side of one request's transfer."""

    failure: str | None = None
    meta: bytes | None = None  # the metadata record, once poll() says SUCCESS

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def init(self, slots: list[int], meta_index: int) -> None:
        """Where the KV goes: the slots of prompt positions 0 ... len(slots) - 1, and the metadata slot.
        Called once poll() has left BOOTSTRAPPING."""

    @abstractmethod
    def abort(self) -> None: ...


class TransferBackend(ABC):
    """One TP rank's end of the transfers of one server."""

    @abstractmethod
    def sender(self, bootstrap: BootstrapInfo) -> KVSender: ...

    @abstractmethod
    def receiver(self, bootstrap: BootstrapInfo) -> KVReceiver: ...

    @property
    @abstractmethod
    def num_rooms(self) -> int:
        """Rooms this rank holds state for: live senders or receivers, destinations waiting for their
        request, and the short-lived notes of rooms that failed before their peer knew (which expire)."""

    @abstractmethod
    def close(self) -> None: ...
