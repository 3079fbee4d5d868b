"""An `Engine` stepped by a thread of its own, for callers on other threads or on an event loop: a batch
job's engine actor taking the rows of several batches at once, a page answering several people.

`submit` hands a preprocessed prompt over and returns a `Future` at once; `stream` yields its chunks as they
come (closing it early aborts the prompt). The thread submits whatever has arrived, steps the engine while
anything is in flight (so prompts from every caller are batched continuously together), and settles each
future with the prompt's `GenerateOutput` or the error `Engine.result` raises for it, and each stream with
its chunks, then its end. Only that thread touches the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from vlm_serve.engine import Engine, GenerateOutput, StreamChunk, Submission
from vlm_serve.multimodal.items import ProcessedInput

Chunks = queue.SimpleQueue  # a stream's chunks, then None (or the exception that ended it)


class EngineThread:
    """Drives `engine` from a daemon thread until `close`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # prompts (with the future or the chunk queue their answer goes to), streams to abort, None to stop
        self._inbox: queue.SimpleQueue[tuple[ProcessedInput, dict[str, Any], Future | Chunks] | Chunks | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, x: ProcessedInput, **sampling: Any) -> Future[GenerateOutput]:
        future: Future[GenerateOutput] = Future()
        self._inbox.put((x, sampling, future))
        return future

    def stream(self, x: ProcessedInput, **sampling: Any) -> Iterator[StreamChunk]:
        """`x`'s answer as it comes (`Engine.stream`'s chunks); closing the iterator early aborts it."""
        chunks: Chunks = queue.SimpleQueue()
        self._inbox.put((x, sampling, chunks))
        ended = False
        try:
            while (chunk := chunks.get()) is not None:
                if isinstance(chunk, Exception):
                    ended = True
                    raise chunk
                yield chunk
            ended = True
        finally:
            if not ended:
                self._inbox.put(chunks)

    def close(self) -> None:
        """Waits for what is in flight, then stops the thread (the engine is the caller's to shut down)."""
        self._inbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        pending: dict[Submission, Future | Chunks] = {}
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
                elif not isinstance(item, tuple):  # a stream closed early: its prompt is aborted
                    for submission in [s for s, to in pending.items() if to is item]:
                        self.engine.abort(submission, "the stream was closed")
                elif broken is not None:
                    _fail(item[2], broken)
                else:
                    x, sampling, to = item
                    try:
                        pending[self.engine.submit(x, **sampling)] = to
                    except Exception as exc:  # bad sampling values: this prompt's error alone
                        _fail(to, exc)
            if broken is not None or not (pending or not self.engine.scheduler.is_idle()):
                continue
            try:
                self.engine.step()
            except Exception as exc:
                broken = exc
                for to in pending.values():
                    _fail(to, exc)
                pending.clear()
                continue
            for submission, to in list(pending.items()):
                if isinstance(to, Future):
                    if submission.done:
                        del pending[submission]
                        try:
                            to.set_result(self.engine.result(submission))
                        except Exception as exc:
                            to.set_exception(exc)
                    continue
                try:
                    for chunk in self.engine.new_chunks(submission):
                        to.put(chunk)
                except Exception as exc:
                    del pending[submission]
                    to.put(exc)
                    continue
                if submission.done:
                    del pending[submission]
                    to.put(None)


def _fail(to: Future | Chunks, exc: Exception) -> None:
    if isinstance(to, Future):
        to.set_exception(exc)
    else:
        to.put(exc)
