"""Overlap scheduling's machinery: the FutureMap and the forward thread.

With overlap (the default), the scheduler launches batch N+1 before it has looked at batch N's sampled
tokens: a request still waiting for its token from batch N gets a *future id* as its next input, a
negative index into the FutureMap, which batch N's sampling fills. Forwards run in launch order, so the
slot is always filled by the time batch N+1 reads it, right before its forward.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from vlm_serve.llm.forward_batch import ForwardBatch, ForwardOutput
from vlm_serve.llm.kernels import release_thread_team, set_thread_team

IDLE_RELEASE_S = 0.05  # idle seconds after which the forward thread releases its OpenMP team

T = TypeVar("T")


class FutureMap:
    """A ring of token slots on the model's device. Each batch reserves one slot per request; a request
    whose last token is still being sampled reads it from its slot as input id `-(slot + 1)`.

    The ring holds several batches' worth of slots, so a slot is reused only long after the batch that
    read it has run (at most two batches are ever in flight)."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        self.size = 4 * max_batch_size
        self.token_ids = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.next = 0

    def alloc(self, n: int) -> int:
        """The first of `n` consecutive slots for a batch of `n` requests."""
        if self.next + n > self.size:
            self.next = 0
        start, self.next = self.next, self.next + n
        return start

    @staticmethod
    def future_id(slot: int) -> int:
        return -(slot + 1)

    def resolve(self, batch: ForwardBatch) -> None:
        """Replaces the batch's future ids by the tokens now in their slots (input ids, and the outputs
        that penalties count: `SampleRow.pending`), without waiting for them."""
        if not batch.has_futures:
            return
        ids = batch.input_ids  # (no branch on whether any is negative: that would sync a CUDA stream)
        batch.input_ids = torch.where(ids < 0, self.token_ids[(-ids - 1).clamp(min=0)], ids)
        rows = [row for row in batch.sampling if row.output_ids and row.output_ids[-1] < 0]
        if rows:  # (the tokens stay on the device: the penalties count them there)
            slots = torch.tensor([-row.output_ids[-1] - 1 for row in rows], device=self.token_ids.device)
            for row, token in zip(rows, self.token_ids[slots], strict=True):
                row.output_ids, row.pending = row.output_ids[:-1], token

    def store(self, start: int, next_token_ids: torch.Tensor) -> None:
        self.token_ids[start : start + next_token_ids.numel()] = next_token_ids


class ForwardThread:
    """Runs launched batches one after another on a thread of its own (torch releases the GIL while it
    computes), so the scheduler prepares batch N+1 and processes batch N's result while batch N runs. On
    CUDA the forwards also run on a stream of their own, which waits for the inputs the scheduler put on
    its stream; the sampled tokens come back to the host asynchronously. Other device work that must
    not overlap the forwards (the vision tower of `--vit-dp 0`) is queued in order with them (`submit`).

    On CPU the thread takes the intra-op threads the process had; the scheduler's own work runs with one
    (`scheduler_side`): two OpenMP thread teams on the same cores would slow every forward down.

    `busy_seconds` adds up the time the thread spends running work: the rest of a run's wall time the
    model waits for the scheduler."""

    def __init__(self, runner, forward: Callable[[ForwardBatch], ForwardOutput] | None = None) -> None:
        """`forward` runs a launched batch (by default the runner's `forward_batch_generation`; runner:
        ModelRunner, not imported: it imports this module)."""
        self.runner = runner
        self.forward = forward or runner.forward_batch_generation
        self.stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self.busy_seconds = 0.0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, args=(torch.get_num_threads(),), name="forward", daemon=True)
        self._thread.start()

    def launch(self, batch: ForwardBatch) -> Future[ForwardOutput]:
        """Queues `batch`'s forward; its result (tokens on the host) arrives in the returned future."""
        inputs_ready = None
        if self.stream is not None:
            inputs_ready = torch.cuda.Event()
            inputs_ready.record()
        return self.submit(self._forward, batch, inputs_ready)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Runs `fn(*args)` on the thread after everything queued before it."""
        future: Future[T] = Future()
        self._queue.put((fn, args, future))
        return future

    def stop(self) -> None:
        """Lets the thread end once the work already queued has run."""
        self._queue.put(None)

    def shutdown(self) -> None:
        """Stops the thread and waits for it to end (unless called on it). Also at the interpreter's exit
        for a scheduler never shut down: a thread still ending while the process tears down its C++
        runtime (torch's and OpenMP's thread-local state) aborts the process."""
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @contextlib.contextmanager
    def scheduler_side(self) -> Iterator[None]:
        """Around the scheduler's own work on CPU: its thread runs torch ops with one OpenMP thread, and
        the thread team it may have made before (loading the model, say) is released. With two teams
        the process has more OpenMP threads than cores, and libgomp then stops spinning at barriers:
        every small op of the forward thread's team waits on a futex, and forwards run several times
        slower. Only this thread's OpenMP setting changes, and only meanwhile."""
        if self.stream is not None:
            yield
            return
        previous = torch.get_num_threads()
        set_thread_team(1)
        release_thread_team()  # this thread's idle team, if any
        try:
            yield
        finally:
            set_thread_team(previous)

    def _forward(self, batch: ForwardBatch, inputs_ready: torch.cuda.Event | None) -> ForwardOutput:
        if inputs_ready is not None:
            self.stream.wait_event(inputs_ready)
        out = self.forward(batch)
        out.to_host()
        return out

    def _next(self) -> Any:
        """The next forward to run, waited for. A thread idle for IDLE_RELEASE_S lets its OpenMP team go first:
        another engine's forwards in this process would otherwise run beside more OpenMP threads than cores,
        where libgomp stops spinning at barriers (measured: one engine's decode at half speed once a second
        engine of the process had run a step)."""
        try:
            return self._queue.get(timeout=IDLE_RELEASE_S)
        except queue.Empty:
            release_thread_team()
            return self._queue.get()

    def _loop(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with stream, torch.inference_mode():
            while (item := self._next()) is not None:
                fn, args, future = item
                start = time.perf_counter()
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the scheduler, which raises it
                    future.set_exception(exc)
                self.busy_seconds += time.perf_counter() - start
