"""`fetch_url` downloads remote media only from allowed hosts, bounded in bytes, redirects and time.

A local `ThreadingHTTPServer` on 127.0.0.1 plays every kind of server; each refusal is a `MediaError`
whose message names the problem.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from vlm_serve.errors import MediaError
from vlm_serve.multimodal import fetch as fetch_module
from vlm_serve.multimodal.fetch import MAX_REDIRECTS, fetch_url

LOCAL = ["127.0.0.1"]
LIMIT = 100_000  # bytes
BIG = 200_000  # bytes, past LIMIT
TIMEOUT = 0.5  # seconds
SLOW = 2.0  # seconds a slow endpoint takes, well past TIMEOUT


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buffer, "PNG")
    return buffer.getvalue()


PNG = _png_bytes()


class _Handler(BaseHTTPRequestHandler):
    """Serves the routes below; any other path is a 404."""

    server: _Server

    def do_GET(self) -> None:  # the name http.server dispatches to
        self.server.paths.append(self.path)
        route = self.path.split("?")[0]
        if route.startswith("/chain/"):
            return self._chain(int(route.rsplit("/", 1)[1]))
        handler = _ROUTES.get(route)
        try:
            if handler is None:
                self.send_error(404, "Not Found")
            else:
                handler(self)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def log_message(self, format: str, *args: object) -> None:  # keep the test output quiet
        pass

    # -- helpers ---------------------------------------------------------------------------------------

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def send_body(self, body: bytes, content_length: int | None = None, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str | None, status: int = 302) -> None:
        self.send_response(status)
        if location is not None:
            self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _chain(self, left: int) -> None:
        """/chain/N answers with N redirects in a row before the PNG."""
        if left == 0:
            self.send_body(PNG)
        else:
            self.redirect(f"/chain/{left - 1}")

    # -- routes ----------------------------------------------------------------------------------------

    def image(self) -> None:
        self.send_body(PNG)

    def empty(self) -> None:
        self.send_body(b"")

    def large(self) -> None:
        self.send_body(b"x" * BIG)

    def declared_huge(self) -> None:
        """Claims 50 MB but sends 1 KB and stalls: only a client trusting the header refuses in time."""
        self.send_body(b"x" * 1024, content_length=50_000_000)
        time.sleep(SLOW)

    def no_length(self) -> None:
        """No Content-Length: the body runs until the connection closes, past the limit."""
        self.send_response(200)
        self.end_headers()
        for _ in range(BIG // 8192 + 1):
            self.wfile.write(b"x" * 8192)

    def chunked(self) -> None:
        """A chunked body that streams past the limit."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for _ in range(BIG // 8192 + 1):
            self.wfile.write(b"2000\r\n" + b"x" * 8192 + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def lying_length(self) -> None:
        """Claims 10 bytes, then keeps sending."""
        self.send_body(b"x" * BIG, content_length=10)

    def truncated(self) -> None:
        """Claims 100 bytes, sends 10 and hangs up."""
        self.send_body(b"x" * 10, content_length=100)

    def slow_start(self) -> None:
        time.sleep(SLOW)
        self.send_body(PNG)

    def slow_body(self) -> None:
        """Sends part of the body, then sleeps past the timeout."""
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG[:10])
        self.wfile.flush()
        time.sleep(SLOW)
        self.wfile.write(PNG[10:])

    def trickle(self) -> None:
        """One byte every 50 ms: every read is quick, the whole body is not."""
        self.send_response(200)
        self.send_header("Content-Length", "40")
        self.end_headers()
        for _ in range(40):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(SLOW / 40)

    def trickle_headers(self) -> None:
        """A header line sent one byte every 20 ms for 5 s, then the PNG: every read is quick, the headers are not."""
        self.wfile.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nX-Slow: ")
        for _ in range(250):
            self.wfile.write(b"a")
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(f"\r\nContent-Length: {len(PNG)}\r\n\r\n".encode() + PNG)

    def slow_redirect(self) -> None:
        """0.3 s, then a redirect to /slow-image (another 0.3 s): each hop fits in 0.5 s, both do not."""
        time.sleep(0.3)
        self.redirect("/slow-image")

    def slow_image(self) -> None:
        time.sleep(0.3)
        self.send_body(PNG)

    def redirect_relative(self) -> None:
        self.redirect("/image.png")

    def redirect_absolute(self) -> None:
        self.redirect(f"{self.origin}/image.png", status=301)

    def redirect_to_localhost(self) -> None:
        self.redirect(f"http://localhost:{self.server.server_port}/not-to-be-fetched")

    def redirect_to_other_host(self) -> None:
        self.redirect("http://evil.example/steal.png", status=307)

    def redirect_to_ftp(self) -> None:
        self.redirect("ftp://127.0.0.1/image.png")

    def redirect_with_credentials(self) -> None:
        self.redirect(f"http://user:secret@127.0.0.1:{self.server.server_port}/image.png")

    def redirect_without_location(self) -> None:
        self.redirect(None)

    def loop(self) -> None:
        self.redirect("/loop")

    def server_error(self) -> None:
        self.send_error(500, "Internal Server Error")


