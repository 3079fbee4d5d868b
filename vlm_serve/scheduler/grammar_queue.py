"""`grammar_queue`: structured-output requests waiting while their grammar compiles.

A grammar compiles on the grammar backend's thread (xgrammar), so a request with `json_schema`, `regex` or
`ebnf` waits here, not in `waiting_queue`, and the scheduler goes on with the others. When its grammar is
ready it gets a matcher of its own and goes on; an invalid grammar fails it as its own fault (400); one
not compiled by the deadline fails it as the server's (503) — the deadline includes waiting behind other
requests' grammars, and the compile goes on, so a retry finds it compiled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from vlm_serve.config import ModelConfig
from vlm_serve.llm.constrained.grammar_backend import GrammarBackend, GrammarError, grammar_key
from vlm_serve.llm.distributed import ParallelState
from vlm_serve.scheduler.schedule_batch import FinishReason, Req, request_failure
from vlm_serve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

WAIT_SECONDS = 0.01  # with nothing else to do, wait this long for a grammar per iteration


@dataclass
class PendingGrammar:
    """A request in `grammar_queue`: its grammar is compiling on the grammar backend's thread."""

    req: Req
    compiled: Future[CompiledGrammar]
    deadline: float  # time.monotonic() after which it is refused


class GrammarQueue:
    """The requests whose grammar compiles, in arrival order. With TP, rank 0 decides which are done (and
    which timed out) and every rank takes its own compiled grammar, waiting for it if needed."""

    def __init__(
        self, tokenizer: Tokenizer, model_config: ModelConfig, timeout: float, parallel: ParallelState
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, model_config.text.vocab_size
        self.eos_token_ids = sorted(set(model_config.eos_token_ids))
        self.timeout = timeout  # --grammar-compile-timeout
        self.tp_rank, self.tp_size, self.tp_cpu_group = parallel.tp_rank, parallel.tp_size, parallel.tp_cpu_group
        self._backend: GrammarBackend | None = None  # made for the first structured-output request
        self.pending: list[PendingGrammar] = []

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    def __len__(self) -> int:
        return len(self.pending)

    def __iter__(self) -> Iterator[PendingGrammar]:
        return iter(self.pending)

    def add(self, req: Req) -> bool:
        """Queues `req` if it asks for structured output (its grammar starts compiling); False if not."""
        params = req.sampling_params
        key = grammar_key(params.json_schema, params.regex, params.ebnf)
        if key is None:
            return False
        self.pending.append(PendingGrammar(req, self.backend.compile(key), time.monotonic() + self.timeout))
        return True

    def __contains__(self, req: Req) -> bool:
        return any(p.req is req for p in self.pending)

    def remove(self, req: Req) -> None:
        self.pending = [p for p in self.pending if p.req is not req]

    def poll(self, wait_a_while: bool) -> list[tuple[Req, FinishReason | None]]:
        """The requests done compiling, each with None (its matcher set: it goes on) or why it fails; with
        `wait_a_while` (nothing else to do), rank 0 first waits a little for one. The same on every rank."""
        done: list[tuple[str, FinishReason | None]] = []
        if self.tp_rank == 0:
            if wait_a_while:
                wait([p.compiled for p in self.pending], WAIT_SECONDS, FIRST_COMPLETED)
            now = time.monotonic()
            for p in self.pending:
                if p.compiled.done():
                    done.append((p.req.rid, None))
                elif now > p.deadline:
                    message = f"the grammar did not compile within {self.timeout:g} s (--grammar-compile-timeout)"
                    done.append((p.req.rid, FinishReason.error(503, "grammar_timeout", message)))
        if self.tp_size > 1:
            box = [done]
            dist.broadcast_object_list(box, src=0, group=self.tp_cpu_group)
            done = box[0]
        pending = {p.req.rid: p for p in self.pending}
        results = []
        for rid, failure in done:
            p = pending.pop(rid)
            if failure is None:
                try:
                    p.req.grammar = self.backend.matcher(p.compiled.result(), p.req.sampling_params.reasoning)
                except GrammarError as exc:
                    failure = FinishReason.error(400, "invalid_grammar", str(exc))
                except Exception as exc:  # noqa: BLE001 - its own failure: it ends, the others go on
                    failure = request_failure(p.req, "while its grammar was made", exc)
            results.append((p.req, failure))
        self.pending = list(pending.values())
        return results

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()
