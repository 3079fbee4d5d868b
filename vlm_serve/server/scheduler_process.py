"""The scheduler process, one per TP rank: builds the model runner, the encoder (rank 0) and the
`Scheduler`, reports that it is ready, then runs the scheduler's event loop. Rank 0 alone talks to the
other processes, over ZMQ (`ZmqSchedulerIO`); the scheduler broadcasts what it receives to the others.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.scheduler.scheduler import Scheduler
from vlm_serve.server.io_struct import PortArgs, recv_pyobj, send_pyobj
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder_pool import create_encoder

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle process waits this long for a message before checking on its parent


class ZmqSchedulerIO:
    """Rank 0's I/O: requests from the HTTP process, outputs to the detokenizer."""

    def __init__(self, port_args: PortArgs) -> None:
        context = zmq.Context()
        self.recv_from_tokenizer = context.socket(zmq.PULL)
        self.recv_from_tokenizer.bind(port_args.scheduler_input)
        self.send_to_detokenizer = context.socket(zmq.PUSH)
        self.send_to_detokenizer.connect(port_args.detokenizer_input)
        self.parent = mp.parent_process()

    def recv(self, block: bool) -> list[Any]:
        if block and not self.recv_from_tokenizer.poll(IDLE_POLL_MS):
            if self.parent is not None and not self.parent.is_alive():
                raise SystemExit(0)  # the server was killed without a chance to stop us
        messages = []
        while True:
            try:
                messages.append(recv_pyobj(self.recv_from_tokenizer, zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def send(self, message: Any) -> None:
        send_pyobj(self.send_to_detokenizer, message)


def ignore_interrupts() -> None:
    """In a child of the server: Ctrl-C reaches the whole process group, but the server decides how
    its children stop; SIGTERM (the server's request) exits through `finally` blocks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, dist_port: int, ready: Connection
) -> None:
    """Entry point of a scheduler process: builds the model and its scheduler, reports ("ready",
    SchedulerLimits) or ("error", traceback) on `ready`, then loops until stopped."""
    ignore_interrupts()
    logging.basicConfig(
        level=server_args.log_level.upper(), format=f"%(asctime)s scheduler TP{tp_rank} %(levelname)s %(message)s"
    )
    scheduler = None
    try:
        if server_args.tp_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
            backend = "nccl" if server_args.resolved_device().type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=tp_rank, world_size=server_args.tp_size)
        model_config = ModelConfig.from_pretrained(server_args.model)
        runner = ModelRunner(server_args, model_config)
        encoder = create_encoder(server_args, model_config, runner.device)
        io = ZmqSchedulerIO(port_args) if tp_rank == 0 else None
        scheduler = Scheduler(server_args, runner, Tokenizer.from_pretrained(server_args.model), encoder, io)
    except Exception:  # noqa: BLE001 - reported to the server, which stops
        ready.send(("error", traceback.format_exc()))
        if scheduler is not None:
            scheduler.shutdown()
        return
    ready.send(("ready", scheduler.limits))
    try:
        scheduler.event_loop()
    finally:
        scheduler.shutdown()
