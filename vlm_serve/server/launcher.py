"""`vlm-serve serve`: starts the server's processes and runs them until stopped.

On node 0: the scheduler (one process per local TP rank), the encoder pool's ranks (`--vit-dp`), the
detokenizer, and the HTTP server in this process. On the other nodes of a multi-node deployment
(`--nnodes`, `--node-rank`, `--dist-init-addr` as in SGLang): their TP ranks only, which meet node
0's through torch.distributed and get every input from TP rank 0. SIGTERM or Ctrl-C stops every
child; a child that dies stops the server (an encoder rank is restarted instead).
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing as mp

from vlm_serve.config import API_KEY_ENV, ServerArgs
from vlm_serve.disaggregation.bootstrap import BootstrapServer
from vlm_serve.messages.backend import SchedulerLimits
from vlm_serve.model_source import with_local_model
from vlm_serve.process import starting_children
from vlm_serve.server.detokenizer_manager import run_detokenizer_process
from vlm_serve.server.http_server import WATCHDOG_SECONDS, serve_http
from vlm_serve.server.ports import PortArgs, free_port
from vlm_serve.server.processes import ServerProcesses
from vlm_serve.server.scheduler_process import run_scheduler_process
from vlm_serve.vision.pool import EncoderConcerns, EncoderRanks, PoolAddresses

STARTUP_TIMEOUT = 900.0  # seconds for the model to load (a 235B checkpoint takes minutes)


def start_processes(children: ServerProcesses, server_args: ServerArgs, port_args: PortArgs | None) -> list[Connection]:
    """Starts this node's children into `children` (so that those started are stopped should this be
    interrupted); returns a pipe per local TP rank on which it reports that it is ready."""
    # on CPU a child forked from this process starts with its modules imported (half a server's start);
    # CUDA cannot be used in a forked child, so GPU ranks start afresh
    ctx = mp.get_context("fork" if server_args.device == "cpu" else "spawn")
    init_addr = server_args.dist_init_addr or f"127.0.0.1:{free_port()}"
    readies = []
    for rank in server_args.node_tp_ranks:
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=run_scheduler_process,
            args=(server_args, port_args, rank, init_addr, writer),
            name=f"scheduler TP{rank}",
            daemon=True,
        )
        with starting_children():
            process.start()
            children.schedulers.append(process)
        writer.close()
        readies.append(reader)
    if port_args is not None:
        process = ctx.Process(
            target=run_detokenizer_process, args=(server_args, port_args), name="detokenizer", daemon=True
        )
        with starting_children():
            process.start()
            children.detokenizer = process
    if port_args is not None and port_args.encoder is not None:  # they load while the LLM does
        children.encoders = EncoderRanks(EncoderConcerns.of(server_args), port_args.encoder)
    return readies


def await_ready(children: ServerProcesses, readies: list[Connection], ranks: range) -> SchedulerLimits:
    """The first local rank's limits once every local rank has loaded the model; RuntimeError if one
    fails."""
    limits: list[SchedulerLimits] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for rank, conn in zip(ranks, readies):
        while not conn.poll(0.2):
            children.restart_encoders()
            if children.dead():
                raise RuntimeError(f"startup failed: {children.dead()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"startup failed: scheduler TP{rank} was not ready after {STARTUP_TIMEOUT:.0f} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"startup failed: {children.dead() or f'scheduler TP{rank} closed its pipe'}") from None
        if kind != "ready":
            raise RuntimeError(f"startup failed: scheduler TP{rank} could not start:\n{payload}")
        limits.append(payload)
    return limits[0]


def launch_server(server_args: ServerArgs) -> int:
    """Runs this node's part of the server until SIGTERM / Ctrl-C (exit code 0) or a child's death (1).
    Stopped before it serves, it stops the children started so far, then raises (KeyboardInterrupt for
    Ctrl-C, SystemExit(1) for SIGTERM)."""
    server_args = server_args.with_api_key(os.environ)  # the children get it pickled, not on a command line
    forget_environment_variable(API_KEY_ENV)  # nor in their environment
    server_args = with_local_model(server_args)  # (after the settings' own checks: it may download)
    # bound before the model loads, so that a port in use is refused at once (it listens once ready)
    http_socket = bind_http_socket(server_args.host, server_args.port) if server_args.node_rank == 0 else None
    bootstrap = None  # a PD prefill server's registry of its ranks, for decode servers to find them
    if server_args.disaggregation_mode == "prefill" and server_args.node_rank == 0:
        try:
            bootstrap = BootstrapServer(server_args.host, server_args.disaggregation_bootstrap_port).start()
        except ValueError:
            if http_socket is not None:
                http_socket.close()
            raise
    signal.signal(signal.SIGTERM, _raise_exit)  # while starting: unwind through `finally`, stopping children
    ipc_dir = tempfile.mkdtemp(prefix="vlm-serve-")
    port_args = None
    if http_socket is not None:
        port_args = PortArgs(*(f"ipc://{ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer")))
        if server_args.vit_dp > 0:
            port_args.encoder = PoolAddresses.in_dir(ipc_dir, server_args.vit_dp)
    children = ServerProcesses([])
    try:
        readies = start_processes(children, server_args, port_args)
        limits = await_ready(children, readies, server_args.node_tp_ranks)
        if http_socket is None:
            failure = _watch_node(server_args, children)
        else:
            failure = serve_http(server_args, port_args, limits, children, http_socket)
    except RuntimeError as exc:
        print(f"vlm-serve: {exc}", file=sys.stderr)
        return 1
    finally:
        children.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        if http_socket is not None:
            http_socket.close()
        if bootstrap is not None:
            bootstrap.stop()
    if failure:
        print(f"vlm-serve: stopped because {failure}", file=sys.stderr)
        return 1
    return 0


def forget_environment_variable(name: str) -> None:
    """Drops `name` from the environment, and blanks its value where the process's first environment
    lies: what /proc/PID/environ and `ps e` show, of this process and of the children forked from it."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_void_p
    if value := libc.getenv(name.encode()):
        ctypes.memset(value, ord("*"), len(ctypes.string_at(value)))
    os.environ.pop(name, None)


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound; a ValueError naming the address if it cannot be (in use, say)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed server's port is free
    multiprocessing.util.register_after_fork(sock, socket.socket.close)  # (a forked child holds no port)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _watch_node(server_args: ServerArgs, children: ServerProcesses) -> str:
    """A node other than 0: its TP ranks run until one of them exits (node 0 went away, say)."""
    ranks = server_args.node_tp_ranks
    print(f"vlm-serve: node {server_args.node_rank} ready (TP ranks {ranks.start}..{ranks.stop - 1})", flush=True)
    signal.signal(signal.SIGINT, _raise_exit)
    try:
        while not (failure := children.dead()):
            time.sleep(WATCHDOG_SECONDS)
    except SystemExit:
        return ""
    return failure


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(1)
