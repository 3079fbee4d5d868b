"""What an encoder does: vision tower embeddings for submitted items, collected by polling.

Two encoders share this interface. `EncoderPool` (`encoder_pool.py`, `--vit-dp N`) runs the tower in
N separate processes, so the scheduler loop never waits for it. `InlineEncoder` (`--vit-dp 0`) runs it
in the scheduler's own process when polled: the simple baseline, and what SGLang and vLLM do.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, wait
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
    """Runs `tasks` through the vision tower together. If the batch fails, each task is retried alone,
    so one bad item fails only itself."""
    started = time.monotonic()
    try:
        outputs, seconds = _forward(visual, tasks, max_patches)
    except Exception as exc:  # noqa: BLE001 - any failure becomes the item's error, never the caller's crash
        if len(tasks) > 1:
            return [result for task in tasks for result in encode_tasks(visual, [task], max_patches)]
        return [EncodeResult(tasks[0].hash, None, f"the vision encoder failed on this item: {exc}")]
    total = sum(t.num_patches for t in tasks)
    return [
        EncodeResult(t.hash, out, wait=started - t.submitted, vit=seconds * t.num_patches / total)
        for t, out in zip(tasks, outputs)
    ]


@torch.inference_mode()
def _forward(visual: Qwen3VLVisionModel, tasks: list[EncodeTask], max_patches: int) -> tuple[list[VisionOutput], float]:
    start = time.perf_counter()
    pixels = torch.cat([t.pixel_values for t in tasks])
    out = visual.encode(pixels, [t.grid_thw for t in tasks], max_patches)
    merge = visual.merge * visual.merge
    outputs = out.split([t.num_patches // merge for t in tasks])
    if out.embeds.is_cuda:
        torch.cuda.synchronize(out.embeds.device)
    return outputs, time.perf_counter() - start


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
    def poll(self, timeout: float = 0.0) -> list[EncodeResult]:
        """Results ready now, waiting up to `timeout` seconds for the first one."""

    def run_on(self, executor: Executor) -> None:
        """Encoders that compute in the scheduler's process queue that work on `executor` from now on
        (anything with `submit(fn, *args) -> Future`); the others ignore it."""

    def shutdown(self) -> None:
        """Stops whatever the encoder runs; it takes no tasks afterwards."""


class InlineEncoder(VisionEncoder):
    """Encodes submitted tasks in this process, all together, when polled: on the polling thread, or
    queued on an executor (under overlap scheduling, the forward thread, in order with the forwards)."""

    def __init__(self, visual: Qwen3VLVisionModel, max_patches: int) -> None:
        super().__init__()
        self.visual = visual
        self.max_patches = max_patches
        self.pending: list[EncodeTask] = []
        self.executor: Executor | None = None
        self.running: list[Future[list[EncodeResult]]] = []

    def run_on(self, executor: Executor) -> None:
        self.executor = executor

    def submit(self, tasks: list[EncodeTask]) -> None:
        now = time.monotonic()
        for task in tasks:
            task.submitted = now
        self.pending.extend(tasks)

    def poll(self, timeout: float = 0.0) -> list[EncodeResult]:
        if self.pending:
            tasks, self.pending = self.pending, []
            if self.executor is None:
                return self._count(encode_tasks(self.visual, tasks, self.max_patches))
            self.running.append(self.executor.submit(encode_tasks, self.visual, tasks, self.max_patches))
        if not self.running:
            return []
        done, _ = wait(self.running, timeout, FIRST_COMPLETED)
        self.running = [f for f in self.running if f not in done]
        return self._count([r for f in done for r in f.result()])

    def _count(self, results: list[EncodeResult]) -> list[EncodeResult]:
        self.num_items += sum(r.output is not None for r in results)
        return results
