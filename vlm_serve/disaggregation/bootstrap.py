"""The bootstrap server: where decode ranks find the prefill ranks of a prefill server.

The prefill server's launcher runs one (`BootstrapServer`) in its main process, on
`--disaggregation-bootstrap-port`; sglang-router gives both servers of a request its address (the
prefill worker's host and that port). Each prefill TP rank registers its `RankInfo` there when its
transfer backend starts (`register_rank`); decode rank r asks for prefill rank r (`lookup_rank`),
retrying until the prefill server is up and the rank registered, then gives up with an error that names
the bootstrap address.

HTTP, JSON bodies:
- `PUT /route`: a rank registers (a `RankInfo`); a rank that registers again replaces its entry.
- `GET /route?tp_rank=R`: that rank's `RankInfo`, or 404 while it has not registered.
- `GET /health`: 200 while the server runs.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from vlm_serve.disaggregation.transfer import KVLayout

if TYPE_CHECKING:
    from vlm_serve.config import ParallelSettings

logger = logging.getLogger(__name__)

Address = tuple[str, int]
RETRY_SECONDS = 0.2  # between attempts to register or look up
WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class RankInfo:
    """What a peer needs to reach one TP rank: its control socket, its transfer-engine session and the
    layout of its KV and metadata buffers."""

    tp_rank: int
    tp_size: int
    control_addr: str  # the rank's ZMQ PULL socket, tcp://HOST:PORT
    session: str  # the transfer engine's HOST:RPC_PORT ("" for the fake backend)
    layout: KVLayout

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankInfo:
        return cls(**{**data, "layout": KVLayout(**data["layout"])})


class BootstrapServer:
    """The registry of one prefill server's ranks, served over HTTP from a thread of the launcher."""

    def __init__(self, host: str, port: int) -> None:
        """Binds the port (0: any free one); a ValueError names the address if it cannot (in use, say)."""
        try:
            self._http = _Server((host, port), _Handler)
        except OSError as exc:
            raise ValueError(
                f"the bootstrap server cannot listen on {host}:{port} (--disaggregation-bootstrap-port): {exc.strerror}"
            ) from None
        self._http.ranks = {}
        # a child forked from the launcher (a CPU server's scheduler) does not hold the port
        multiprocessing.util.register_after_fork(self._http.socket, socket.socket.close)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    def start(self) -> BootstrapServer:
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.1}, name="pd-bootstrap", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and frees the port (quietly; a stopped server may be stopped again)."""
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join()
            self._thread = None
        self._http.server_close()

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ranks: dict[int, dict[str, Any]]  # tp_rank -> RankInfo as JSON

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.exception("bootstrap server: error answering %s", client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if url.path == "/health":
            self._reply(HTTPStatus.OK, {"status": "ok"})
        elif url.path == "/route":
            ranks = parse_qs(url.query).get("tp_rank", [""])
            if not ranks[0].isdigit():
                self._reply(HTTPStatus.BAD_REQUEST, {"error": "tp_rank=N is required"})
            elif (info := self.server.ranks.get(int(ranks[0]))) is None:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"prefill rank {ranks[0]} has not registered"})
            else:
                self._reply(HTTPStatus.OK, info)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {url.path}"})

    def do_PUT(self) -> None:  # noqa: N802
        if urlsplit(self.path).path != "/route":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            info = RankInfo.from_json(body)
        except (ValueError, TypeError, KeyError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"not a rank registration: {exc}"})
            return
        self.server.ranks[info.tp_rank] = info.to_json()
        self._reply(HTTPStatus.OK, {"status": "registered"})

    def _reply(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        """Quiet: decode ranks poll while prefill ranks start."""


def register_rank(server: Address, info: RankInfo, timeout: float) -> None:
    """Registers a prefill rank, retrying while the bootstrap server starts (it may be on another node)."""
    request = urllib.request.Request(
        _url(server, "/route"),
        data=json.dumps(info.to_json()).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    _retry(server, f"could not register prefill rank {info.tp_rank}", timeout, None, lambda t: _call(request, t))


def lookup_rank(server: Address, tp_rank: int, timeout: float, stop: threading.Event | None = None) -> RankInfo:
    """Prefill rank `tp_rank`'s registration, retrying until it is there or `timeout` seconds have passed
    (then a TimeoutError naming the bootstrap server); `stop` ends the retries early."""
    url = _url(server, f"/route?tp_rank={tp_rank}")
    data = _retry(server, f"no prefill rank {tp_rank} found", timeout, stop, lambda t: _call(url, t))
    return RankInfo.from_json(data)


def not_found(server: Address, what: str, timeout: float, last_error: str = "") -> str:
    """The message of a bootstrap that did not succeed in time."""
    detail = f" (last: {last_error})" if last_error else ""
    return f"{what} through the bootstrap server at {server[0]}:{server[1]} in {timeout:g} s{detail}"


def _retry(
    server: Address, what: str, timeout: float, stop: threading.Event | None, attempt: Callable[[float], Any]
) -> Any:
    """`attempt(seconds)`'s answer, attempting until it answers or `timeout` has passed."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return attempt(min(1.0, max(0.1, left)))
        except (OSError, ValueError) as exc:  # refused, timed out, 404 while the rank starts, not JSON
            error = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if left <= RETRY_SECONDS or stop.wait(RETRY_SECONDS):
            raise TimeoutError(not_found(server, what, timeout, str(error)))


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (peers are never behind $http_proxy)


def _call(request: urllib.request.Request | str, timeout: float) -> Any:
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ValueError(json.loads(exc.read() or b"{}").get("error", f"HTTP {exc.code}")) from None


def _url(server: Address, path: str) -> str:
    host = f"[{server[0]}]" if ":" in server[0] else server[0]
    return f"http://{host}:{server[1]}{path}"


def bootstrap_address(host: str, parallel: ParallelSettings, port: int) -> Address:
    """Where a prefill rank registers: its server's bootstrap server (at `port`), in node 0's launcher; `host`
    is the HTTP server's."""
    if parallel.node_rank == 0:
        return "127.0.0.1" if host in WILDCARDS else host, port
    return parallel.dist_init_addr.rpartition(":")[0], port


def rank_host(host: str) -> str:
    """The address peers reach this rank's control socket and transfer engine at: `host` (`--host`) where it
    names one interface, else the address of the interface that carries the default route."""
    if host not in WILDCARDS:
        return socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # (UDP: nothing is sent, the kernel only picks a route)
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
