"""Fetching an image or video from an http(s) URL, safely, for servers that allow remote media.

`fetch_url` only talks to hosts on an allow-list (re-checked on every redirect), refuses credentials in
URLs, follows at most `MAX_REDIRECTS` redirects, never holds more than `max_bytes` of body, and keeps
the whole fetch (name lookup, connect, TLS handshake, every redirect, the body) within one wall-clock
budget. Every problem is raised as `MediaError` with a message naming it. Standard library only.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import string
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn
from urllib.parse import SplitResult, quote, urljoin, urlsplit

from vlm_serve.errors import MediaError

MAX_REDIRECTS = 3
ALLOWED_DOMAINS_FLAG = "--allowed-media-domains"
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_SCHEMES = {"http": 80, "https": 443}
_CHUNK_BYTES = 64 * 1024
_USER_AGENT = "vlm-serve"


class _FetchTimeout(Exception):
    """The wall-clock budget ran out; turned into a MediaError naming the budget by `fetch_url`."""


class _Budget:
    """The deadline of one fetch; the watchdog calls `expire()` when it cuts the connection."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self._expired = threading.Event()

    def expire(self) -> None:
        self._expired.set()

    def remaining(self) -> float:
        """Seconds left; raises `_FetchTimeout` once none are."""
        left = self.deadline - time.monotonic()
        if left <= 0 or self._expired.is_set():
            raise _FetchTimeout
        return left


def fetch_url(url: str, kind: str, allowed_domains: Sequence[str], max_bytes: int, timeout: float) -> bytes:
    """Download the body at `url` (an http or https URL of an image or video) and return it.

    `kind` ("image" or "video") is only used in messages. `allowed_domains` lists the hosts that may be
    contacted: an entry matches a host exactly (case-insensitive), or, written with a leading dot
    (".example.com"), any subdomain of it ("cdn.example.com", not "example.com" itself); an empty list
    disables remote fetching. `max_bytes` bounds the body and `timeout` (seconds) the whole fetch.
    """
    if max_bytes <= 0 or timeout <= 0:
        raise ValueError(f"max_bytes and timeout must be positive, got {max_bytes} and {timeout}")
    domains = _normalize_domains(allowed_domains)
    budget = _Budget(timeout)
    try:
        for hop in range(MAX_REDIRECTS + 1):
            parts = _check_url(url, kind, domains, redirected=hop > 0)
            location, body = _get(parts, kind, max_bytes, budget)
            if location is None:
                return body
            url = urljoin(url, location)
        raise MediaError(f"{kind} URL redirected more than {MAX_REDIRECTS} times")
    except _FetchTimeout:
        raise MediaError(f"{kind} URL fetch timed out after {timeout:g} s") from None


def _normalize_domains(allowed_domains: Sequence[str]) -> list[str]:
    return [d.strip().lower().rstrip(".") for d in allowed_domains if d.strip().strip(".")]


