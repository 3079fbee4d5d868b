"""What every child process of the server does first: take a name that `ps` and `top` show, and leave
Ctrl-C to the launcher (from its birth: `starting_children`); how it ends: at once, without the
interpreter's teardown (whose garbage collection of torch's objects takes most of a second per process
of a stopping server); and how a stop signal waits for work that must not be cut in half
(`stop_signals_deferred`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from vlm_serve.config import EncoderSettings

_PR_SET_NAME = 15
IDLE_POLL_MS = 500  # an idle process waits this long for a message before checking on its parent


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def init_child_process(name: str) -> None:
    """Names the process (at most 15 characters show) and lets the launcher decide how it stops: Ctrl-C
    reaches the whole process group, so it is ignored here; SIGTERM (the launcher's request) exits
    through `finally` blocks. The stop signals were blocked since the child's birth (`starting_children`):
    a SIGINT that came meanwhile is dropped, a SIGTERM is handled now."""
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def starting_children() -> contextlib.AbstractContextManager[None]:
    """For a block that starts child processes (and waits for none: it must be short). The children are
    born with SIGINT and SIGTERM blocked (a signal mask survives fork and exec) until `init_child_process`
    has set their handlers: Ctrl-C reaches the whole process group, and a child still importing torch
    would print a KeyboardInterrupt traceback. This process handles the stop signals that arrived during
    the block after it: in the middle of a start, one would leave a child reading half of what it was sent."""
    return _signals_held(STOP_SIGNALS, blocked=True)


def stop_signals_deferred() -> contextlib.AbstractContextManager[None]:
    """Runs the block, then the handlers of the SIGINT and SIGTERM that arrived during it (their exception
    replaces one the block raised: a stop wins over the failure of work it interrupted)."""
    return _signals_held(STOP_SIGNALS)


@contextlib.contextmanager
def _signals_held(deferred: tuple[int, ...], blocked: bool = False) -> Iterator[None]:
    """Defers `deferred` (a handler that notes them: another thread of this process may be the one a
    signal reaches); `blocked` also blocks them in this thread, for the children it starts."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, deferred) if blocked else None
    if threading.current_thread() is not threading.main_thread():
        try:
            yield  # Python runs signal handlers in the main thread only: none can interrupt this one
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return
    arrived: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in deferred}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (one pending now reaches its own handler)
        for sig in arrived:
            signal.raise_signal(sig)  # (now to its own handler)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def exits_at_once(main: Callable[..., None]) -> Callable[..., None]:
    """Wraps a child process's entry point so that the process ends as soon as it returns (after its
    `finally` blocks). The exit code is multiprocessing's: the SystemExit code, 1 after an uncaught
    exception (printed)."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> None:
        code = 1
        try:
            main(*args, **kwargs)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:  # noqa: BLE001 - reported as multiprocessing would, then the process ends
            traceback.print_exc()
        finally:
            exit_now(code)

    return run


def exit_now(code: int) -> NoReturn:
    """Ends this process once its logs and output are flushed, skipping the interpreter's teardown. A
    SIGTERM now (the launcher stopping a child that is already leaving, for instance after its start failed)
    is ignored: its handler's SystemExit would break into the flush with a second traceback."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


# ---- CPU threads of the LLM process and the encoder ranks beside it ------------------------------------


def rank_threads(settings: EncoderSettings) -> int:
    """CPU threads of one rank: `vit_threads`, or an equal share of the cores with the LLM process."""
    if settings.vit_threads is not None:
        return settings.vit_threads
    return max(1, len(os.sched_getaffinity(0)) // (settings.vit_dp + 1))


def llm_threads(settings: EncoderSettings) -> int:
    """CPU threads left to the LLM process next to the pool's ranks (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) - settings.vit_dp * rank_threads(settings))
