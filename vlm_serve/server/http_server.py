"""The HTTP side of `vlm-serve serve`: the FastAPI app, and uvicorn running it in the launcher's process.

It prints where it listens once a warm-up request (text and an image) has passed through every
process. A child that dies turns /health to 503 and stops the server (an encoder rank is restarted
instead). A completion whose client disconnects is aborted, streamed or not. Every failure is answered
in OpenAI's error shape by one handler, `error_response`, whatever raised it: a handler, FastAPI's body
parsing and validation, or Starlette's routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import importlib.metadata
import json
import logging
import re
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlm_serve.checkpoint import single_turn_only
from vlm_serve.config import ServerArgs
from vlm_serve.errors import (
    ApiError,
    BadRequest,
    Conflict,
    InternalError,
    MethodNotAllowed,
    ModelNotFoundError,
    NotFound,
    Unauthorized,
)
from vlm_serve.messages.backend import LoadLoRAReq, SchedulerLimits, UnloadLoRAReq
from vlm_serve.messages.frontend import GenerateReqInput
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.server.metrics import render_metrics
from vlm_serve.server.openai_api import OpenAIServing
from vlm_serve.server.output_protocol import ModelCard, ModelList, error_body, now
from vlm_serve.server.ports import PortArgs
from vlm_serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from vlm_serve.server.responses_api import ResponsesServing
from vlm_serve.server.responses_protocol import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from vlm_serve.server.sglang_api import GenerateRequest, GenerateServing
from vlm_serve.server.tokenizer_manager import ServerMetrics, TokenizerManager

if TYPE_CHECKING:
    from vlm_serve.server.processes import ServerProcesses

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT = 900.0  # seconds for the warm-up request (first calls can compile or allocate a lot)
WATCHDOG_SECONDS = 0.5  # how often the children's health is checked
UNHEALTHY_GRACE_SECONDS = 1.0  # /health answers 503 this long before a server with a dead child stops (its
# requests in flight have had their errors already: this is for health checkers)


@dataclass
class ServerState:
    ready: bool = False  # the warm-up passed
    failure: str = ""  # why the server is unhealthy
    encoders_down: str = ""  # why no encoder rank can run (/health fails; text requests are still served)


class ApiKeyCheck:
    """Requires `Authorization: Bearer <key>` on every path but /health, compared in constant time. A
    plain ASGI middleware: Starlette's `BaseHTTPMiddleware` would hide client disconnects from the
    handlers."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')")
                await _error_json(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class RequestIds:
    """Gives every request an id: the client's `x-request-id` when it sends one, else a new one. It is
    sent back in the response's `x-request-id` header (the openai client's `request_id`) and prefixes
    what the server logs while handling the request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if given and given.isprintable() and len(given) <= 256 else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class _RequestIdInLogs(logging.Filter):
    """Prefixes a record logged while a request is handled with the request's id."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id and not getattr(record, "request_id", None):
            record.request_id = request_id
            record.msg = f"[request {request_id}] {record.msg}"
        return True


# ---- errors --------------------------------------------------------------------------------------------

_FRAMEWORK_ERRORS = {400: BadRequest, 404: NotFound, 405: MethodNotAllowed}  # what Starlette and FastAPI raise
_SURROGATE = re.compile("[\ud800-\udfff]")


async def error_response(request: Request, exc: Exception) -> JSONResponse:
    """The app's one exception handler: whatever a request raised, as OpenAI's error shape with the status
    `_as_api_error` gives it."""
    headers = exc.headers if isinstance(exc, StarletteHTTPException) else None  # 405's Allow
    return _error_json(_as_api_error(request, exc), headers)


def _as_api_error(request: Request, exc: Exception) -> ApiError:
    """What an exception tells the client: an `ApiError` says it itself; a ValueError or a body pydantic
    refused is a 400; Starlette's and FastAPI's own refusals keep their status (no such route 404, not
    this method 405, an unreadable body 400). Anything else is a bug: a 500 whose message gives only a
    request id, the traceback going to the log under that id."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _invalid_request(exc)
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    if isinstance(exc, StarletteHTTPException) and exc.status_code in _FRAMEWORK_ERRORS:
        return _FRAMEWORK_ERRORS[exc.status_code](_framework_message(request, exc))
    request_id = REQUEST_ID.get()
    logger.error(
        "internal error (request id %s) in %s %s",
        request_id,
        request.method,
        request.url.path,
        exc_info=exc,
        extra={"request_id": request_id},  # (named in the message already)
    )
    return InternalError(f"internal error (request id {request_id})")


def _invalid_request(exc: RequestValidationError) -> BadRequest:
    """A 400 naming where the JSON breaks, or (up to five of) the fields pydantic refused: `param` is
    the first."""
    errors = exc.errors()  # never empty
    if errors[0]["type"] == "json_invalid":
        e = errors[0]
        return BadRequest(f"the request body is not valid JSON: {e['ctx']['error']} (at character {e['loc'][-1]})")
    problems, fields = [], []
    for e in errors[:5]:
        where = ".".join(str(part) for part in e.get("loc", ()) if part != "body")
        problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        cause = e.get("ctx", {}).get("error")  # a validator's own error may name the field itself
        fields.append(where or (cause.param if isinstance(cause, ApiError) else None))
    return BadRequest("invalid request: " + "; ".join(problems), param=fields[0] or None)


def _framework_message(request: Request, exc: StarletteHTTPException) -> str:
    if exc.status_code == 404:
        return f"no such route: {request.method} {request.url.path}"
    if exc.status_code == 405:
        return f"{request.url.path} does not take {request.method} (only {exc.headers['Allow']})"
    cause = exc.__cause__  # FastAPI's "There was an error parsing the body" says nothing of why
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause}"
    return f"{exc.detail}: {cause}" if cause is not None else str(exc.detail)


def _error_json(error: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = error_body(error)
    return JSONResponse(body, status_code=error.status, headers=headers)


async def _refuse_lone_surrogates(request: Request) -> None:
    """A JSON body can spell a lone UTF-16 surrogate ("\\ud800", or its bytes: Python's JSON decoder lets
    them pass), which is no character: nothing downstream can encode it (the tokenizer raises), so it is
    a 400 naming the field. The body is parsed here only once: Starlette keeps it for the handler."""
    if not await request.body():
        return
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        return  # the handler reports what is wrong with it
    found = _find_lone_surrogate(body)
    if found is not None:
        where, char = found
        raise BadRequest(
            f"invalid request: {where or 'body'}: lone UTF-16 surrogate \\u{ord(char):04x} is not valid Unicode text",
            param=where or None,
        )


def _find_lone_surrogate(body: Any) -> tuple[str, str] | None:
    """The first string (or key) of a parsed JSON value holding a surrogate: its place (`messages.0.
    content`, as pydantic names places) and the surrogate. Iterative: a body may nest deeply."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str):
            found = None if value.isascii() else _SURROGATE.search(value)
            if found is not None:
                return where, found.group()
        elif isinstance(value, (dict, list)):
            items = list(value.items() if isinstance(value, dict) else enumerate(value))
            for key, item in reversed(items):  # popped in document order
                # the place is printable even where the key holds the surrogate
                name = str(key).encode("utf-8", "backslashreplace").decode()
                here = f"{where}.{name}" if where else name
                todo += [(here, item), (here, key)]
    return None


class _Route(APIRoute):
    """A route whose every failure is answered by `error_response` (an `Exception` handler would not do:
    Starlette sends its answer, then re-raises to uvicorn, which logs it again and drops the connection),
    and whose JSON body holds no lone surrogate."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                await _refuse_lone_surrogates(request)
                return await handle(request)
            except Exception as exc:  # noqa: BLE001 - every failure is an answer in OpenAI's shape
                return await error_response(request, exc)

        return guarded


def create_app(tm: TokenizerManager, serving: OpenAIServing, state: ServerState, api_key: str | None) -> FastAPI:
    app = FastAPI(title="vlm_serve", docs_url=None, redoc_url=None)
    generation = GenerateServing(serving)
    responses = ResponsesServing(serving, serving.server_args.responses_store_size)
    app.router.route_class = _Route
    app.add_exception_handler(StarletteHTTPException, error_response)  # unknown routes, wrong methods
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.add_middleware(RequestIds)  # (outermost: refusals of the API key check get an id too)

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = state.failure or state.encoders_down
        if reason:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": importlib.metadata.version("vlm_serve")})

    def model_card(lora: str | None = None) -> ModelCard:
        if lora is not None:
            return ModelCard(id=lora, created=now(), root=serving.lora_paths[lora], parent=serving.model_name)
        return ModelCard(
            id=serving.model_name, created=now(), root=tm.server_args.model, max_model_len=tm.limits.context_length
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card(), *(model_card(name) for name in serving.lora_paths)])

    @app.get("/v1/models/{model_id:path}")  # served names may hold a '/' (org/name)
    async def model(model_id: str) -> ModelCard:
        return model_card(serving.check_model(model_id))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_path is None:
            raise BadRequest("lora_path is required: the adapter's folder", param="lora_path")
        out = await tm.change_lora(LoadLoRAReq(body.lora_name, body.lora_path))
        if not out.success:
            raise BadRequest(out.message, param="lora_path")
        serving.lora_paths[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: LoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name not in serving.lora_paths:
            raise ModelNotFoundError(body.lora_name)
        out = await tm.change_lora(UnloadLoRAReq(body.lora_name))
        if not out.success:
            raise BadRequest(out.message, param="lora_name")
        del serving.lora_paths[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _respond(request, serving.chat_completion(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _respond(request, serving.completion(body))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        return await _respond(request, responses.create(body))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False) -> ResponseObject:
        if stream:
            raise BadRequest(
                "streaming a stored response again is not supported: GET it without stream", param="stream"
            )
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        return responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> ResponseObject:
        return await responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str) -> InputItemList:
        return responses.input_items(response_id)

    @app.api_route("/generate", methods=["POST", "PUT"])  # SGLang's native API (both methods, as SGLang)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        return await _respond(request, generation.generate(body))

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, which sglang-router falls back to
    async def model_info() -> JSONResponse:
        return JSONResponse(_model_info(tm, serving))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(_server_info(tm, serving))

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
        return PlainTextResponse(
            render_metrics(tm.metrics, stats, tm.processor.cache), media_type="text/plain; version=0.0.4"
        )

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        out = await tm.flush_cache()
        if not out.success:
            raise Conflict(f"cannot flush the caches: {out.message}")
        return JSONResponse({"flushed": True})

    return app


def _model_info(tm: TokenizerManager, serving: OpenAIServing) -> dict[str, Any]:
    """SGLang's /model_info. sglang-router names the model by `served_model_name` (else `model_path`) and
    loads its tokenizer from `tokenizer_path`, a local folder (an absolute path: it runs elsewhere)."""
    path = str(Path(tm.server_args.model).resolve())
    config = json.loads((Path(path) / "config.json").read_text())
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": serving.model_name,
        "is_generation": True,
        "has_image_understanding": True,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "preferred_sampling_params": None,
        "weight_version": "default",
        "single_turn": single_turn_only(Path(path)),  # (ours: a model trained on single questions only)
        "max_media_mb": tm.server_args.max_media_mb,  # (ours: the largest media file a request may bring)
    }


def _server_info(tm: TokenizerManager, serving: OpenAIServing) -> dict[str, Any]:
    """SGLang's /server_info: the settings (SGLang's names where they differ, no API key) and the
    scheduler's limits as SGLang reports them."""
    settings = {k: v for k, v in asdict(tm.server_args).items() if k not in ("api_key", "model")}
    limits = tm.limits
    return {
        **settings,
        **_model_info(tm, serving),
        "dp_size": 1,
        "context_length": limits.context_length,
        "max_total_num_tokens": limits.max_total_tokens,
        "max_running_requests": limits.max_running_requests,
        "max_req_input_len": limits.max_sequence_tokens - 1,
        "version": importlib.metadata.version("vlm_serve"),
    }


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
    """One short request with an image through every process (raises if it does not finish); text only
    on a PD decode server, which takes media only with their KV from a prefill server."""
    content: list[dict] = [{"type": "text", "text": "Describe."}]
    if tm.server_args.disaggregation_mode != "decode":
        content.insert(0, {"type": "image", "image": Image.new("RGB", (64, 64), (120, 30, 200))})
    x = await tm.process_messages([{"role": "user", "content": content}])
    choices = tm.normalize(GenerateReqInput(x, SamplingParams(max_new_tokens=2, temperature=0)))
    async with contextlib.aclosing(tm.generate(choices)) as outputs:
        async for _, out in outputs:
            if out.finish_reason == "abort":
                raise RuntimeError(f"the warm-up request failed: {out.message}")
    tm.metrics = ServerMetrics()


