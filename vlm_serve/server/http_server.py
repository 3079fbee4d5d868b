"""`vlm-serve serve`: the FastAPI app and the processes behind it.

`launch_server` spawns the scheduler (one process per TP rank; rank 0 starts the encoder pool) and
the detokenizer, waits until the model is loaded, serves HTTP in this process, and prints where it
listens once a warm-up request (text and an image) has passed. SIGTERM or Ctrl-C stops every child;
a child that dies turns /health to 503 and stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from PIL import Image

from vlm_serve.config import ServerArgs
from vlm_serve.server.detokenizer_manager import run_detokenizer_process
from vlm_serve.server.io_struct import GenerateReqInput, PortArgs, SchedulerLimits
from vlm_serve.server.metrics import render_metrics
from vlm_serve.server.openai_api import OpenAIServing
from vlm_serve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body, now
from vlm_serve.server.scheduler_process import run_scheduler_process
from vlm_serve.server.tokenizer_manager import ServerMetrics, TokenizerManager
from vlm_serve.testing.tiny_model import default_model_path

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 900.0  # seconds for the model to load (a 235B checkpoint takes minutes)
WATCHDOG_SECONDS = 0.5  # how often the children's health is checked
UNHEALTHY_GRACE_SECONDS = 2.0  # /health answers 503 this long before a server with a dead child stops
CHILD_STOP_TIMEOUT = 10.0


@dataclass
class ServerState:
    ready: bool = False  # the warm-up passed
    failure: str = ""  # why the server is unhealthy


class ApiKeyCheck:
    """Requires `Authorization: Bearer <key>` on every path but /health. A plain ASGI middleware:
    Starlette's `BaseHTTPMiddleware` would hide client disconnects from the handlers."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                message = "missing or invalid API key (send 'Authorization: Bearer <key>')"
                response = JSONResponse(error_body(message, 401, "AuthenticationError"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(tm: TokenizerManager, serving: OpenAIServing, state: ServerState, api_key: str | None) -> FastAPI:
    app = FastAPI(title="vlm_serve", docs_url=None, redoc_url=None)

    def error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
        return JSONResponse(error_body(message, status, kind), status_code=status)

    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(part) for part in e.get("loc", ()) if part != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return error(400, "invalid request: " + "; ".join(problems))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(LookupError)
    async def unknown_model(request: Request, exc: LookupError) -> JSONResponse:
        return error(400, str(exc.args[0]), "NotFoundError")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.failure:
            return JSONResponse({"status": "unhealthy", "reason": state.failure}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=serving.model_name, created=now(), root=tm.server_args.model, max_model_len=tm.limits.context_length
        )
        return ModelList(data=[card])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        return await _respond(serving.chat_completion(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await _respond(serving.completion(body))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await tm.get_stats()
        return PlainTextResponse(render_metrics(tm.metrics, stats, tm.processor.cache), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        out = await tm.flush_cache()
        if not out.success:
            return error(409, f"cannot flush the caches: {out.message}", "ConflictError")
        return JSONResponse({"flushed": True})

    return app


async def _respond(work: Awaitable[Any]) -> Any:
    """Runs a handler; a streaming answer becomes SSE once its first event exists, so a refusal is
    still a 400."""
    result = await work
    if not isinstance(result, AsyncIterator):
        return result
    first = await anext(result)  # raises (-> 400) if the request is refused
    return StreamingResponse(_prepend(first, result), media_type="text/event-stream")


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    async with contextlib.aclosing(rest):
        yield first
        async for event in rest:
            yield event


# ---- processes ---------------------------------------------------------------------------------------


@dataclass
class _Children:
    schedulers: list[mp.Process]
    detokenizer: mp.Process

    @property
    def all(self) -> list[mp.Process]:
        return [*self.schedulers, self.detokenizer]

    def dead(self) -> str:
        """Why a child is not running ('' when all are)."""
        for p in self.all:
            if not p.is_alive():
                return f"the {p.name} process exited (code {p.exitcode})"
        return ""

    def stop(self) -> None:
        for p in self.all:
            if p.is_alive():
                p.terminate()  # SIGTERM: the scheduler stops its encoder pool on the way out
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT
        for p in self.all:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_children(server_args: ServerArgs, port_args: PortArgs) -> tuple[_Children, list[Connection]]:
    ctx = mp.get_context("spawn")
    dist_port = _free_port() if server_args.tp_size > 1 else 0
    schedulers, readies = [], []
    for rank in range(server_args.tp_size):
        reader, writer = ctx.Pipe(duplex=False)
        # not a daemon: it starts the encoder pool's processes (it exits when this process dies)
        process = ctx.Process(
            target=run_scheduler_process, args=(server_args, port_args, rank, dist_port, writer),
            name=f"scheduler TP{rank}",
        )  # fmt: skip
        process.start()
        writer.close()
        schedulers.append(process)
        readies.append(reader)
    detokenizer = ctx.Process(
        target=run_detokenizer_process, args=(server_args, port_args), name="detokenizer", daemon=True
    )
    detokenizer.start()
    return _Children(schedulers, detokenizer), readies


def _await_ready(children: _Children, readies: list[Connection]) -> SchedulerLimits:
    """Rank 0's limits once every rank has loaded the model; RuntimeError if one fails."""
    limits: list[SchedulerLimits] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for rank, conn in enumerate(readies):
        while not conn.poll(0.2):
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


async def warmup(tm: TokenizerManager) -> None:
    """One short request with an image through every process (raises if it does not finish)."""
    image = Image.new("RGB", (64, 64), (120, 30, 200))
    content = [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]
    x = await tm.process_messages([{"role": "user", "content": content}])
    choices = tm.normalize(GenerateReqInput(x, {"max_tokens": 2, "temperature": 0}))
    async with contextlib.aclosing(tm.generate(choices)) as outputs:
        async for _, out in outputs:
            if out.finish_reason == "abort":
                raise RuntimeError(f"the warm-up request failed: {out.message}")
    tm.metrics = ServerMetrics()


def served_model_name(server_args: ServerArgs) -> str:
    return server_args.served_model_name or Path(server_args.model).name


def launch_server(server_args: ServerArgs) -> int:
    """Runs the server until SIGTERM / Ctrl-C (exit code 0) or a child's death (1)."""
    if server_args.model is None:
        server_args = dataclasses.replace(server_args, model=str(default_model_path()))
    signal.signal(signal.SIGTERM, _raise_exit)  # while starting: unwind through `finally`, stopping children
    ipc_dir = tempfile.mkdtemp(prefix="vlm-serve-")
    port_args = PortArgs(*(f"ipc://{ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer")))
    children, readies = _start_children(server_args, port_args)
    state = ServerState()
    try:
        limits = _await_ready(children, readies)
        tm = TokenizerManager(server_args, port_args, limits)
        serving = OpenAIServing(tm, server_args, served_model_name(server_args))
        app = create_app(tm, serving, state, server_args.api_key)
        config = uvicorn.Config(
            app, host=server_args.host, port=server_args.port, log_level="warning", timeout_graceful_shutdown=5,
            lifespan="on",
        )  # fmt: skip
        server = _Server(config, tm, state, children)
        # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the
        # handlers found here restored: make that a no-op so the children are stopped below
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        server.run()
    except RuntimeError as exc:
        print(f"vlm-serve: {exc}", file=sys.stderr)
        return 1
    finally:
        children.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    if state.failure:
        print(f"vlm-serve: stopped because {state.failure}", file=sys.stderr)
        return 1
    return 0


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(1)


def _ignore(signum: int, frame: Any) -> None:
    pass


class _Server(uvicorn.Server):
    """Uvicorn with the warm-up before the socket opens, the 'listening' line after, and a watchdog."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, state: ServerState, children: _Children) -> None:
        super().__init__(config)
        self.tm, self.state, self.children = tm, state, children

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.tm.start()
        self._watchdog = asyncio.get_running_loop().create_task(self.watch_children())
        try:
            await asyncio.wait_for(warmup(self.tm), timeout=STARTUP_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - reported, then the server stops
            self.state.failure = f"the warm-up request failed: {exc}"
            self.should_exit = True
            return
        await super().startup(sockets)
        if self.started:
            host, port = self.config.host, self.servers[0].sockets[0].getsockname()[1]
            print(f"vlm-serve: serving {served_model_name(self.tm.server_args)} on http://{host}:{port}", flush=True)
            self.state.ready = True

    async def watch_children(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_SECONDS)
            failure = self.children.dead()
            if failure:
                self.state.failure = failure
                logger.error("%s; stopping the server", failure)
                print(f"vlm-serve: {failure}; stopping", file=sys.stderr, flush=True)
                await asyncio.sleep(UNHEALTHY_GRACE_SECONDS)
                self.should_exit = True
                return