_ROUTES: dict[str, Callable[[_Handler], None]] = {
    "/image.png": _Handler.image,
    "/empty": _Handler.empty,
    "/large": _Handler.large,
    "/declared-huge": _Handler.declared_huge,
    "/no-length": _Handler.no_length,
    "/chunked": _Handler.chunked,
    "/lying-length": _Handler.lying_length,
    "/truncated": _Handler.truncated,
    "/slow-start": _Handler.slow_start,
    "/slow-body": _Handler.slow_body,
    "/trickle": _Handler.trickle,
    "/trickle-headers": _Handler.trickle_headers,
    "/slow-redirect": _Handler.slow_redirect,
    "/slow-image": _Handler.slow_image,
    "/redirect-relative": _Handler.redirect_relative,
    "/redirect-absolute": _Handler.redirect_absolute,
    "/redirect-to-localhost": _Handler.redirect_to_localhost,
    "/redirect-to-other-host": _Handler.redirect_to_other_host,
    "/redirect-to-ftp": _Handler.redirect_to_ftp,
    "/redirect-with-credentials": _Handler.redirect_with_credentials,
    "/redirect-without-location": _Handler.redirect_without_location,
    "/loop": _Handler.loop,
    "/server-error": _Handler.server_error,
}


class _Server(ThreadingHTTPServer):
    block_on_close = False  # teardown does not wait for the slow endpoints to finish sleeping

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []  # every path requested, in order


@pytest.fixture(scope="module")
def running_server() -> Iterator[_Server]:
    """One server for the module, served from a thread and shut down at teardown."""
    httpd = _Server()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def server(running_server: _Server) -> _Server:
    """The server, with no requests recorded yet."""
    running_server.paths.clear()
    return running_server


@pytest.fixture
def origin(server: _Server) -> str:
    return f"http://127.0.0.1:{server.server_port}"


def fetch(
    url: str, allowed: list[str] = LOCAL, max_bytes: int = LIMIT, timeout: float = 5.0, kind: str = "image"
) -> bytes:
    return fetch_url(url, kind, allowed, max_bytes, timeout)


# -- what is fetched -----------------------------------------------------------------------------------


def test_an_allowed_url_returns_the_body(origin: str) -> None:
    assert fetch(f"{origin}/image.png") == PNG


def test_a_body_of_exactly_max_bytes_is_accepted(origin: str) -> None:
    assert fetch(f"{origin}/image.png", max_bytes=len(PNG)) == PNG


def test_the_query_string_is_sent(origin: str, server: _Server) -> None:
    assert fetch(f"{origin}/image.png?size=8") == PNG
    assert server.paths == ["/image.png?size=8"]


def test_a_non_ascii_path_is_sent_percent_encoded(origin: str, server: _Server) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        fetch(f"{origin}/café pic.png")
    assert server.paths == ["/caf%C3%A9%20pic.png"]


def test_messages_name_the_kind_of_media(origin: str) -> None:
    with pytest.raises(MediaError, match="^video URL fetch failed: HTTP 404"):
        fetch(f"{origin}/missing.mp4", kind="video")


# -- scheme, credentials, allowed hosts ----------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/image.png", "file:///etc/passwd", "gopher://127.0.0.1/"])
def test_schemes_other_than_http_and_https_are_refused(url: str) -> None:
    with pytest.raises(MediaError, match="scheme .* is not supported; only http and https"):
        fetch(url)


def test_an_empty_allow_list_disables_remote_urls_and_names_the_flag(origin: str, server: _Server) -> None:
    with pytest.raises(MediaError, match="remote image URLs are disabled.*--allowed-media-domains"):
        fetch(f"{origin}/image.png", allowed=[])
    assert server.paths == []


