"""The set-ups of the built-in model that the combined-feature test (tests/deployments/test_combined_features.py) and
benchmarks/fuzz_soak.py send requests to, each started as real processes: `vlm-serve serve`, or a prefill
and a decode server behind sglang-router in PD mode (`pd`, which needs the pd extra). Each server's output
goes to a log file.

The matrix covers the scheduler's paths: the default (the built-in model drafts with its EAGLE-3 head, in
the overlap loop), the same in the normal loop, n-gram drafts, the overlap loop and the normal loop without drafts, small prefill chunks on pages of 4
tokens, TP 2 with EP 2 and an encoder pool of 2, and PD; a LoRA adapter in the chunked and TP 2 / EP 2 ones;
and the built-in model quantized by llm-compressor: to 4 bits (W4A16, its EAGLE-3 head in float beside it,
small chunks, the adapter over the 4-bit base) and to int8 weights and activations (W8A8: n-gram drafts in the
normal loop, pages of 16 over a host tier, the adapter). The overlap loop without drafts is the reference that
other set-ups' greedy answers must equal (it serves the adapter too); the quantized models answer otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vlm_serve.builtin import BUILTIN_DRAFT, BUILTIN_MODEL
from vlm_serve.server.ports import free_port
from vlm_serve.testing.lora_adapter import ADAPTER, make_adapter
from vlm_serve.testing.quantized import W4A16, W8A8, Recipe, quantize_checkpoints

NO_DRAFTS = ("--speculative-algorithm", "none")
# prefixes overflow a small KV pool into a host-memory tier, and come back from it
HOST_TIER = ("--enable-hierarchical-cache", "--max-total-tokens", "2048", "--hicache-ratio", "4")
# and from the host tier into storage, in the set-up's log folder ({logs})
STORAGE_TIER = ("--page-size", "16", "--hicache-storage-backend", "file", "--hicache-storage-dir", "{logs}/storage")
# a LoRA adapter (`ADAPTER`, made by peft with random weights in the set-up's log folder, the same in each) of
# the attention, the experts and the vision tower, beside the base
LORA = ("--enable-lora", "--lora-paths", f"{ADAPTER}={{logs}}/{ADAPTER}-adapter")
# the built-in model quantized (made by llm-compressor in the set-up's log folder, as `--model {logs}/NAME`)
QUANTIZED: dict[str, Recipe] = {"builtin-w4a16": W4A16, "builtin-w8a8": W8A8}
# in 4 bits, its draft head as it is
W4A16_BUILTIN = ("--model", "{logs}/builtin-w4a16", "--speculative-algorithm", "eagle3")
W4A16_BUILTIN += ("--speculative-draft-model-path", str(BUILTIN_DRAFT))
SETUPS: dict[str, tuple[str, ...] | None] = {  # name -> `vlm-serve serve` flags (None: a PD pair, default flags)
    "default": (),
    "eagle3-normal": ("--disable-overlap-schedule",),
    "ngram": ("--speculative-algorithm", "ngram"),
    "overlap": (*NO_DRAFTS, *LORA),  # (the reference: it serves the adapter too, for adapted answers)
    "normal": (*NO_DRAFTS, "--disable-overlap-schedule", "--vit-dp", "1"),  # (a GPU's default encoder process)
    "chunked": (
        "--chunked-prefill-size",
        "16",
        "--page-size",
        "4",
        *HOST_TIER,
        "--hicache-write-policy",
        "write_back",
        *LORA,
    ),  # fmt: skip
    "tp2-ep2": ("--tp-size", "2", "--ep-size", "2", "--vit-dp", "2", *HOST_TIER, *STORAGE_TIER, *LORA),
    "pd": None,
    "w4a16": (*W4A16_BUILTIN, "--chunked-prefill-size", "32", *LORA),
    # int8 weights and int8 activation rows: n-gram drafts in the normal loop, pages of 16 over a host tier
    "w8a8": (
        "--model",
        "{logs}/builtin-w8a8",
        "--speculative-algorithm",
        "ngram",
        "--disable-overlap-schedule",
        "--page-size",
        "16",
        *HOST_TIER,
        *LORA,
    ),  # fmt: skip
}
REFERENCE = "overlap"
START_TIMEOUT = 180.0
STOP_TIMEOUT = 60.0
CLIENT_TIMEOUT = 60.0  # for one request (up to 24 tokens): a longer wait is a failure
# a PD request whose other side is gone fails after this (the default, 300 s, outlasts a client's patience)
PD_TIMEOUT = "30"


def router_command(port: int, *args: str) -> list[str]:
    """sglang-router on loopback `port` with `args` (its metrics on a free port, warnings only)."""
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        *args,
    ]


def _in_child() -> None:
    """In a started process before exec: Ctrl-C's default action (a caller that ignores SIGINT must not
    pass that on), and SIGTERM when the starting process dies (so none is left behind)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run_child(command: list[str], **options) -> subprocess.CompletedProcess:
    return subprocess.run(command, preexec_fn=_in_child, **options)


@dataclass
class Process:
    """One started process (leading a process group of its own) and where its output goes."""

    name: str
    process: subprocess.Popen
    log: Path
    url: str

    def exited(self) -> str:
        """'' while it runs; else how it ended and the end of its output."""
        code = self.process.poll()
        if code is None:
            return ""
        tail = self.log.read_text(errors="replace")[-3000:]
        return f"{self.name} exited with code {code}; the end of {self.log}:\n{tail}"

    def stop(self) -> str:
        """SIGTERM, and the wait for its exit: '' after a clean exit (code 0), or if it had exited already
        (`exited` tells how); else what went wrong (a process that does not stop in time is killed with its
        group)."""
        if self.process.poll() is not None:
            return ""
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return f"{self.name} did not stop within {STOP_TIMEOUT:g} s of SIGTERM"
        return "" if code == 0 else f"{self.name} stopped with code {code}; see {self.log}"


