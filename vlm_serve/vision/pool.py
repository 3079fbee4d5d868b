"""The encoder pool: `--vit-dp N` processes, each with its own vision tower, working for the scheduler.

Three parts. `rank_main` is an encoder process: it loads the tower, then encodes the jobs it is sent.
`EncoderRanks` starts those processes and restarts the ones that die; the server launcher owns it (the
pool is a role of its own, beside the TP ranks), or an in-process pool (`Engine`). `EncoderPool` is
the scheduler's side, on TP rank 0: it splits submitted items across ranks balanced by patch count (the
measure of ViT work; a video is one item), collects results and resubmits the work of a rank that died.

They talk over ZMQ at `PoolAddresses`: each rank binds a job socket that the pool connects to, and
every rank (and `EncoderRanks`) pushes its events to one socket the pool binds. Pixel values and
embeddings cross as shared-memory tensors (CPU) or CUDA IPC handles copied on arrival (GPU); only small
metadata goes through the sockets. Each rank holds a full replica of the (small) tower on its own
device: GPU `i`, or on CPU a share of the cores (`--vit-threads`).

A dead rank is noticed by the pool through a pidfd, and is never given work once its process has
exited; its in-flight tasks go to the other ranks. A task whose ranks died `MAX_ATTEMPTS` times while
encoding it (a job a rank had not begun does not count: it cannot have killed it), or that no rank is
left to run, comes back as an `unavailable` error result; one the tower rejects as a plain error.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp
import zmq

from vlm_serve.config import Concerns, EncoderSettings, LoRASettings, ModelConfig, ModelSettings
from vlm_serve.ipc import recv_pyobj, send_pyobj, zmq_context
from vlm_serve.llm.lora.adapter import TowerLoRA
from vlm_serve.llm.models.base import VisionOutput
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.llm.models.registry import LORA, require
from vlm_serve.process import exits_at_once, init_child_process, rank_threads, starting_children, stop_signals_deferred
from vlm_serve.vision.encoder import CoreShare, EncodeResult, EncodeTask, InlineEncoder, VisionEncoder, encode_tasks

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # a task is given up after this many of its ranks died encoding it
MAX_START_FAILURES = 3  # a rank that fails to start this many times in a row stays down
STARTUP_TIMEOUT = 600.0  # seconds for the ranks to load their weights at pool start
SHUTDOWN_TIMEOUT = 5.0
STALL_TIMEOUT = 600.0  # a rank with work that sends nothing for this long is taken as hung and killed
PARENT_CHECK_MS = 1000  # an idle rank checks this often that its parent still lives


@dataclass
class PoolAddresses:
    """ZMQ addresses of the pool: where rank i takes jobs, and where the pool hears from the ranks."""

    jobs: list[str]
    events: str

    @classmethod
    def in_dir(cls, directory: str, size: int) -> PoolAddresses:
        return cls([f"ipc://{directory}/encoder-jobs-{i}" for i in range(size)], f"ipc://{directory}/encoder-events")


@dataclass(frozen=True)
class EncoderConcerns(Concerns):
    """What the encoder reads, in-process or in its ranks: the checkpoint and how it is loaded, where and
    how the tower runs, the tower's LoRA slots."""

    model: ModelSettings
    encoder: EncoderSettings
    lora: LoRASettings


# ---- an encoder process ------------------------------------------------------------------------------


