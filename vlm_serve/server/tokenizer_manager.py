"""The HTTP process's side of a request: messages -> model inputs -> scheduler, and text back.

Rendering the chat template, loading media and preprocessing run on a thread pool, off the event
loop. Each request's choices go to the scheduler as `TokenizedGenerateReq`s; their text arrives from
the detokenizer and is handed to the waiting handler through a per-request queue. A handler that goes
away (client disconnect) aborts its unfinished choices, so their KV cache is freed: that alone ends a
request as a quiet "abort". A request that could not be served raises its error instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import pickle
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from vlm_serve.config import ServerArgs
from vlm_serve.errors import ApiError
from vlm_serve.ipc import send_pyobj
from vlm_serve.messages.backend import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    LoadLoRAReq,
    LoRAOut,
    SchedulerLimits,
    StatsOut,
    TokenizedGenerateReq,
    UnloadLoRAReq,
)
from vlm_serve.messages.frontend import BatchStrOut, GenerateReqInput, StrOut
from vlm_serve.multimodal.items import ProcessedInput
from vlm_serve.multimodal.media import MediaAccess
from vlm_serve.multimodal.processor import MediaInput, MultimodalProcessor
from vlm_serve.sampling_params import SamplingParams, SamplingRequest, generation_defaults
from vlm_serve.scheduler.metrics import Histogram
from vlm_serve.server.ports import PortArgs
from vlm_serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# inter-token latencies are short; requests' end-to-end times are long
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


@dataclass
class ServerMetrics:
    """What the HTTP process measures: request counts and latencies as clients see them."""

    num_requests: int = 0
    num_finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    num_rejected: int = 0  # requests that failed by their own fault (400)
    num_failed: dict[str, int] = field(default_factory=dict)  # requests the server could not serve, by cause
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass
class _Pending:
    """The choices of one request in flight, sharing one queue of outputs."""

    rids: list[str]
    queue: asyncio.Queue[StrOut] = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)


class TokenizerManager:
    """Turns API requests into scheduler requests and streams their outputs back."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs, limits: SchedulerLimits) -> None:
        self.server_args = server_args
        self.limits = limits
        path = Path(server_args.model)
        self.tokenizer = Tokenizer.from_pretrained(path)
        access = MediaAccess(
            local_dirs=(server_args.allowed_local_media_path,) if server_args.allowed_local_media_path else (),
            domains=tuple(server_args.allowed_media_domains),
            max_bytes=server_args.max_media_mb << 20,
            fetch_timeout=server_args.media_fetch_timeout,
        )
        self.processor = MultimodalProcessor.from_pretrained(
            path,
            self.tokenizer,
            max_image_pixels=server_args.max_image_pixels,
            access=access,
            cache_mb=server_args.mm_cache_mb,
            pixels=server_args.disaggregation_mode != "decode",  # a PD decode server never runs the vision tower
        )
        self.default_sampling = generation_defaults(path)
        self.executor = ThreadPoolExecutor(server_args.tokenizer_workers, thread_name_prefix="preprocess")
        self.send_to_scheduler = zmq.Context.instance().socket(zmq.PUSH)  # sends never wait: no high-water mark
        self.send_to_scheduler.setsockopt(zmq.SNDHWM, 0)
        self.send_to_scheduler.connect(port_args.scheduler_input)
        self.recv_from_detokenizer = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self.recv_from_detokenizer.bind(port_args.tokenizer_input)
        self.pending: dict[str, _Pending] = {}  # by choice rid
        self.metrics = ServerMetrics()
        self._ids = itertools.count()
        self._control_lock = asyncio.Lock()  # one control request (stats, flush) at a time
        self._reply: asyncio.Future | None = None
        self._loop_task: asyncio.Task | None = None
        self.failure = ""  # why no request can be served any more (a server process died)

    def start(self) -> None:
        """Starts receiving outputs; call from the server's event loop."""
        self._loop_task = asyncio.get_running_loop().create_task(self.handle_loop())

    async def handle_loop(self) -> None:
        while True:
            message = pickle.loads(await self.recv_from_detokenizer.recv())
            if isinstance(message, BatchStrOut):
                for out in message.outs:
                    pending = self.pending.get(out.rid)
                    if pending is not None:
                        pending.queue.put_nowait(out)
            elif self._reply is not None and not self._reply.done():
                self._reply.set_result(message)

    # ---- inputs ------------------------------------------------------------------------------------

    async def process_messages(self, messages: list[dict[str, Any]], **options: Any) -> ProcessedInput:
        """Chat template, media and preprocessing, on the thread pool; `options` are those of
        `MultimodalProcessor.process_messages` (`add_generation_prompt`, `chat_template_kwargs`, ...).
        A conversation the chat template refuses is a ValueError."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(self._process_messages, messages, **options))

    async def process_prompt(self, prompt: str, images: list[MediaInput], videos: list[MediaInput]) -> ProcessedInput:
        """A rendered prompt holding one `<|image_pad|>` / `<|video_pad|>` per image / video (as the chat
        template writes them) with its media, processed on the thread pool; a count that does not match
        is a ValueError."""
        loop = asyncio.get_running_loop()
        work = functools.partial(self.processor.process, prompt, images, videos)
        return await loop.run_in_executor(self.executor, lambda: _in_shared_memory(work()))

    def _process_messages(self, messages: list[dict[str, Any]], **options: Any) -> ProcessedInput:
        return _in_shared_memory(self.processor.process_messages(messages, **options))

    def tokenize(self, prompt: str | list[int]) -> ProcessedInput:
        if isinstance(prompt, str):
            return ProcessedInput(self.tokenizer.encode(prompt))
        return ProcessedInput(list(prompt))

    def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included; an id without a token is a ValueError naming it."""
        for token_id in ids:
            if not 0 <= token_id < self.tokenizer.vocab_size or self.tokenizer.id_to_token(token_id) is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.tokenizer.vocab_size})")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def sampling_params(self, request: SamplingRequest, **given: Any) -> SamplingParams:
        """A request body's sampling settings over the checkpoint's generation defaults (`given`: what the
        endpoint adds, as the body's `to_sampling_params` names it); ValueError names a bad one, and
        counts as a request rejected for its own fault."""
        with self._rejections():
            return request.to_sampling_params(self.default_sampling, **given)

    def normalize(self, request: GenerateReqInput) -> list[TokenizedGenerateReq]:
        """The scheduler messages of a request, one per choice; ValueError names a prompt and answer too
        long for the context, and counts as a request rejected for its own fault."""
        with self._rejections():
            return request.normalize(f"req{next(self._ids)}", self.limits)

    @contextlib.contextmanager
    def _rejections(self) -> Iterator[None]:
        try:
            yield
        except ValueError:
            self.metrics.num_rejected += 1
            raise

    # ---- generation --------------------------------------------------------------------------------

    async def generate(self, choices: list[TokenizedGenerateReq]) -> AsyncIterator[tuple[int, StrOut]]:
        """Sends a request's choices and yields (choice index, output) as they progress. A choice that
        fails raises its error (`StrOut.failure`: `BadRequest` when the request is at fault, e.g.
        refused by the scheduler; `ServiceUnavailable` or `InternalError` when the server is) and aborts
        the others. Leaving early (a disconnect) aborts the unfinished choices."""
        self.metrics.num_requests += 1
        if self.failure:
            raise self._failed(StrOut.failed("", 503, "server_unavailable", self.failure))
        rids = [c.rid for c in choices]
        pending = _Pending(rids, unfinished=set(rids))
        index = {rid: i for i, rid in enumerate(rids)}
        logger.debug("scheduling choices %s", ", ".join(rids))  # (the log line names the HTTP request's id)
        for choice in choices:
            self.pending[choice.rid] = pending
            send_pyobj(self.send_to_scheduler, choice)
        start = last = time.perf_counter()
        first = True
        failed = False
        try:
            while pending.unfinished:
                out = await pending.queue.get()
                if out.finish_reason == "error":  # (still aborted below: the detokenizer may have failed it alone)
                    failed = True
                    raise self._failed(out)
                now = time.perf_counter()
                if out.new_ids:
                    (self.metrics.ttft if first else self.metrics.itl).observe(now - (start if first else last))
                    first, last = False, now
                    self.metrics.generation_tokens += len(out.new_ids)
                if out.finish_reason is not None:
                    pending.unfinished.discard(out.rid)
                    self.pending.pop(out.rid, None)
                    self.metrics.num_finished[out.finish_reason] += 1
                    self.metrics.prompt_tokens += out.prompt_tokens
                yield index[out.rid], out
            self.metrics.e2e.observe(time.perf_counter() - start)
        finally:
            why = "another choice of the request failed" if failed else "the client went away"
            for rid in rids:
                if self.pending.pop(rid, None) is not None and rid in pending.unfinished:
                    send_pyobj(self.send_to_scheduler, AbortReq(rid, why))
                    if not failed:
                        self.metrics.num_finished["abort"] += 1

    def _failed(self, out: StrOut) -> ApiError:
        """Counts a request that ended with `out`'s failure, and returns its error."""
        if out.status == 400:
            self.metrics.num_rejected += 1
        else:
            self.metrics.num_failed[out.code] = self.metrics.num_failed.get(out.code, 0) + 1
        return out.failure()

    def fail_all(self, reason: str) -> None:
        """A server process died: every request in flight (a control request too), and every later one,
        fails with a 503 naming `reason`."""
        self.failure = reason
        for rid, pending in self.pending.items():
            pending.queue.put_nowait(StrOut.failed(rid, 503, "server_unavailable", reason))
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(self._unavailable())

    def _unavailable(self) -> ApiError:
        """What anything asked of a server with a dead process fails with."""
        return StrOut.failed("", 503, "server_unavailable", self.failure).failure()

    # ---- control -----------------------------------------------------------------------------------

    async def _control(self, request: Any) -> Any:
        async with self._control_lock:
            if self.failure:  # (its answer would never come)
                raise self._unavailable()
            self._reply = asyncio.get_running_loop().create_future()
            send_pyobj(self.send_to_scheduler, request)
            return await asyncio.wait_for(self._reply, timeout=30)

    async def get_stats(self) -> StatsOut:
        return await self._control(GetStatsReq())

    async def change_lora(self, request: LoadLoRAReq | UnloadLoRAReq) -> LoRAOut:
        return await self._control(request)

    async def flush_cache(self) -> FlushCacheOut:
        out: FlushCacheOut = await self._control(FlushCacheReq())
        if out.success:
            self.processor.cache.clear()
        return out


def _in_shared_memory(processed: ProcessedInput) -> ProcessedInput:
    """`processed` with its pixels in shared memory: the scheduler maps these pages instead of copying them
    (a pixel-free item's are `meta`: no memory to share)."""
    for item in processed.mm_items:
        item.pixels.share_memory_()
    return processed