@dataclass
class Deployment:
    """One set-up's running processes: `url` takes the requests; `servers` are the URLs of its servers."""

    name: str
    logs: Path
    processes: list[Process] = field(default_factory=list)
    url: str = ""
    servers: list[str] = field(default_factory=list)
    starts: int = 0  # (each start's processes log to files of their own)

    def start(self) -> None:
        """Starts the set-up's processes and waits until they serve."""
        self.starts += 1
        flags = SETUPS[self.name]
        if flags is not None:
            server = self._serve(self.name, flags)
            self.url, self.servers = server.url, [server.url]
            return
        bootstrap = str(free_port())
        pd_flags = ("--disaggregation-timeout", PD_TIMEOUT)
        prefill_flags = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap)
        prefill = self._serve("prefill", (*prefill_flags, *pd_flags, *HOST_TIER))  # (the decode side has no tiers)
        decode = self._serve("decode", ("--disaggregation-mode", "decode", *pd_flags))
        port = free_port()
        command = router_command(
            port,
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            bootstrap,
            "--decode",
            decode.url,
            "--disable-retries",
            "--disable-circuit-breaker",  # (a failure is the client's to see, at once)
        )
        router = self._spawn("router", command, f"http://127.0.0.1:{port}")
        self._wait(router, lambda: _healthy_workers(router.url) >= 2)
        self.url, self.servers = router.url, [prefill.url, decode.url]

    @property
    def routed(self) -> bool:
        """Whether requests go through sglang-router."""
        return SETUPS[self.name] is None

    def failure(self) -> str:
        """'' while every process runs and every server is healthy; else what went wrong (a server whose
        process died stops within seconds: its end is waited for, so that its log says why)."""
        unhealthy = [url for url in self.servers if not _healthy(url)]
        deadline = time.monotonic() + (STOP_TIMEOUT if unhealthy else 0)
        while unhealthy and not any(p.exited() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        exited = "\n".join(filter(None, (p.exited() for p in self.processes)))
        return exited or "".join(f"{url}/health is not ok\n" for url in unhealthy)

    def stop(self) -> list[str]:
        """Stops every process (the router first): what went wrong, if anything."""
        problems = [problem for p in reversed(self.processes) if (problem := p.stop())]
        self.processes = []
        return problems

    def restart(self) -> None:
        """A fresh start (after a process died)."""
        self.stop()
        self.start()

    @property
    def builtin(self) -> bool:
        """Whether it serves the built-in model as it ships (whose greedy answers the reference's must equal)."""
        return "--model" not in (SETUPS[self.name] or ())

    @property
    def adapter(self) -> bool:
        """Whether its servers serve the LoRA adapter `ADAPTER`."""
        return "--enable-lora" in (SETUPS[self.name] or ())

    def _serve(self, name: str, flags: tuple[str, ...]) -> Process:
        if "--enable-lora" in flags and not (self.logs / self.name / f"{ADAPTER}-adapter").is_dir():
            make_adapter(self.logs / self.name / f"{ADAPTER}-adapter")
        for folder, recipe in QUANTIZED.items():
            quantized = self.logs / self.name / folder
            if f"{{logs}}/{folder}" in flags and not quantized.is_dir():
                quantize_checkpoints([(BUILTIN_MODEL, quantized, recipe)], run=_run_child)
                (quantized / "training.json").write_bytes((BUILTIN_MODEL / "training.json").read_bytes())
        port = free_port()
        command = [sys.executable, "-m", "vlm_serve.cli", "serve", "--model", str(BUILTIN_MODEL), "--port", str(port)]
        command += [flag.replace("{logs}", str(self.logs / self.name)) for flag in flags]
        server = self._spawn(name, command, f"http://127.0.0.1:{port}")
        self._wait(server, lambda: _healthy(server.url))
        return server

    def _spawn(self, name: str, command: list[str], url: str) -> Process:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{self.name}-{name}{f'-{self.starts}' if self.starts > 1 else ''}.log"
        with log.open("a") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_in_child
            )
        started = Process(f"{self.name}/{name}", process, log, url)
        self.processes.append(started)
        return started

    def _wait(self, process: Process, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if ready():
                    return
            if process.exited() or time.monotonic() > deadline:
                problem = process.exited() or f"{process.name} did not start within {START_TIMEOUT:g} s"
                self.stop()
                raise RuntimeError(problem)
            time.sleep(0.2)


# one client for every check: each of httpx's module-level calls builds a client, and its TLS context, anew
# (about 30 ms of CPU on 2 cores, several times a request when every request is checked)
_CLIENT = httpx.Client(timeout=10)


def _healthy(url: str) -> bool:
    try:
        return _CLIENT.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _healthy_workers(url: str) -> int:
    return _CLIENT.get(url + "/readiness", timeout=5).json().get("healthy_workers", 0)


@contextlib.contextmanager
def deployed(name: str, logs: Path) -> Iterator[Deployment]:
    """The set-up `name` running for a `with` block; its processes' logs in `logs`. It is stopped at the
    end, whatever happened; a process that did not stop cleanly then is an AssertionError."""
    deployment = Deployment(name, logs)
    deployment.start()
    try:
        yield deployment
    except BaseException:
        deployment.stop()
        raise
    problems = deployment.stop()
    assert not problems, "\n".join(problems)