def _host_allowed(host: str, domains: Sequence[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host.endswith(d) if d.startswith(".") else host == d for d in domains)


def _check_url(url: str, kind: str, domains: Sequence[str], redirected: bool) -> SplitResult:
    """Parse `url` and check its scheme, credentials and host; `redirected` only changes the messages."""
    what = f"{kind} URL redirect target" if redirected else f"{kind} URL"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a malformed port
    except ValueError as exc:
        raise MediaError(f"malformed {what}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise MediaError(f"{what} scheme {scheme!r} is not supported; only http and https URLs can be fetched")
    if not domains:
        raise MediaError(
            f"remote {kind} URLs are disabled on this server; "
            f"start it with {ALLOWED_DOMAINS_FLAG} to allow fetching from given hosts"
        )
    if parts.username is not None or parts.password is not None:
        raise MediaError(f"{what} must not contain credentials (user:password@host)")
    if not parts.hostname:
        raise MediaError(f"{what} has no host")
    if not _host_allowed(parts.hostname, domains):
        raise MediaError(f"{what} host {parts.hostname!r} is not in the allowed media domains")
    return parts


def _get(parts: SplitResult, kind: str, max_bytes: int, budget: _Budget) -> tuple[str | None, bytes]:
    """One GET: (redirect location, b"") for a redirect, else (None, body)."""
    host, port = parts.hostname or "", parts.port or _SCHEMES[parts.scheme.lower()]
    with _connect(host, port, parts.scheme.lower() == "https", kind, budget) as conn:
        headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity", "Connection": "close"}
        conn.request("GET", _request_target(parts), headers=headers)
        sock = conn.sock  # getresponse() hands the socket over to the response and forgets it
        sock.settimeout(budget.remaining())
        with conn.getresponse() as response:
            if response.status in _REDIRECT_STATUSES:
                location = response.getheader("Location")
                if not location:
                    raise MediaError(f"{kind} URL redirect (HTTP {response.status}) has no Location header")
                return location, b""
            if response.status >= 400:
                raise MediaError(f"{kind} URL fetch failed: HTTP {response.status} {response.reason}".rstrip())
            return None, _read_body(response, sock, kind, max_bytes, budget)


def _request_target(parts: SplitResult) -> str:
    """Path and query, with non-ASCII characters, spaces and controls percent-encoded."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return quote(target, safe=string.punctuation)


def _read_body(
    response: http.client.HTTPResponse, sock: socket.socket, kind: str, max_bytes: int, budget: _Budget
) -> bytes:
    declared = _content_length(response)
    if declared is not None and declared > max_bytes:
        raise MediaError(
            f"{kind} URL is too large: Content-Length {declared} bytes exceeds the limit of {max_bytes} bytes"
        )
    body = bytearray()
    while chunk := _read_chunk(response, sock, budget):
        body += chunk
        if len(body) > max_bytes:
            raise MediaError(f"{kind} URL body is too large: it exceeds the limit of {max_bytes} bytes")
    budget.remaining()  # the watchdog ends a slow body early: that is a timeout, not a short body
    if declared is not None and len(body) < declared:
        raise MediaError(f"{kind} URL body ended after {len(body)} of {declared} bytes")
    if not body:
        raise MediaError(f"{kind} URL returned an empty body")
    return bytes(body)


def _read_chunk(response: http.client.HTTPResponse, sock: socket.socket, budget: _Budget) -> bytes:
    """Whatever part of the body has arrived (b"" at its end), waiting no longer than the budget allows."""
    sock.settimeout(budget.remaining())
    return response.read1(_CHUNK_BYTES)


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.getheader("Content-Length")
    if value is None or response.chunked:
        return None
    try:
        return int(value)
    except ValueError:
        return None


@contextmanager
def _connect(host: str, port: int, tls: bool, kind: str, budget: _Budget) -> Iterator[http.client.HTTPConnection]:
    """An HTTP(S) connection, cut by a watchdog when the budget runs out wherever the fetch then is.

    Network and protocol errors inside the `with` block become a MediaError (or a timeout).
    """
    try:
        sock = _open_socket(host, port, budget)
    except OSError as exc:
        _raise_fetch_error(exc, host, kind, budget)
    cutter = sock.dup()  # shutting down a duplicate wakes up a read blocked on `sock`, TLS or not
    watchdog = threading.Timer(max(budget.deadline - time.monotonic(), 0.0), _cut, args=(cutter, budget))
    watchdog.daemon = True
    watchdog.start()
    conn: http.client.HTTPConnection | None = None
    try:
        conn = _http_connection(sock, host, port, tls)
        yield conn
    except (OSError, http.client.HTTPException) as exc:
        _raise_fetch_error(exc, host, kind, budget)
    finally:
        watchdog.cancel()
        cutter.close()
        if conn is not None:
            conn.close()
        sock.close()


def _raise_fetch_error(exc: BaseException, host: str, kind: str, budget: _Budget) -> NoReturn:
    if isinstance(exc, TimeoutError):
        raise _FetchTimeout from exc
    budget.remaining()  # the watchdog cutting the connection shows up as a connection error
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, socket.gaierror):
        reason = f"cannot resolve host: {reason}"
    raise MediaError(f"{kind} URL fetch from {host!r} failed: {reason}") from exc


def _cut(sock: socket.socket, budget: _Budget) -> None:
    budget.expire()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _http_connection(sock: socket.socket, host: str, port: int, tls: bool) -> http.client.HTTPConnection:
    if not tls:
        conn = http.client.HTTPConnection(host, port)
        conn.sock = sock
        return conn
    context = ssl.create_default_context()
    conn = http.client.HTTPSConnection(host, port, context=context)
    conn.sock = context.wrap_socket(sock, server_hostname=host)  # the handshake runs under the watchdog
    return conn


def _open_socket(host: str, port: int, budget: _Budget) -> socket.socket:
    """Connect to the first address of `host` that answers, like `socket.create_connection`, within budget."""
    error = OSError(f"no address found for {host!r}")
    for family, type_, proto, _, address in _resolve(host, port, budget):
        sock = socket.socket(family, type_, proto)
        try:
            sock.settimeout(budget.remaining())
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


def _resolve(host: str, port: int, budget: _Budget) -> list[tuple]:
    """`getaddrinfo` in a daemon thread, so that a slow name lookup cannot outlast the budget."""
    result: list = []
    lookup = threading.Thread(target=_lookup, args=(host, port, result), daemon=True)
    lookup.start()
    lookup.join(budget.remaining())
    if not result:
        raise _FetchTimeout
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _lookup(host: str, port: int, result: list) -> None:
    try:
        result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except OSError as exc:
        result.append(exc)
