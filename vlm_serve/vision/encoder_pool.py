"""The encoder pool: `--vit-dp N` processes, each with its own vision tower, in front of the scheduler.

Each rank holds a full replica of the (small) vision tower on its own device: GPU `i`, or on CPU a share
of the cores (`--vit-threads`). A submitted batch is split across ranks balanced by patch count, the
measure of ViT work (a video is one item). Pixel values and embeddings cross the process boundary as
shared-memory tensors (CPU) or CUDA IPC handles copied on arrival (GPU); only small metadata goes
through the channels. Jobs go out on a queue whose feeder thread does the writing and results come
back on a pipe the parent reads at every poll, so neither side can block the other.

A rank that dies (killed, out of memory) is restarted and its in-flight tasks are submitted again; a
task whose ranks died `MAX_ATTEMPTS` times, or that the tower rejects, comes back as an error result.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import sys
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

import torch
import torch.multiprocessing as mp

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.vision.vision_tower import load_vision_model
from vlm_serve.vision.encoder import EncodeResult, EncodeTask, InlineEncoder, VisionEncoder, encode_tasks
from vlm_serve.vision.vision_tower import VisionOutput

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # a task is given up after this many of its ranks died holding it
MAX_START_FAILURES = 3  # a rank that fails to start this many times in a row stays down
STARTUP_TIMEOUT = 600.0  # seconds for the ranks to load their weights at pool start
SHUTDOWN_TIMEOUT = 5.0
STALL_TIMEOUT = 600.0  # a rank with work that sends nothing for this long is taken as hung and killed
PARENT_CHECK_SECONDS = 1.0  # an idle rank checks this often that its parent still lives


@dataclass(eq=False)
class _Rank:
    """The parent's handle on one encoder process."""

    index: int
    process: BaseProcess
    jobs_out: Queue  # parent -> rank: (job id, tasks), or None to stop
    conn: Connection  # rank -> parent: ("ready",), ("error", message), ("done", job id, results)
    ready: bool = False
    start_failures: int = 0
    jobs: dict[int, list[EncodeTask]] = field(default_factory=dict)  # in flight, by job id
    last_heard: float = 0.0  # time.monotonic() of its last message, or of being given work while idle

    @property
    def load(self) -> int:
        return sum(t.num_patches for tasks in self.jobs.values() for t in tasks)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()


