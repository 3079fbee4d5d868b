"""What an encoder does: vision tower embeddings for submitted items, collected by polling.

Two encoders share this interface. `EncoderPool` (`pool.py`, `--vit-dp N`) runs the tower in
N separate processes, so the scheduler loop never waits for it. `InlineEncoder` (`--vit-dp 0`) runs it
in the scheduler's own process when polled, as SGLang and vLLM do; on a CPU, while the LLM has requests
running, beside it on some of the cores (`CoreShare`), so that their tokens keep coming.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import torch

from vlm_serve.llm.kernels import set_thread_team
from vlm_serve.llm.lora.adapter import TowerAdapter, TowerLoRA
from vlm_serve.llm.models.base import Grid, VisionOutput, VisionTower
from vlm_serve.multimodal.pixels import PatchPixels

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class EncodeTask:
    """One image or video to encode, keyed by its embeddings' key (`embedding_key`), through the vision-tower
    part of a LoRA adapter where `lora` names one."""

    key: int
    grid_thw: Grid
    pixels: PatchPixels
    lora: TowerAdapter | None = None
    submitted: float = 0.0  # time.monotonic() when handed to the encoder (the clock is system-wide)
    attempts: int = 0  # encoder ranks that died while holding it

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass
class EncodeResult:
    """Embeddings of one task, or why it could not be encoded."""

    key: int
    output: VisionOutput | None
    error: str | None = None
    unavailable: bool = False  # with an error: no encoder could run it (its ranks died), not the item's fault
    wait: float = 0.0  # seconds from submission until a vision tower started on it
    vit: float = 0.0  # its share (by patch count) of the compute time of the pass it ran in
    rank: int = 0  # the encoder rank that ran it


def embedding_key(content_hash: int, lora: TowerAdapter | None) -> int:
    """What keys an item's embeddings: its content hash, moved into a range of its own for the vision tower's
    adapter that makes them (by the adapter's load id)."""
    return content_hash if lora is None else content_hash + (lora.load_id << 128)


class Executor(Protocol):
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future: ...


def encode_tasks(visual: VisionTower, tasks: list[EncodeTask], max_patches: int) -> list[EncodeResult]:
    """Runs `tasks` through the vision tower together. If the batch fails, each task is retried alone,
    so one bad item fails only itself."""
    adapters: TowerLoRA | None = visual.adapters
    if adapters is not None and len({t.lora for t in tasks} - {None}) > adapters.max_loras:
        groups: dict[TowerAdapter | None, list[EncodeTask]] = {}
        for task in tasks:  # (more of the tower's adapters than it has slots: a pass per adapter)
            groups.setdefault(task.lora, []).append(task)
        return [result for group in groups.values() for result in encode_tasks(visual, group, max_patches)]
    started = time.monotonic()
    try:
        outputs, seconds = _forward(visual, tasks, max_patches)
    except Exception as exc:  # noqa: BLE001 - any failure becomes the item's error, never the caller's crash
        if len(tasks) > 1:
            return [result for task in tasks for result in encode_tasks(visual, [task], max_patches)]
        return [EncodeResult(tasks[0].key, None, f"the vision encoder failed on this item: {exc}")]
    total = sum(t.num_patches for t in tasks)
    return [
        EncodeResult(t.key, out, wait=started - t.submitted, vit=seconds * t.num_patches / total)
        for t, out in zip(tasks, outputs)
    ]


def encode_in_passes(
    visual: VisionTower, pixel_values: torch.Tensor, grids: list[Grid], max_patches: int, slots: list[int] | None = None
) -> VisionOutput:
    """The tower's forward in passes of at most `max_patches` patches (at least one temporal patch group),
    so peak memory is bounded by the setting, not by a video's length. Attention never crosses a
    temporal patch group, so cutting a video between groups gives the same embeddings."""
    passes: list[list[tuple[int, Grid, int]]] = [[]]  # (first pixel row, grid, LoRA slot) of each piece
    size, row = 0, 0
    for (t, h, w), slot in zip(grids, slots or [-1] * len(grids), strict=True):
        step = max(1, max_patches // (h * w))  # groups per piece
        for start in range(0, t, step):
            piece = (min(step, t - start), h, w)
            patches = piece[0] * h * w
            if size + patches > max_patches and passes[-1]:
                passes.append([])
                size = 0
            passes[-1].append((row, piece, slot))
            size += patches
            row += patches
    outs = []
    for pieces in passes:
        first, (last, (t, h, w), _) = pieces[0][0], pieces[-1]  # a pass's pieces are consecutive rows
        pass_slots = [s for _, _, s in pieces] if slots is not None else None
        outs.append(visual(pixel_values[first : last + t * h * w], [g for _, g, _ in pieces], pass_slots))
    return VisionOutput.cat(outs)


@torch.inference_mode()
def _forward(visual: VisionTower, tasks: list[EncodeTask], max_patches: int) -> tuple[list[VisionOutput], float]:
    start = time.perf_counter()
    device = visual.device
    # (the values are made on the device from the bytes: a picture's values, 8 times their size, never cross)
    pixels = [t.pixels.values(device) for t in tasks]
    pixels = pixels[0] if len(pixels) == 1 else torch.cat(pixels)
    grids = [t.grid_thw for t in tasks]
    if any(t.lora is not None for t in tasks):
        adapters: TowerLoRA | None = visual.adapters
        if adapters is None:
            raise ValueError("a LoRA adapter of the vision tower, asked of an encoder started without --enable-lora")
        with adapters.using([t.lora for t in tasks]) as slots:
            out = encode_in_passes(visual, pixels, grids, max_patches, slots)
    else:
        out = encode_in_passes(visual, pixels, grids, max_patches)
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
        self.cores: CoreShare | None = None  # the cores it shares with the LLM (a CPU tower in this process)

    @property
    def load(self) -> list[int]:
        """Patches in flight per encoder process (none for an encoder in the scheduler's process)."""
        return []

    @abstractmethod
    def submit(self, tasks: list[EncodeTask]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float = 0.0, llm_busy: bool = False) -> list[EncodeResult]:
        """Results ready now, waiting up to `timeout` seconds for the first one. `llm_busy`: the LLM has
        requests running (whose tokens an encoder in this process should not hold up)."""

    def run_on(self, executor: Executor) -> None:
        """Encoders that compute in the scheduler's process queue that work on `executor` from now on
        (anything with `submit(fn, *args) -> Future`); the others ignore it."""

    def shutdown(self) -> None:
        """Stops whatever the encoder runs; it takes no tasks afterwards."""


class CoreShare:
    """The CPU cores of a process whose vision tower may run beside its LLM: while the tower encodes on
    the side it takes `aside` of the `total` threads, and the LLM's forwards (`llm_threads`) the rest.
    Encoding on the side keeps running requests' tokens coming at a core's pace, where encoding between
    forwards would stop them for the whole encode (a 448 x 448 picture: ~170 ms on two cores)."""

    def __init__(self, total: int, aside: int) -> None:
        self.total, self.aside = total, aside
        self._lock = threading.Lock()
        self._encoding = 0  # encodes on the side started and not finished

    def llm_threads(self) -> int:
        return self.total - self.aside if self._encoding else self.total

    def llm_side(self, forward: Callable[[T], R]) -> Callable[[T], R]:
        """`forward` run with the threads the LLM has at its start (set on the thread that runs it)."""

        def run(batch: T) -> R:
            set_thread_team(self.llm_threads())
            return forward(batch)

        return run

    def begin(self) -> None:
        with self._lock:
            self._encoding += 1

    def end(self) -> None:
        with self._lock:
            self._encoding -= 1


class InlineEncoder(VisionEncoder):
    """Encodes submitted tasks in this process, all together, when polled: on the polling thread, or
    queued on an executor (under overlap scheduling, the forward thread, in order with the forwards).
    With a `CoreShare` (CPU), tasks polled while the LLM is busy are encoded on a thread of their own
    instead, beside the forwards."""

    def __init__(self, visual: VisionTower, max_patches: int, cores: CoreShare | None = None) -> None:
        super().__init__()
        self.visual = visual
        self.max_patches = max_patches
        self.cores = cores
        self.side = ThreadPoolExecutor(1, thread_name_prefix="vit") if cores is not None else None
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

    def poll(self, timeout: float = 0.0, llm_busy: bool = False) -> list[EncodeResult]:
        if self.pending:
            tasks, self.pending = self.pending, []
            if self.side is not None and llm_busy:
                self.running.append(self._beside(tasks))
            elif self.executor is None:
                return self._count(self._encode(tasks))
            else:
                self.running.append(self.executor.submit(self._encode, tasks))
        if not self.running:
            return []
        done, _ = wait(self.running, timeout, FIRST_COMPLETED)
        self.running = [f for f in self.running if f not in done]
        return self._count([r for f in done for r in f.result()])

    def _encode(self, tasks: list[EncodeTask]) -> list[EncodeResult]:
        """On the thread that runs the forwards, with the cores the LLM has now."""
        if self.cores is not None:
            set_thread_team(self.cores.llm_threads())
        return encode_tasks(self.visual, tasks, self.max_patches)

    def _beside(self, tasks: list[EncodeTask]) -> Future[list[EncodeResult]]:
        """Encodes `tasks` on the side thread. The LLM gives up its share of the cores between two forwards
        (queued on the executor, or now where the polling thread runs the forwards), so that no forward
        runs with all threads while the tower computes."""
        result: Future[list[EncodeResult]] = Future()

        def encode() -> None:
            set_thread_team(self.cores.aside)
            try:
                result.set_result(encode_tasks(self.visual, tasks, self.max_patches))
            except BaseException as exc:  # noqa: BLE001 - handed to the poller, as the executor's would be
                result.set_exception(exc)
            finally:
                self.cores.end()

        def start() -> None:
            self.cores.begin()
            self.side.submit(encode)

        if self.executor is None:
            start()
        else:
            self.executor.submit(start)
        return result

    def _count(self, results: list[EncodeResult]) -> list[EncodeResult]:
        self.num_items += sum(r.output is not None for r in results)
        return results

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.shutdown(wait=True)
