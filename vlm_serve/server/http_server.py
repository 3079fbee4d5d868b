"""The HTTP side of `vlm-serve serve`: the FastAPI app, and uvicorn running it in the launcher's process.

It prints where it listens once a warm-up request (text and an image) has passed through every
process. A child that dies turns /health to 503 and stops the server (an encoder rank is restarted
instead). A completion whose client disconnects is aborted, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from PIL import Image

from vlm_serve.config import ServerArgs
from vlm_serve.server.io_struct import GenerateReqInput, PortArgs, SchedulerLimits
from vlm_serve.server.metrics import render_metrics
from vlm_serve.server.openai_api import OpenAIServing
from vlm_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelNotFoundError,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
    now,
)
from vlm_serve.server.tokenizer_manager import ServerMetrics, TokenizerManager

if TYPE_CHECKING:
    from vlm_serve.server.launcher import ServerProcesses

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT = 900.0  # seconds for the warm-up request (first calls can compile or allocate a lot)
WATCHDOG_SECONDS = 0.5  # how often the children's health is checked
UNHEALTHY_GRACE_SECONDS = 2.0  # /health answers 503 this long before a server with a dead child stops


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

    @app.exception_handler(ModelNotFoundError)
    async def unknown_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=404)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.failure:
            return JSONResponse({"status": "unhealthy", "reason": state.failure}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": importlib.metadata.version("vlm_serve")})

    def model_card() -> ModelCard:
        return ModelCard(
            id=serving.model_name, created=now(), root=tm.server_args.model, max_model_len=tm.limits.context_length
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")  # served names may hold a '/' (org/name)
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _respond(request, serving.chat_completion(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _respond(request, serving.completion(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            x = await serving.chat_prompt(body)
        else:
            x = tm.tokenize(body.prompt)
        return TokenizeResponse(count=len(x.input_ids), max_model_len=tm.limits.context_length, tokens=x.input_ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        return DetokenizeResponse(prompt=tm.detokenize(body.tokens))

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


async def _respond(request: Request, work: Awaitable[Any]) -> Any:
    """Runs a /v1 handler until it answers, or cancels it when its client disconnects first (leaving
    `TokenizerManager.generate` aborts the request's choices). The handler runs in a task raced against
    one that waits for uvicorn's `http.disconnect`, which `receive()` reports once the body is read."""
    answer = asyncio.ensure_future(_answer(work))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
            await asyncio.wait((answer,))  # its abort is sent before this returns
    if answer.cancelled():
        return Response(status_code=499)  # nobody is left to read it
    return answer.result()


async def _answer(work: Awaitable[Any]) -> Any:
    """A handler's answer; a streaming one becomes SSE once its first event exists, so a refusal is
    still a 400 (from then on the StreamingResponse watches for the disconnect itself)."""
    result = await work
    if not isinstance(result, AsyncIterator):
        return result
    first = await anext(result)  # raises (-> 400) if the request is refused
    return StreamingResponse(_prepend(first, result), media_type="text/event-stream")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    async with contextlib.aclosing(rest):
        yield first
        async for event in rest:
            yield event


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


def serve_http(server_args: ServerArgs, port_args: PortArgs, limits: SchedulerLimits, children: ServerProcesses) -> str:
    """Serves HTTP in this process until SIGTERM / Ctrl-C or a child's death; returns why it stopped
    unhealthily ('' after a clean stop)."""
    tm = TokenizerManager(server_args, port_args, limits)
    serving = OpenAIServing(tm, server_args, served_model_name(server_args))
    state = ServerState()
    app = create_app(tm, serving, state, server_args.api_key)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, log_level="warning", timeout_graceful_shutdown=5,
        lifespan="on",
    )  # fmt: skip
    server = _Server(config, tm, state, children)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the
    # handlers found here restored: make that a no-op so the caller stops the children
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    server.run()
    return state.failure


def _ignore(signum: int, frame: Any) -> None:
    pass


class _Server(uvicorn.Server):
    """Uvicorn with the warm-up before the socket opens, the 'listening' line after, and a watchdog
    (which also restarts encoder ranks that died)."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, state: ServerState, children: ServerProcesses) -> None:
        super().__init__(config)
        self.tm, self.state, self.children = tm, state, children

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.tm.start()
        self._watchdog = asyncio.get_running_loop().create_task(self.watch_children())
        try:
            await asyncio.wait_for(warmup(self.tm), timeout=WARMUP_TIMEOUT)
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
            self.children.restart_encoders()
            failure = self.children.dead()
            if failure:
                self.state.failure = failure
                logger.error("%s; stopping the server", failure)
                print(f"vlm-serve: {failure}; stopping", file=sys.stderr, flush=True)
                await asyncio.sleep(UNHEALTHY_GRACE_SECONDS)
                self.should_exit = True
                return
