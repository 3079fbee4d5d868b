"""What an encoder does: vision tower embeddings for submitted items, collected by polling.

Two encoders share this interface. `EncoderPool` (`encoder_pool.py`, `--vit-dp N`) runs the tower in
N separate processes, so the scheduler loop never waits for it. `InlineEncoder` (`--vit-dp 0`) runs it
in the scheduler's own process when polled, as SGLang and vLLM do, but a block at a time between the
scheduler's forwards while requests are decoding, so that a large image or video does not stall them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Generator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from vlm_serve.vision.vision_tower import Grid, Qwen3VLVisionModel, VisionOutput


@dataclass
class EncodeTask:
    """One image or video to encode, keyed by its content hash."""

    hash: int
    grid_thw: Grid
    pixel_values: torch.Tensor
    submitted: float = 0.0  # time.monotonic() when handed to the encoder (the clock is system-wide)
    attempts: int = 0  # encoder ranks that died while holding it

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass
class EncodeResult:
    """Embeddings of one task, or why it could not be encoded."""

    hash: int
    output: VisionOutput | None
    error: str | None = None
    unavailable: bool = False  # with an error: no encoder could run it (its ranks died), not the item's fault
    wait: float = 0.0  # seconds from submission until a vision tower started on it
    vit: float = 0.0  # its share (by patch count) of the compute time of the pass it ran in
    rank: int = 0  # the encoder rank that ran it


class Executor(Protocol):
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future: ...


def encode_tasks(visual: Qwen3VLVisionModel, tasks: list[EncodeTask], max_patches: int) -> list[EncodeResult]:
    """Runs `tasks` through the vision tower together (see `SlicedEncode.advance`)."""
    return SlicedEncode(visual, tasks, max_patches).advance(to_end=True)


class SlicedEncode:
    """Tasks going through the vision tower together, a block per `advance` or all at once."""

    def __init__(self, visual: Qwen3VLVisionModel, tasks: list[EncodeTask], max_patches: int) -> None:
        self.visual, self.tasks, self.max_patches = visual, tasks, max_patches
        self.started = time.monotonic()
        self.seconds = 0.0  # compute time so far
        self.steps: Generator[None, None, VisionOutput] | None = None

    @torch.inference_mode()
    def advance(self, to_end: bool) -> list[EncodeResult] | None:
        """Runs the next block (every block left with `to_end`); the results once the last has run. If
        the batch fails, each task is encoded again alone, so one bad item fails only itself."""
        start = time.perf_counter()
        try:
            if self.steps is None:
                pixels = torch.cat([t.pixel_values for t in self.tasks])
                self.steps = self.visual.encode_steps(pixels, [t.grid_thw for t in self.tasks], self.max_patches)
            next(self.steps)
            while to_end:
                next(self.steps)
        except StopIteration as done:
            output: VisionOutput = done.value
        except Exception as exc:  # noqa: BLE001 - any failure becomes the items' errors, never the caller's crash
            if len(self.tasks) > 1:
                return [r for t in self.tasks for r in SlicedEncode(self.visual, [t], self.max_patches).advance(True)]
            return [EncodeResult(self.tasks[0].hash, None, f"the vision encoder failed on this item: {exc}")]
        else:
            self._count_time(start)
            return None
        self._count_time(start)
        merge = self.visual.merge * self.visual.merge
        total = sum(t.num_patches for t in self.tasks)
        return [
            EncodeResult(t.hash, out, wait=self.started - t.submitted, vit=self.seconds * t.num_patches / total)
            for t, out in zip(self.tasks, output.split([t.num_patches // merge for t in self.tasks]))
        ]

    def _count_time(self, start: float) -> None:
        if self.visual.pos_embed.weight.is_cuda:
            torch.cuda.synchronize(self.visual.pos_embed.weight.device)
        self.seconds += time.perf_counter() - start


class VisionEncoder(ABC):
    """Accepts tasks with `submit`; `poll` returns the results that are done. `num_items` counts the
    items encoded (results with embeddings)."""

    def __init__(self) -> None:
        self.num_items = 0
        self.num_restarts = 0  # encoder processes replaced after dying

    @property
    def load(self) -> list[int]:
        """Patches in flight per encoder process (none for an encoder in the scheduler's process)."""
        return []

    @abstractmethod
    def submit(self, tasks: list[EncodeTask]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float = 0.0, busy: bool = False) -> list[EncodeResult]:
        """Results ready now, waiting up to `timeout` seconds for the first one. `busy`: the caller has
        forwards to run, which an encoder running in its process should not hold up for long."""

    def run_on(self, executor: Executor) -> None:
        """Encoders that compute in the scheduler's process queue that work on `executor` from now on
        (anything with `submit(fn, *args) -> Future`); the others ignore it."""

    def shutdown(self) -> None:
        """Stops whatever the encoder runs; it takes no tasks afterwards."""


class InlineEncoder(VisionEncoder):
    """Encodes submitted tasks in this process, together, when polled: on the polling thread, or queued on
    an executor (under overlap scheduling, the forward thread, in order with the forwards). A `busy` poll
    runs a single block of the tower, so that the caller's next forward follows soon; any other runs it
    to the end."""

    def __init__(self, visual: Qwen3VLVisionModel, max_patches: int) -> None:
        super().__init__()
        self.visual = visual
        self.max_patches = max_patches
        self.pending: list[EncodeTask] = []
        self.executor: Executor | None = None
        self.job: SlicedEncode | None = None
        self.running: Future[list[EncodeResult] | None] | None = None  # the job's step on the executor

    def run_on(self, executor: Executor) -> None:
        self.executor = executor

    def submit(self, tasks: list[EncodeTask]) -> None:
        now = time.monotonic()
        for task in tasks:
            task.submitted = now
        self.pending.extend(tasks)

    def poll(self, timeout: float = 0.0, busy: bool = False) -> list[EncodeResult]:
        if self.job is None and self.pending:
            self.job, self.pending = SlicedEncode(self.visual, self.pending, self.max_patches), []
        if self.job is None:
            return []
        if self.executor is None:
            results = self.job.advance(to_end=not busy)
        else:
            if self.running is None:
                self.running = self.executor.submit(self.job.advance, not busy)
            if not wait([self.running], timeout).done:
                return []
            results, self.running = self.running.result(), None
        if results is None:
            return []
        self.job = None
        self.num_items += sum(r.output is not None for r in results)
        return results