@exits_at_once
def rank_main(settings: EncoderConcerns, index: int, addresses: PoolAddresses, loaded: Connection) -> None:
    """An encoder process: load the vision tower, say so on `loaded` (a pipe to `EncoderRanks`), then
    encode jobs until stopped. Events it sends: ("ready", index, pid), ("error", index, message) when it
    cannot start, ("started", index, job id) and ("done", index, job id, results)."""
    init_child_process(f"vlm-encoder-{index}")
    torch.set_num_threads(rank_threads(settings.encoder))
    context = zmq_context()
    events = context.socket(zmq.PUSH)
    events.connect(addresses.events)
    try:
        jobs = context.socket(zmq.PULL)
        jobs.bind(addresses.jobs[index])
        config = ModelConfig.from_pretrained(settings.model.model, settings.model.quantization)
        device = rank_device(settings.model, index)
        visual = load_vision_tower(settings, config, device)
    except Exception as exc:  # noqa: BLE001 - reported to the pool, which fails to start
        send_pyobj(events, ("error", index, f"{type(exc).__name__}: {exc}"))
        events.close(linger=5000)
        return
    try:
        loaded.send_bytes(b"")
    except BrokenPipeError:
        return  # the owner was killed without a chance to stop us
    loaded.close()
    send_pyobj(events, ("ready", index, os.getpid()))
    parent = mp.parent_process()
    while True:
        if not jobs.poll(PARENT_CHECK_MS):
            if parent is not None and not parent.is_alive():
                return  # the owner was killed without a chance to stop us
            continue
        job_id, tasks = recv_pyobj(jobs)
        send_pyobj(events, ("started", index, job_id))
        results = encode_tasks(visual, tasks, settings.encoder.vit_max_patches_per_pass)
        send_pyobj(events, ("done", index, job_id, results))


def rank_device(model: ModelSettings, index: int) -> torch.device:
    device = model.resolved_device()
    if device.type == "cuda":
        return torch.device("cuda", index % torch.cuda.device_count())
    return device


# ---- starting and restarting them ----------------------------------------------------------------------


@dataclass(eq=False)
class _Process:
    index: int
    process: BaseProcess
    loaded: Connection  # a message on it once the rank's tower is loaded, EOF alone if it died before
    start_failures: int = 0  # deaths before loading, in a row
    down: bool = False


class EncoderRanks:
    """Starts the `vit_dp` encoder processes and, at each `check`, restarts those that died. A rank that
    fails to start `MAX_START_FAILURES` times in a row stays down, and the pool is told so."""

    def __init__(self, settings: EncoderConcerns, addresses: PoolAddresses) -> None:
        self.settings = settings
        self.addresses = addresses
        # Ranks are forked from a server process that has imported this module (torch with it) once:
        # a rank that died is back in a fraction of a second instead of re-importing torch. (Importing
        # must not initialize CUDA, which a forked process could not use; the ranks do that themselves.)
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload([__name__])
        with starting_children():  # the fork server (importing torch for seconds), and so its forks
            forkserver.ensure_running()
        self._events = zmq.Context.instance().socket(zmq.PUSH)
        self._events.connect(addresses.events)
        self.ranks: list[_Process] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.ranks)  # also when dropped unstopped
        try:
            for i in range(settings.encoder.vit_dp):  # (the first waits for the fork server to import torch)
                self.ranks.append(self._start(i))
        except BaseException:  # Ctrl-C, say: no rank outlives a start that did not finish
            self.stop()
            raise

    def _start(self, index: int) -> _Process:
        # (a pipe, not an Event: that is five named semaphores, reported as leaked by multiprocessing's
        # resource tracker when the server ends through os._exit)
        loaded, tells_loaded = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=rank_main,
            args=(self.settings, index, self.addresses, tells_loaded),
            name=f"vit-rank-{index}",
            daemon=True,
        )
        # A stop signal waits for the fork server's answer: a rank forked for a start cut short would run
        # unknown to us, and so unstopped.
        with _main_module_hidden(), stop_signals_deferred():
            process.start()
        tells_loaded.close()  # the rank holds the only write end: its death is EOF
        return _Process(index, process, loaded)

    @property
    def processes(self) -> list[BaseProcess]:
        return [r.process for r in self.ranks]

    @property
    def failure(self) -> str:
        """Why no image or video can be encoded ('' while a rank runs or may still come back)."""
        if not all(r.down for r in self.ranks):
            return ""
        return f"no encoder rank is running (each failed to start {MAX_START_FAILURES} times in a row)"

    def check(self) -> None:
        """Restarts the ranks that died (a pool waiting for them resubmits their work elsewhere)."""
        for rank in self.ranks:
            if rank.down or rank.process.is_alive():
                continue
            rank.process.join()
            rank.start_failures = 0 if _had_loaded(rank.loaded) else rank.start_failures + 1
            rank.loaded.close()
            if rank.start_failures >= MAX_START_FAILURES:
                reason = f"it failed to start {rank.start_failures} times in a row"
                logger.error("encoder rank %d stays down: %s", rank.index, reason)
                rank.down = True
                send_pyobj(self._events, ("down", rank.index, reason))
                continue
            logger.warning("encoder rank %d died (exit code %s); restarting it", rank.index, rank.process.exitcode)
            fresh = self._start(rank.index)
            rank.process, rank.loaded = fresh.process, fresh.loaded

    def stop(self) -> None:
        self._finalizer()