def serve_http(
    server_args: ServerArgs,
    port_args: PortArgs,
    limits: SchedulerLimits,
    children: ServerProcesses,
    sock: socket.socket,
) -> str:
    """Serves HTTP on `sock` (bound to the host and port) in this process until SIGTERM / Ctrl-C or a
    child's death; returns why it stopped unhealthily ('' after a clean stop)."""
    tm = TokenizerManager(server_args, port_args, limits)
    serving = OpenAIServing(tm, server_args, server_args.served_model_name)  # set by `with_local_model`
    state = ServerState()
    app = create_app(tm, serving, state, server_args.api_key)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    logging.getLogger("uvicorn.error").addFilter(_quiet_about_non_http)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RequestIdInLogs())
    server = _Server(config, tm, state, children)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the
    # handlers found here restored: make that a no-op so the caller stops the children
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    server.run(sockets=[sock])
    return state.failure


def _ignore(signum: int, frame: Any) -> None:
    pass


def _quiet_about_non_http(record: logging.LogRecord) -> bool:
    """Drops uvicorn's warning for a connection that does not speak HTTP/1.1 (it answers it a 400 anyway):
    sglang-router opens two such connections to every server it adds, probing for gRPC."""
    return record.getMessage() != "Invalid HTTP request received."


class _Server(uvicorn.Server):
    """Uvicorn with the warm-up before the socket opens, the 'listening' line after, and a watchdog
    (which also restarts encoder ranks that died)."""

    def __init__(
        self, config: uvicorn.Config, tm: TokenizerManager, state: ServerState, children: ServerProcesses
    ) -> None:
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
            print(f"vlm-serve: serving {self.tm.server_args.served_model_name} on http://{host}:{port}", flush=True)
            self.state.ready = True

    async def watch_children(self) -> None:
        """Until the server stops: restarts encoder ranks that died, and stops the server when another
        child died. Once it stops, children that exit were asked to (SIGTERM or Ctrl-C sent to the
        process group reaches them as well as this process)."""
        while True:
            await asyncio.sleep(WATCHDOG_SECONDS)
            if self.should_exit:
                return
            self.children.restart_encoders()
            if self.children.encoders is not None:
                self.state.encoders_down = self.children.encoders.failure
            failure = self.children.dead()
            if failure:
                self.state.failure = failure
                self.tm.fail_all(failure)  # requests in flight, and new ones, fail with a 503 naming it
                logger.error("%s; stopping the server", failure)
                print(f"vlm-serve: {failure}; stopping", file=sys.stderr, flush=True)
                await asyncio.sleep(UNHEALTHY_GRACE_SECONDS)
                self.should_exit = True
                return
