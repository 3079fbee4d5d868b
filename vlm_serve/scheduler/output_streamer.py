"""What the scheduler sends back after each iteration (`stream_output`, rank 0): every request's tokens
since its last report in one `BatchTokenIdOut`, requests refused at admission, and the answers to control
requests. A request whose output fails to be made ends alone; one still running is stopped on every rank
at the next step (`FailReq`), as rank 0 alone saw the failure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from vlm_serve.detokenizer import stop_holdback
from vlm_serve.messages.backend import BatchTokenIdOut, TokenIdOut
from vlm_serve.scheduler.schedule_batch import FinishReason, Req, request_failure


class SchedulerIO(Protocol):
    """Where TP rank 0's scheduler reads requests and sends its outputs."""

    def recv(self, block: bool) -> list[Any]:
        """Every message waiting now; with `block`, waits a while (not forever) for the first one."""

    def send(self, message: Any) -> None: ...


@dataclass
class FailReq:
    """A request failed where rank 0 alone could see it (its output): every rank stops it at the same step."""

    rid: str
    reason: FinishReason


class OutputStreamer:
    """Collects an iteration's outputs and sends them at its end."""

    def __init__(self, io: SchedulerIO | None, tp_rank: int, speculating: bool) -> None:
        self.io, self.tp_rank, self.speculating = io, tp_rank, speculating
        self.finished: list[Req] = []  # finished this iteration
        self.refused: list[TokenIdOut] = []  # requests refused at admission
        self.failed_here: list[FailReq] = []  # failures found by rank 0 alone, handed to every rank next step
        self.replies: list[Any] = []  # answers to control requests

    def take_failures(self) -> list[FailReq]:
        failures, self.failed_here = self.failed_here, []
        return failures

    def refuse(self, rid: str, reason: FinishReason) -> None:
        self.refused.append(error_out(rid, reason))

    def stream_output(self, unfinished: Iterable[Req]) -> None:
        """Reports what each request (`unfinished`, and those finished this iteration) produced since its
        last report, in one message, and the answers to control requests."""
        finished, self.finished = self.finished, []
        if self.tp_rank != 0:
            self.refused, self.replies = [], []
            return
        outs, self.refused = self.refused, []
        for req in [*unfinished, *finished]:
            if req.to_finish is not None and not req.finished:
                continue  # (reported once released)
            if req.send_token_offset < len(req.output_ids) or req.finished:
                try:
                    outs.append(self.token_out(req))
                except Exception as exc:  # noqa: BLE001 - its own failure, which every rank learns next step
                    reason = request_failure(req, "while its output was sent", exc)
                    if req.finished:
                        outs.append(error_out(req.rid, reason))
                    else:
                        self.failed_here.append(FailReq(req.rid, reason))
        if outs:
            self.io.send(BatchTokenIdOut(outs))
        for reply in self.replies:
            self.io.send(reply)
        self.replies = []

    def token_out(self, req: Req) -> TokenIdOut:
        if req.finished and req.finished_reason.kind == "error":  # what the client gets is the error alone
            return error_out(req.rid, req.finished_reason)
        start, req.send_token_offset = req.send_token_offset, len(req.output_ids)
        params = req.sampling_params
        out = TokenIdOut(
            req.rid,
            req.output_ids[start:],
            stop_holdback=stop_holdback(params.stop),
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens,
        )
        if params.logprobs:
            out.logprobs = req.output_logprobs[start:]
            out.top_logprobs = req.output_top_logprobs[start:]
        if start == 0 and params.prompt_logprobs is not None:  # its first report
            out.prompt_logprobs = req.prompt_logprobs
        if req.finished:
            reason = req.finished_reason
            out.finish_reason, out.matched_stop, out.message = reason.kind, reason.matched, reason.message
            out.status, out.code = reason.status, reason.code
            out.output_text = req.output_text
            out.media_timings = [item.timings for item in req.mm_items]
            if self.speculating:
                out.spec = req.spec
        return out


def error_out(rid: str, reason: FinishReason) -> TokenIdOut:
    return TokenIdOut(rid, finish_reason="error", message=reason.message, status=reason.status, code=reason.code)
