"""The fake transfer backend: the real control plane (bootstrap server, handshake, states, aborts,
timeouts), but no KV moves; the metadata record travels inside the "done" message, so the decode side
still learns the first token. For tests of the PD queues, and of their failures:

`VLM_SERVE_FAKE_KV_FAILURE` (read when the backend starts) injects failures, decided by room: a
comma-separated list of `STAGE:PREFIX` items, where a room fails if it starts with PREFIX (an empty
PREFIX: every room) and STAGE is
- `transfer` (the default when `STAGE:` is left out): the prefill rank fails the room at its first
  `send`, and the decode side learns why; both sides end FAILED with a reason naming the variable;
- `bootstrap`: the decode rank never finds the prefill rank for the room, which fails after the
  bootstrap timeout (`Timeouts` in control.py) as a lookup that never succeeds would.

E.g. `VLM_SERVE_FAKE_KV_FAILURE=transfer:fail-,bootstrap:hang-`. Each side acts on its own stage, so the
same value can be given to both servers.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from vlm_serve.disaggregation.bootstrap import RankInfo
from vlm_serve.disaggregation.control import ControlBackend, Done, Sender
from vlm_serve.messages.backend import BootstrapInfo

FAILURE_ENV = "VLM_SERVE_FAKE_KV_FAILURE"
STAGES = ("transfer", "bootstrap")


@dataclass(frozen=True)
class Injection:
    """The room prefixes that fail, per stage."""

    transfer: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Injection:
        stages: dict[str, list[str]] = {stage: [] for stage in STAGES}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            stage, _, prefix = item.partition(":") if ":" in item else ("transfer", "", item)
            if stage not in stages:
                raise ValueError(f"{FAILURE_ENV}: {item!r} names no stage (one of {', '.join(STAGES)})")
            stages[stage].append(prefix)
        return cls(**{stage: tuple(prefixes) for stage, prefixes in stages.items()})

    def fails(self, stage: str, room: str) -> bool:
        return any(room.startswith(prefix) for prefix in getattr(self, stage))


class FakeBackend(ControlBackend):
    """A rank's end of PD transfers that moves no KV."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """`ControlBackend`'s arguments; the injected failures come from the environment."""
        self.injection = Injection.parse(os.environ.get(FAILURE_ENV, ""))
        super().__init__(*args, **kwargs)

    def _lookup(self, bootstrap: BootstrapInfo) -> Future[RankInfo] | None:
        if self.injection.fails("bootstrap", bootstrap.room):
            return None  # (the control thread fails the room at its bootstrap deadline)
        return super()._lookup(bootstrap)

    def _transfer(self, sender: Sender, src: list[int], dst: list[int], record: bytes | None) -> None:
        if self.injection.fails("transfer", sender.room):
            self._fail(sender, f"injected transfer failure for room {sender.room} ({FAILURE_ENV})", tell=True)
        elif record is not None:
            self._succeed(sender, Done(sender.room, len(record), record))