def _had_loaded(loaded: Connection) -> bool:
    """Whether an exited rank had loaded its tower: its message waits on `loaded`, not EOF alone."""
    try:
        return loaded.poll() and loaded.recv_bytes() == b""
    except EOFError:
        return False


def _stop_processes(ranks: list[_Process]) -> None:
    """SIGTERM to every rank, then SIGKILL to those still running after `SHUTDOWN_TIMEOUT`."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.terminate()
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT
    for rank in ranks:
        rank.process.join(max(deadline - time.monotonic(), 0))
        if rank.process.is_alive():
            rank.process.kill()
            rank.process.join()
        rank.loaded.close()


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


# ---- the scheduler's side ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Rank:
    """The pool's view of one encoder rank (whichever process currently plays it)."""

    index: int
    jobs_out: zmq.Socket  # connected to the rank's job address; replaced when the rank dies
    pid: int | None = None  # of the process that said it was ready
    pidfd: int | None = None  # readable once that process has exited
    ready: bool = False
    down: bool = False  # it will not come back
    incarnations: int = 0  # processes that said they were ready
    jobs: dict[int, list[EncodeTask]] = field(default_factory=dict)  # in flight, by job id
    started: set[int] = field(default_factory=set)  # the jobs it has begun to encode
    last_heard: float = 0.0  # time.monotonic() of its last event, or of being given work while idle

    @property
    def load(self) -> int:
        return sum(t.num_patches for tasks in self.jobs.values() for t in tasks)


