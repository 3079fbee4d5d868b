"""The detokenizer: token ids from the scheduler in, text pieces out to the front end.

Each request's text grows through a `TextStream` (incremental decoding, stop strings held back), so
the scheduler never spends its loop on decoding. The server runs `DetokenizerManager` in a process of
its own, between the scheduler and the HTTP process; `Engine` runs it in-process.
"""

from __future__ import annotations

import logging

import torch.multiprocessing as mp
import zmq

from vlm_serve.config import ServerArgs
from vlm_serve.detokenizer import TextStream
from vlm_serve.ipc import recv_pyobj, send_pyobj
from vlm_serve.server.io_struct import BatchStrOut, BatchTokenIdOut, PortArgs, StrOut, TokenIdOut
from vlm_serve.process import init_child_process
from vlm_serve.server.scheduler_process import IDLE_POLL_MS
from vlm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Keeps one `TextStream` and the ids so far per unfinished request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, tuple[TextStream, list[int]]] = {}

    def detokenize(self, batch: BatchTokenIdOut) -> BatchStrOut:
        return BatchStrOut([self._one(out) for out in batch.outs])

    def _one(self, out: TokenIdOut) -> StrOut:
        if out.error is not None:
            text = ""
        else:
            stream, ids = self.streams.setdefault(out.rid, (TextStream(self.tokenizer, out.stop_holdback), []))
            ids.extend(out.new_ids)
            if out.finish_reason is None:
                text = stream.update(ids)
            else:
                text = stream.finish(ids, out.matched_stop, out.output_text)
                del self.streams[out.rid]
        return StrOut(
            out.rid, text, out.new_ids, out.logprobs, out.top_logprobs, out.finish_reason, out.matched_stop,
            out.message, out.prompt_tokens, out.cached_tokens, out.media_timings, out.error,
        )  # fmt: skip


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    init_child_process("vlm-detokenizer")
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s detokenizer %(levelname)s %(message)s")
    manager = DetokenizerManager(Tokenizer.from_pretrained(server_args.model))
    context = zmq.Context()
    recv_from_scheduler = context.socket(zmq.PULL)
    recv_from_scheduler.bind(port_args.detokenizer_input)
    send_to_tokenizer = context.socket(zmq.PUSH)
    send_to_tokenizer.connect(port_args.tokenizer_input)
    parent = mp.parent_process()
    while True:
        if not recv_from_scheduler.poll(IDLE_POLL_MS):
            if parent is not None and not parent.is_alive():
                return
            continue
        message = recv_pyobj(recv_from_scheduler)
        if isinstance(message, BatchTokenIdOut):
            message = manager.detokenize(message)
        send_pyobj(send_to_tokenizer, message)  # replies to control requests pass through as they are
