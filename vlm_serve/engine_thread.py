"""An `Engine` stepped by a thread of its own, for callers on other threads or on an event loop: a batch
job's engine actor taking the rows of several batches at once, a page answering several people.

`submit` hands a preprocessed prompt over and returns a `Future` at once; the thread submits whatever has
arrived, steps the engine while anything is in flight (so prompts from every caller are batched
continuously together), and settles each future with the prompt's `GenerateOutput` or the error
`Engine.result` raises for it. Only that thread touches the engine.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from vlm_serve.engine import Engine, GenerateOutput, Submission
from vlm_serve.multimodal.items import ProcessedInput


class EngineThread:
    """Drives `engine` from a daemon thread until `close`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[ProcessedInput, dict[str, Any], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, x: ProcessedInput, **sampling: Any) -> Future[GenerateOutput]:
        future: Future[GenerateOutput] = Future()
        self._inbox.put((x, sampling, future))
        return future

    def close(self) -> None:
        """Waits for what is in flight, then stops the thread (the engine is the caller's to shut down)."""
        self._inbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        pending: dict[Submission, Future] = {}
        broken: Exception | None = None  # the engine's own failure: every later prompt gets it too
        closing = False
        while not (closing and not pending):
            busy = broken is None and (pending or not self.engine.scheduler.is_idle())
            arrived = [] if busy else [self._inbox.get()]  # (nothing to step: wait for work)
            while True:
                try:
                    arrived.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in arrived:
                if item is None:
                    closing = True
                elif broken is not None:
                    item[2].set_exception(broken)
                else:
                    x, sampling, future = item
                    try:
                        pending[self.engine.submit(x, **sampling)] = future
                    except Exception as exc:  # bad sampling values: this prompt's error alone
                        future.set_exception(exc)
            if broken is not None or not (pending or not self.engine.scheduler.is_idle()):
                continue
            try:
                self.engine.step()
            except Exception as exc:
                broken = exc
                for future in pending.values():
                    future.set_exception(exc)
                pending.clear()
                continue
            for submission in [s for s in pending if s.done]:
                future = pending.pop(submission)
                try:
                    future.set_result(self.engine.result(submission))
                except Exception as exc:
                    future.set_exception(exc)