class EncoderPool(VisionEncoder):
    """The scheduler's handle on the encoder ranks at `addresses`; results arrive on `device` (the LLM's).

    `supervisor` is the `EncoderRanks` running them when this pool owns them (in `Engine`, see
    `EncoderPool.start`); in the server the launcher owns them."""

    def __init__(
        self,
        device: torch.device,
        addresses: PoolAddresses,
        supervisor: EncoderRanks | None = None,
    ) -> None:
        super().__init__()
        self.device = device
        self.addresses = addresses
        self.supervisor = supervisor
        self._context = zmq_context()
        self._sockets: list[zmq.Socket] = []  # every socket opened, so that all are closed
        # also when dropped without shutdown(): a context collected with open sockets would hang
        self._finalizer = weakref.finalize(self, _close, self._sockets, self._context)
        self._events = self._socket(zmq.PULL)
        self._events.bind(addresses.events)
        self.ranks = [_Rank(i, self._connect(i)) for i in range(len(addresses.jobs))]
        self._job_ids = itertools.count()
        self._orphans: list[EncodeTask] = []  # tasks of dead ranks waiting for a live one
        self._owned_dir: str | None = None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not all(r.ready or r.down for r in self.ranks):
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the encoder ranks were not ready within {STARTUP_TIMEOUT:.0f} s")
            try:
                self.poll(timeout=0.1)
            except RuntimeError:
                self.shutdown()
                raise
        if not self._usable():
            self.shutdown()
            raise RuntimeError("no encoder rank could start")

    @classmethod
    def start(cls, settings: EncoderConcerns, device: torch.device) -> EncoderPool:
        """A pool with ranks of its own (started here, stopped by `shutdown`), at private addresses."""
        directory = tempfile.mkdtemp(prefix="vlm-serve-encoders-")
        addresses = PoolAddresses.in_dir(directory, settings.encoder.vit_dp)
        supervisor = EncoderRanks(settings, addresses)
        try:
            pool = cls(device, addresses, supervisor)
        except BaseException:
            supervisor.stop()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        pool._owned_dir = directory
        return pool

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self._context.socket(kind)
        self._sockets.append(socket)
        return socket

    def _connect(self, index: int) -> zmq.Socket:
        socket = self._socket(zmq.PUSH)
        socket.connect(self.addresses.jobs[index])
        return socket

    @property
    def load(self) -> list[int]:
        return [rank.load for rank in self.ranks]

    def _usable(self) -> list[_Rank]:
        return [r for r in self.ranks if not r.down]

    # ---- tasks -------------------------------------------------------------------------------------

    def submit(self, tasks: list[EncodeTask]) -> None:
        now = time.monotonic()
        for task in tasks:
            task.submitted = now
        self._dispatch(tasks)

    def _dispatch(self, tasks: list[EncodeTask]) -> None:
        """Longest-first onto the least loaded ready rank (by patches in flight), one job per rank; never
        onto a rank whose process has exited, noticed or not (the next `poll` takes its work back). With
        no rank ready (they are restarting) the tasks wait for one."""
        ranks = [r for r in self.ranks if r.ready and not _exited(r.pidfd)]
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
            job_id = next(self._job_ids)
            rank.jobs[job_id] = job
            send_pyobj(rank.jobs_out, (job_id, job))  # pixels go as shared memory (moved there by the front end)

    def poll(self, timeout: float = 0.0, llm_busy: bool = False) -> list[EncodeResult]:
        results: list[EncodeResult] = []
        if any(r.jobs or not (r.ready or r.down) for r in self.ranks) or self._orphans:
            poller = zmq.Poller()
            poller.register(self._events, zmq.POLLIN)
            for rank in self.ranks:
                if rank.pidfd is not None:
                    poller.register(rank.pidfd, zmq.POLLIN)
            poller.poll(timeout * 1000)
        self._receive(results)  # (first: a dead rank's last events say which of its jobs it had begun)
        now = time.monotonic()
        for rank in self.ranks:
            if rank.ready and _exited(rank.pidfd):
                self._lost(rank)
            elif rank.ready and rank.jobs and now - rank.last_heard > STALL_TIMEOUT:
                logger.error("encoder rank %d made no progress for %.0f s; killing it", rank.index, STALL_TIMEOUT)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.pid, signal.SIGKILL)
                self._lost(rank)
        if self.supervisor is not None:
            self.supervisor.check()
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            retry = []
            for task in orphans:
                if not self._usable():
                    error = "no encoder rank is running (they fail to start)"
                elif task.attempts >= MAX_ATTEMPTS:
                    error = f"encoder ranks died {task.attempts} times while encoding it"
                else:
                    retry.append(task)
                    continue
                results.append(EncodeResult(task.key, None, error, unavailable=True))
            self._dispatch(retry)
        return results

    def _receive(self, results: list[EncodeResult]) -> None:
        while True:
            try:
                event = recv_pyobj(self._events, zmq.NOBLOCK)
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - e.g. results whose sender died before we mapped them
                logger.warning("an encoder event could not be read; its work will be redone")
                continue
            kind, index, *rest = event
            rank = self.ranks[index]
            if kind == "ready":
                self._ready(rank, rest[0])
            elif kind == "started":
                if rest[0] in rank.jobs:
                    rank.started.add(rest[0])
                    rank.last_heard = time.monotonic()
            elif kind == "done":
                job_id, job_results = rest
                if rank.jobs.pop(job_id, None) is None:
                    continue  # a job given up when its rank was taken for dead
                rank.started.discard(job_id)
                rank.last_heard = time.monotonic()
                for result in job_results:
                    result.rank = index
                    if result.output is not None:
                        result.output = self._arrived(result.output)
                        self.num_items += 1
                    results.append(result)
            elif kind == "error":
                if rank.incarnations == 0:
                    raise RuntimeError(f"encoder rank {index} failed to start: {rest[0]}")
                logger.error("encoder rank %d cannot start: %s", index, rest[0])
            elif kind == "down":
                if rank.ready:  # its last process died unnoticed
                    self._lost(rank)
                rank.down = True

    def _ready(self, rank: _Rank, pid: int) -> None:
        if rank.ready:  # the process before died unnoticed, and was replaced already
            self._lost(rank)
        if rank.incarnations:
            self.num_restarts += 1
        rank.incarnations += 1
        rank.pid, rank.ready, rank.down = pid, True, False
        try:
            rank.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # gone already
            rank.pidfd = None
            self._lost(rank)
        if self._orphans:
            orphans, self._orphans = self._orphans, []
            self._dispatch(orphans)

    def _lost(self, rank: _Rank) -> None:
        """Its process died: its tasks go back to the pool (an attempt counts against those it had begun),
        and its job socket is replaced so that jobs queued for the dead process are dropped rather than
        handed to the next one."""
        logger.warning(
            "encoder rank %d (pid %s) is gone; its %d job(s) go to the other ranks",
            rank.index,
            rank.pid,
            len(rank.jobs),
        )
        for job_id, tasks in rank.jobs.items():
            for task in tasks:
                if job_id in rank.started:
                    task.attempts += 1
                self._orphans.append(task)
        rank.jobs.clear()
        rank.started.clear()
        rank.ready = False
        if rank.pidfd is not None:
            os.close(rank.pidfd)
            rank.pidfd = None
        rank.jobs_out.close()
        self._sockets.remove(rank.jobs_out)
        rank.jobs_out = self._connect(rank.index)

    def _arrived(self, output: VisionOutput) -> VisionOutput:
        """A received output in the LLM's memory: a shared-memory CPU tensor is used as is; a CUDA one
        (an IPC handle into the rank's GPU memory) is copied so the rank can free and reuse it."""
        if not output.embeds.is_cuda:
            return output
        return VisionOutput(
            output.embeds.to(self.device, copy=True), [d.to(self.device, copy=True) for d in output.deepstack]
        )

    def shutdown(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        for rank in self.ranks:
            if rank.pidfd is not None:
                os.close(rank.pidfd)
                rank.pidfd = None
        self._finalizer()
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


def _close(sockets: list[zmq.Socket], context: zmq.Context) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


def _exited(pidfd: int | None) -> bool:
    """Whether the process behind `pidfd` has exited (a pidfd polls readable then)."""
    return pidfd is not None and bool(select.select([pidfd], [], [], 0)[0])


def create_encoder(
    settings: EncoderConcerns, model_config: ModelConfig, device: torch.device, pool: PoolAddresses | None = None
) -> VisionEncoder:
    """The encoder `settings` ask for: with `vit_dp` > 0 the pool at `pool` (whose ranks the server
    launcher runs), or, without addresses, a pool with ranks of its own; with `vit_dp` 0 the vision
    tower on `device` in this process."""
    encoder = settings.encoder
    if encoder.vit_dp > 0:
        return EncoderPool(device, pool) if pool is not None else EncoderPool.start(settings, device)
    visual = load_vision_tower(settings, model_config, device)
    threads = torch.get_num_threads()
    cores = None
    if device.type == "cpu" and threads > 1:  # the tower beside running requests: half the cores, or vit_threads
        cores = CoreShare(threads, min(encoder.vit_threads or threads // 2, threads - 1))
    return InlineEncoder(visual, encoder.vit_max_patches_per_pass, cores)


def load_vision_tower(settings: EncoderConcerns, config: ModelConfig, device: torch.device):
    """The vision tower as `settings` have it loaded, on `device`."""
    model, lora = settings.model, settings.lora
    if lora.enable_lora:
        require(config, LORA)
    dtype, weight_dtype = model.resolved_dtype(config), model.resolved_weight_dtype(config)
    visual = load_vision_model(config, device, dtype, weight_dtype, model.load_format == "dummy")
    if lora.enable_lora:
        visual.adapters = TowerLoRA(visual, lora.max_loras, lora.max_lora_rank)
    return visual