class EncoderPool(VisionEncoder):
    """`server_args.vit_dp` encoder processes. Results arrive on `device` (the LLM's)."""

    def __init__(self, server_args: ServerArgs, device: torch.device) -> None:
        super().__init__()
        self.server_args = server_args
        self.device = device
        self._ctx = mp.get_context("spawn")
        self._job_ids = itertools.count()
        self._orphans: list[EncodeTask] = []  # tasks of dead ranks waiting for a live one
        self.ranks = [self._start(i) for i in range(server_args.vit_dp)]
        self._finalizer = weakref.finalize(self, _stop_ranks, self.ranks)  # also when dropped unshut
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for rank in self.ranks:
            error = self._await_ready(rank, deadline)
            if error is not None:
                self.shutdown()
                raise RuntimeError(f"encoder rank {rank.index} failed to start: {error}")

    # ---- processes ---------------------------------------------------------------------------------

    def _start(self, index: int) -> _Rank:
        jobs = self._ctx.Queue()
        receiver, sender = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=rank_main, args=(self.server_args, index, jobs, sender), name=f"vit-rank-{index}", daemon=True
        )
        with _main_module_hidden():
            process.start()
        sender.close()
        return _Rank(index, process, jobs, receiver)

    def _await_ready(self, rank: _Rank, deadline: float) -> str | None:
        """Blocks until `rank` has loaded its weights; the reason when it cannot."""
        while not rank.ready:
            if not wait([rank.conn, rank.process.sentinel], max(deadline - time.monotonic(), 0)):
                return f"not ready within {STARTUP_TIMEOUT:.0f} s"
            try:
                message = rank.conn.recv()
            except (EOFError, OSError):
                return f"the process exited with code {rank.process.exitcode}"
            if message[0] == "error":
                return message[1]
            rank.ready = message[0] == "ready"
        return None

    def _restart(self, rank: _Rank) -> None:
        """Replaces a dead rank's process; its in-flight tasks go back to the pool."""
        for tasks in rank.jobs.values():
            self._orphans.extend(tasks)
        rank.jobs.clear()
        _close_channels(rank)
        if rank.process.is_alive():
            rank.process.kill()
        rank.process.join()
        if not rank.ready:
            rank.start_failures += 1
        if rank.start_failures >= MAX_START_FAILURES:
            logger.error("encoder rank %d failed to start %d times; it stays down", rank.index, rank.start_failures)
            return
        logger.warning("encoder rank %d died (exit code %s); restarting it", rank.index, rank.process.exitcode)
        fresh = self._start(rank.index)
        rank.process, rank.jobs_out, rank.conn, rank.ready = fresh.process, fresh.jobs_out, fresh.conn, False
        self.num_restarts += 1

    @property
    def load(self) -> list[int]:
        return [rank.load for rank in self.ranks]

    def _usable(self) -> list[_Rank]:
        return [r for r in self.ranks if r.start_failures < MAX_START_FAILURES]

    # ---- tasks -------------------------------------------------------------------------------------

    def submit(self, tasks: list[EncodeTask]) -> None:
        now = time.monotonic()
        for task in tasks:
            task.submitted = now
        self._dispatch(tasks)

    def _dispatch(self, tasks: list[EncodeTask]) -> None:
        """Longest-first onto the least loaded rank (by patches in flight), one job per rank. Ranks
        still loading their weights (restarting) get work only when no rank is ready."""
        ranks = [r for r in self._usable() if r.ready] or self._usable()
        if not ranks:
            self._orphans.extend(tasks)
            return
        loads = {rank: rank.load for rank in ranks}
        assigned: dict[_Rank, list[EncodeTask]] = {}
        for task in sorted(tasks, key=lambda t: t.num_patches, reverse=True):
            rank = min(ranks, key=lambda r: (loads[r], r.index))
            loads[rank] += task.num_patches
            assigned.setdefault(rank, []).append(task)
        for rank, job in assigned.items():
            if not rank.jobs:
                rank.last_heard = time.monotonic()
            for task in job:
                # Moved to shared memory here, not by the queue's feeder thread: torch work on a second
                # thread starts a second OpenMP pool, and the oversubscribed cores then slow every
                # later LLM step several-fold.
                task.pixel_values.share_memory_()
            job_id = next(self._job_ids)
            rank.jobs[job_id] = job
            rank.jobs_out.put((job_id, job))  # if the rank is dead, the next poll resubmits the job

    def poll(self, timeout: float = 0.0) -> list[EncodeResult]:
        results: list[EncodeResult] = []
        waiting = [r for r in self._usable() if r.jobs or not r.ready]
        if waiting:
            handles = [r.conn for r in waiting] + [r.process.sentinel for r in waiting]
            wait(handles, timeout)
        for rank in self._usable():
            self._receive(rank, results)
        now = time.monotonic()
        for rank in self._usable():
            if rank.ready and rank.jobs and now - rank.last_heard > STALL_TIMEOUT and rank.alive:
                logger.error("encoder rank %d made no progress for %.0f s; killing it", rank.index, STALL_TIMEOUT)
                rank.process.kill()
                rank.process.join()
            if not rank.alive:
                self._restart(rank)
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            retry = []
            for task in orphans:
                task.attempts += 1
                if not self._usable():
                    results.append(EncodeResult(task.hash, None, "no encoder rank is running (they fail to start)"))
                elif task.attempts >= MAX_ATTEMPTS:
                    error = f"encoder ranks died {task.attempts} times while encoding it"
                    results.append(EncodeResult(task.hash, None, error))
                else:
                    retry.append(task)
            self._dispatch(retry)
        return results

    def _receive(self, rank: _Rank, results: list[EncodeResult]) -> None:
        try:
            while rank.conn.poll():
                message = rank.conn.recv()
                rank.last_heard = time.monotonic()
                if message[0] == "ready":
                    rank.ready, rank.start_failures = True, 0
                elif message[0] == "done":
                    _, job_id, job_results = message
                    rank.jobs.pop(job_id, None)
                    for result in job_results:
                        result.rank = rank.index
                        if result.output is not None:
                            result.output = self._arrived(result.output)
                            self.num_items += 1
                        results.append(result)
                elif message[0] == "error":
                    logger.error("encoder rank %d cannot start: %s", rank.index, message[1])
        except Exception:  # noqa: BLE001 - a message that cannot be read (e.g. its sender died mid-way)
            # the rank is broken: make sure it is gone; the liveness check restarts it
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join()

    def _arrived(self, output: VisionOutput) -> VisionOutput:
        """A received output in the LLM's memory: a shared-memory CPU tensor is used as is; a CUDA one
        (an IPC handle into the rank's GPU memory) is copied so the rank can free and reuse it."""
        if not output.embeds.is_cuda:
            return output
        return VisionOutput(
            output.embeds.to(self.device, copy=True), [d.to(self.device, copy=True) for d in output.deepstack]
        )

    def shutdown(self) -> None:
        self._finalizer()


