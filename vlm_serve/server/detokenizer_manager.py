"""The detokenizer: token ids from the scheduler in, text pieces out to the front end.

Each request's text grows through a `TextStream` (incremental decoding, stop strings held back), so
the scheduler never spends its loop on decoding. A token's id and logprobs are handed on with the text
that completes it, so a message never carries a token whose text is still held back (its text and
its logprobs stream together). The server runs `DetokenizerManager` in a process of its own, between
the scheduler and the HTTP process; `Engine` runs it in-process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from dataclasses import dataclass, field

import zmq

from vlm_serve.config import ServerArgs
from vlm_serve.detokenizer import TextStream
from vlm_serve.ipc import recv_pyobj, send_pyobj, zmq_context
from vlm_serve.messages.backend import BatchTokenIdOut, TokenIdOut
from vlm_serve.messages.frontend import BatchStrOut, StrOut
from vlm_serve.process import IDLE_POLL_MS, exits_at_once, init_child_process
from vlm_serve.server.ports import PortArgs
from vlm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One unfinished request: its text, every id so far, and the logprobs of the ids not yet handed on."""

    text: TextStream
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class DetokenizerManager:
    """Keeps one `_Stream` per unfinished request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self.failed: set[str] = set()  # requests whose text failed here, until the scheduler ends them

    def detokenize(self, batch: BatchTokenIdOut) -> BatchStrOut:
        """The text of each output; a request whose text cannot be made fails alone (a 500 naming why: its
        front end then aborts it), and its later outputs are dropped."""
        outs = []
        for out in batch.outs:
            if out.rid in self.failed:
                if out.finish_reason is not None:
                    self.failed.discard(out.rid)
                continue
            try:
                outs.append(self._one(out))
            except Exception as exc:  # noqa: BLE001 - its own failure: it ends, the others go on
                logger.exception("request %s failed while its text was decoded", out.rid)
                self.streams.pop(out.rid, None)
                if out.finish_reason is None:
                    self.failed.add(out.rid)
                why = f"request {out.rid} failed while its text was decoded: {type(exc).__name__}: {exc}"
                outs.append(StrOut.failed(out.rid, 500, "internal_error", why))
        return BatchStrOut(outs)

    def _one(self, out: TokenIdOut) -> StrOut:
        stream = self.streams.setdefault(out.rid, _Stream(TextStream(self.tokenizer, out.stop_holdback)))
        stream.ids.extend(out.new_ids)
        stream.logprobs.extend(out.logprobs)
        stream.top_logprobs.extend(out.top_logprobs)
        sent = stream.text.released
        if out.finish_reason is None:
            text, count = stream.text.update(stream.ids)
        else:  # (a failed request ends here too, so its stream is dropped)
            text, count = stream.text.finish(stream.ids, out.matched_stop, out.output_text)
            del self.streams[out.rid]
        new_ids = stream.ids[sent : sent + count]
        logprobs, top_logprobs = stream.logprobs[:count], stream.top_logprobs[:count]
        del stream.logprobs[:count], stream.top_logprobs[:count]
        return StrOut(
            out.rid,
            text,
            new_ids,
            logprobs,
            top_logprobs,
            out.finish_reason,
            out.matched_stop,
            out.message,
            out.prompt_tokens,
            out.cached_tokens,
            out.media_timings,
            out.status,
            out.code,
            out.prompt_logprobs,
            out.spec,
        )


@exits_at_once
def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    init_child_process("vlm-detokenizer")
    logging.basicConfig(
        level=server_args.log_level.upper(), format="%(asctime)s detokenizer %(levelname)s %(message)s", force=True
    )
    manager = DetokenizerManager(Tokenizer.from_pretrained(server_args.model))
    context = zmq_context()
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
