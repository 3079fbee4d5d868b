"""The launcher's children (TP rank schedulers; on node 0 the detokenizer and the encoder ranks), held
together so that the launcher and the HTTP server's watchdog can see them die and stop them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.multiprocessing as mp

from vlm_serve.vision.pool import EncoderRanks

CHILD_STOP_TIMEOUT = 10.0


@dataclass
class ServerProcesses:
    """The children of this launcher: TP rank schedulers, and on node 0 the detokenizer and the
    encoder ranks."""

    schedulers: list[mp.Process]
    detokenizer: mp.Process | None = None
    encoders: EncoderRanks | None = None

    @property
    def processes(self) -> list[mp.Process]:
        return [*self.schedulers, *([self.detokenizer] if self.detokenizer is not None else [])]

    def dead(self) -> str:
        """Why a child is not running ('' when all are; encoder ranks are restarted, not reported). Of
        several, one killed by a signal is named: the others' errors follow from its death (a TP rank
        whose peer died fails in their collective)."""
        exited = sorted((p for p in self.processes if not p.is_alive()), key=lambda p: p.exitcode >= 0)
        return f"the {exited[0].name} process exited (code {exited[0].exitcode})" if exited else ""

    def restart_encoders(self) -> None:
        if self.encoders is not None:
            self.encoders.check()

    def stop(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        if self.encoders is not None:
            self.encoders.stop()
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT
        for p in self.processes:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()