def _stop_ranks(ranks: list[_Rank]) -> None:
    """Asks every rank to stop, then kills those still running after `SHUTDOWN_TIMEOUT`."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.jobs_out.put(None)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT
    for rank in ranks:
        rank.process.join(max(deadline - time.monotonic(), 0))
        if rank.process.is_alive():
            rank.process.kill()
            rank.process.join()
        _close_channels(rank)
    ranks.clear()


def _close_channels(rank: _Rank) -> None:
    rank.conn.close()
    rank.jobs_out.cancel_join_thread()  # jobs a dead rank never read must not hold up exit
    rank.jobs_out.close()


@contextlib.contextmanager
def _main_module_hidden():
    """A spawned process first re-runs the parent's `__main__` script, found through its `__spec__` and
    `__file__`. A rank needs nothing from it, and re-running a script without an `if __name__ ==
    "__main__"` guard (or stdin, or a notebook) would fail or start engines recursively."""
    main = sys.modules["__main__"]
    saved_spec, saved_file = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


def create_encoder(server_args: ServerArgs, model_config: ModelConfig, device: torch.device) -> VisionEncoder:
    """The encoder `server_args` asks for: a pool of `vit_dp` processes, or (`vit_dp` 0) the vision
    tower on `device` in this process."""
    if server_args.vit_dp > 0:
        return EncoderPool(server_args, device)
    visual = load_vision_model(model_config, device, server_args.resolved_dtype(model_config))
    return InlineEncoder(visual, server_args.vit_max_patches_per_pass)


def rank_device(server_args: ServerArgs, index: int) -> torch.device:
    device = server_args.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", index % torch.cuda.device_count())
    return device


def rank_threads(server_args: ServerArgs) -> int:
    """CPU threads of one rank: `vit_threads`, or an equal share of the cores with the LLM process."""
    if server_args.vit_threads is not None:
        return server_args.vit_threads
    return max(1, len(os.sched_getaffinity(0)) // (server_args.vit_dp + 1))


def llm_threads(server_args: ServerArgs) -> int:
    """CPU threads left to the LLM process next to the pool's ranks (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) - server_args.vit_dp * rank_threads(server_args))


def rank_main(server_args: ServerArgs, index: int, jobs: Queue, conn: Connection) -> None:
    """An encoder process: load the vision tower, then encode jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
    torch.set_num_threads(rank_threads(server_args))
    try:
        device = rank_device(server_args, index)
        config = ModelConfig.from_pretrained(server_args.model)
        visual = load_vision_model(config, device, server_args.resolved_dtype(config))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the pool's start
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    parent = mp.parent_process()
    while True:
        try:
            message = jobs.get(timeout=PARENT_CHECK_SECONDS)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return  # the parent was killed without a chance to stop us
            continue
        if message is None:
            return
        job_id, tasks = message
        results = encode_tasks(visual, tasks, server_args.vit_max_patches_per_pass)
        try:
            conn.send(("done", job_id, results))
        except OSError:
            return  # the parent is gone
