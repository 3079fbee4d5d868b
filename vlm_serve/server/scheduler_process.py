"""The scheduler process, one per TP rank: builds the model runner, the encoder (rank 0) and the
`Scheduler`, reports that it is ready, then runs the scheduler's event loop. Rank 0 alone talks to the
other processes, over ZMQ (`ZmqSchedulerIO`); the scheduler broadcasts what it receives to the others.
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.ipc import recv_pyobj, send_pyobj, zmq_context
from vlm_serve.llm.model_runner import ModelRunner, RunnerConcerns
from vlm_serve.process import IDLE_POLL_MS, exits_at_once, init_child_process
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.scheduler import Scheduler
from vlm_serve.server.ports import PortArgs
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.pool import EncoderConcerns, create_encoder

logger = logging.getLogger(__name__)


class ZmqSchedulerIO:
    """Rank 0's I/O: requests from the HTTP process, outputs to the detokenizer."""

    def __init__(self, port_args: PortArgs) -> None:
        context = zmq_context()
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


@exits_at_once
def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs | None, tp_rank: int, dist_init_addr: str, ready: Connection
) -> None:
    """Entry point of a scheduler process: joins the TP group (at `dist_init_addr`, HOST:PORT), builds
    the model and its scheduler, reports ("ready", SchedulerLimits) or ("error", traceback) on `ready`,
    then loops until stopped. `port_args` is given on node 0 only; rank 0 uses it."""
    init_child_process(f"vlm-scheduler-{tp_rank}")
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format=f"%(asctime)s scheduler TP{tp_rank} %(levelname)s %(message)s",
        force=True,  # (a forked child has its launcher's handlers)
    )
    scheduler = None
    try:
        device = server_args.resolved_device()
        if device.type == "cuda":  # one GPU per local rank
            torch.cuda.set_device(tp_rank % len(server_args.node_tp_ranks))
        if server_args.tp_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{dist_init_addr}", rank=tp_rank, world_size=server_args.tp_size
            )
        model_config = ModelConfig.from_pretrained(server_args.model, server_args.quantization)
        runner = ModelRunner(RunnerConcerns.of(server_args), model_config)
        encoder, io = None, None  # rank 0 alone encodes and talks to the other processes
        if tp_rank == 0:
            if server_args.disaggregation_mode != "decode":  # (a decode server never encodes: PD)
                encoder = create_encoder(
                    EncoderConcerns.of(server_args), model_config, runner.device, port_args.encoder
                )
            io = ZmqSchedulerIO(port_args)
        scheduler = Scheduler(
            SchedulerConcerns.of(server_args), runner, Tokenizer.from_pretrained(server_args.model), encoder, io
        )
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