@pytest.mark.parametrize("userinfo", ["user:secret@", "user@", ":secret@"])
def test_credentials_in_the_url_are_refused(server: _Server, userinfo: str) -> None:
    with pytest.raises(MediaError, match="must not contain credentials"):
        fetch(f"http://{userinfo}127.0.0.1:{server.server_port}/image.png")
    assert server.paths == []


def test_a_host_not_allowed_is_refused_before_any_connection(server: _Server) -> None:
    with pytest.raises(MediaError, match="^image URL host 'localhost' is not in the allowed media domains$"):
        fetch(f"http://localhost:{server.server_port}/image.png")
    assert server.paths == []


def test_a_url_without_a_host_is_refused() -> None:
    with pytest.raises(MediaError, match="has no host"):
        fetch("http:///image.png")


def test_a_malformed_port_is_refused() -> None:
    with pytest.raises(MediaError, match="malformed image URL"):
        fetch("http://127.0.0.1:99999999/image.png")


@pytest.fixture
def example_com_is_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every name under example.com resolve to 127.0.0.1, where the test server listens."""
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host: str, *args: object, **kwargs: object) -> list:
        if host.lower().rstrip(".").endswith("example.com"):
            host = "127.0.0.1"
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(fetch_module.socket, "getaddrinfo", getaddrinfo)


@pytest.mark.usefixtures("example_com_is_local")
def test_hosts_match_case_insensitively(server: _Server) -> None:
    assert fetch(f"http://CDN.Example.COM:{server.server_port}/image.png", allowed=["cdn.example.com"]) == PNG
    assert fetch(f"http://cdn.example.com:{server.server_port}/image.png", allowed=["CDN.EXAMPLE.COM"]) == PNG


@pytest.mark.usefixtures("example_com_is_local")
def test_a_leading_dot_entry_allows_subdomains(server: _Server) -> None:
    allowed = [".example.com"]
    assert fetch(f"http://cdn.example.com:{server.server_port}/image.png", allowed=allowed) == PNG
    assert fetch(f"http://a.b.example.com:{server.server_port}/image.png", allowed=allowed) == PNG


@pytest.mark.parametrize("host", ["example.com", "evilexample.com", "example.com.evil.net"])
def test_a_leading_dot_entry_allows_neither_the_domain_itself_nor_look_alikes(host: str) -> None:
    with pytest.raises(MediaError, match=f"host '{host}' is not in the allowed media domains"):
        fetch(f"http://{host}/image.png", allowed=[".example.com"])


def test_an_exact_entry_does_not_allow_subdomains() -> None:
    with pytest.raises(MediaError, match="host 'cdn.example.com' is not in the allowed media domains"):
        fetch("http://cdn.example.com/image.png", allowed=["example.com"])


# -- redirects -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/redirect-relative", "/redirect-absolute"])
def test_a_redirect_to_an_allowed_url_is_followed(origin: str, server: _Server, path: str) -> None:
    assert fetch(f"{origin}{path}") == PNG
    assert server.paths == [path, "/image.png"]


def test_up_to_three_redirects_are_followed(origin: str) -> None:
    assert MAX_REDIRECTS == 3
    assert fetch(f"{origin}/chain/3") == PNG


def test_a_fourth_redirect_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match="redirected more than 3 times"):
        fetch(f"{origin}/chain/4")


def test_a_redirect_loop_is_refused(origin: str, server: _Server) -> None:
    with pytest.raises(MediaError, match="redirected more than 3 times"):
        fetch(f"{origin}/loop")
    assert server.paths == ["/loop"] * 4


@pytest.mark.parametrize(
    ("path", "host"), [("/redirect-to-localhost", "localhost"), ("/redirect-to-other-host", "evil.example")]
)
def test_a_redirect_to_a_host_not_allowed_is_refused(origin: str, server: _Server, path: str, host: str) -> None:
    with pytest.raises(MediaError, match=f"redirect target host '{host}' is not in the allowed media domains"):
        fetch(f"{origin}{path}")
    assert server.paths == [path]  # the target was never requested


def test_a_redirect_to_another_scheme_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match="redirect target scheme 'ftp' is not supported"):
        fetch(f"{origin}/redirect-to-ftp")


def test_a_redirect_with_credentials_is_refused(origin: str, server: _Server) -> None:
    with pytest.raises(MediaError, match="redirect target must not contain credentials"):
        fetch(f"{origin}/redirect-with-credentials")
    assert server.paths == ["/redirect-with-credentials"]


def test_a_redirect_without_a_location_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match=r"redirect \(HTTP 302\) has no Location header"):
        fetch(f"{origin}/redirect-without-location")


# -- size ----------------------------------------------------------------------------------------------


def test_a_content_length_over_the_limit_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match=f"Content-Length {BIG} bytes exceeds the limit of {LIMIT} bytes"):
        fetch(f"{origin}/large")


def test_a_content_length_over_the_limit_is_refused_without_reading_the_body(origin: str) -> None:
    # The server stalls after 1 KB: reading on would end in a timeout, not in this error.
    with pytest.raises(MediaError, match="Content-Length 50000000 bytes exceeds the limit"):
        fetch(f"{origin}/declared-huge", timeout=TIMEOUT)


@pytest.mark.parametrize("path", ["/no-length", "/chunked"])
def test_a_body_without_content_length_is_cut_off_past_the_limit(origin: str, path: str) -> None:
    with pytest.raises(MediaError, match=f"body is too large: it exceeds the limit of {LIMIT} bytes"):
        fetch(f"{origin}{path}")


def test_a_body_without_content_length_under_the_limit_is_accepted(origin: str) -> None:
    assert len(fetch(f"{origin}/no-length", max_bytes=10 * BIG)) > BIG


def test_no_more_than_the_declared_content_length_is_read(origin: str) -> None:
    assert fetch(f"{origin}/lying-length") == b"x" * 10


def test_a_body_shorter_than_its_content_length_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match="body ended after 10 of 100 bytes"):
        fetch(f"{origin}/truncated")


def test_an_empty_body_is_refused(origin: str) -> None:
    with pytest.raises(MediaError, match="returned an empty body"):
        fetch(f"{origin}/empty")


# -- time ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/slow-start", "/slow-body"])
def test_a_server_slower_than_the_timeout_is_refused(origin: str, path: str) -> None:
    with pytest.raises(MediaError, match="^image URL fetch timed out after 0.5 s$"):
        fetch(f"{origin}{path}", timeout=TIMEOUT)


def test_the_timeout_bounds_the_whole_body_not_each_read(origin: str) -> None:
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        fetch(f"{origin}/trickle", timeout=TIMEOUT)


def test_the_timeout_bounds_slowly_trickling_headers(origin: str) -> None:
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        fetch(f"{origin}/trickle-headers", timeout=TIMEOUT)


def test_the_timeout_bounds_all_redirects_together(origin: str) -> None:
    assert fetch(f"{origin}/slow-redirect", timeout=5.0) == PNG
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        fetch(f"{origin}/slow-redirect", timeout=TIMEOUT)


def test_the_timeout_bounds_a_slow_name_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_getaddrinfo(*args: object, **kwargs: object) -> list:
        time.sleep(SLOW)
        raise socket.gaierror("too late")

    monkeypatch.setattr(fetch_module.socket, "getaddrinfo", slow_getaddrinfo)
    with pytest.raises(MediaError, match="timed out after 0.5 s"):
        fetch("http://127.0.0.1/image.png", timeout=TIMEOUT)


# -- server and network errors -------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "status"), [("/missing.png", 404), ("/server-error", 500)])
def test_an_http_error_status_is_refused_with_the_status(origin: str, path: str, status: int) -> None:
    with pytest.raises(MediaError, match=f"fetch failed: HTTP {status}"):
        fetch(f"{origin}{path}")


def test_a_connection_error_is_refused_with_the_reason() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once the probe closes
    with pytest.raises(MediaError, match="fetch from '127.0.0.1' failed: .*[Cc]onnection refused"):
        fetch(f"http://127.0.0.1:{port}/image.png")


def test_a_name_that_does_not_resolve_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_getaddrinfo(*args: object, **kwargs: object) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(fetch_module.socket, "getaddrinfo", failing_getaddrinfo)
    with pytest.raises(MediaError, match="cannot resolve host"):
        fetch("http://cdn.example.com/image.png", allowed=[".example.com"])


def test_media_error_is_a_value_error(origin: str) -> None:
    with pytest.raises(ValueError):
        fetch(f"{origin}/missing.png")
