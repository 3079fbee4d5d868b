"""Structured output: grammars compiled by xgrammar against the model's vocabulary.

A request that asks for a JSON schema, a regex or an EBNF grammar waits in the scheduler's
`grammar_queue` while `GrammarBackend.compile` runs on a worker thread; compiled grammars are kept, keyed by
(kind, source), so the next request with the same schema starts at once. Each request (each choice) then
gets its own `GrammarMatcher`, which the sampler uses every step: it masks the tokens the grammar does not
allow before sampling, and is advanced by the sampled token after it (`apply_grammar_masks`,
`accept_grammar_tokens`). Both run on the forward side, in launch order, so under the overlap loop the
matcher has always seen the token the batch before sampled. In a speculative verify batch a request has a
row per position: each is masked as the grammar stands after the drafts before it, and the grammar is
advanced by the tokens kept only.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

    from vlm_serve.tokenizer import Tokenizer

# xgrammar is imported where it is first needed: it imports transformers, a second per server process
# that never sees a grammar.

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind: "json_schema" | "regex" | "ebnf", source)
MAX_CACHED_GRAMMARS = 512


class GrammarError(ValueError):
    """A grammar that cannot be compiled (names the field and xgrammar's reason)."""


class GrammarBackend:
    """Compiles grammars on one worker thread, each distinct (kind, source) once."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.think_end_id = tokenizer.token_to_id("</think>")
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache: OrderedDict[GrammarKey, Future[xgr.CompiledGrammar]] = OrderedDict()

    def compile(self, key: GrammarKey) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `key`, now or later (a failure raises GrammarError from `result()`).
        Failures are kept too: compiling the same source again would fail the same way."""
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
            return future
        future = self.executor.submit(self._compile, key)
        self.cache[key] = future
        while len(self.cache) > MAX_CACHED_GRAMMARS:
            self.cache.popitem(last=False)
        return future

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, source = key
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(source, any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "ebnf":
                return self.compiler.compile_grammar(source)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
            raise GrammarError(f"invalid {kind}: {_reason(exc)}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar, after_reasoning: bool = False) -> Grammar:
        """A request's own matcher; with `after_reasoning`, it starts after the `</think>` token."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        if after_reasoning and self.think_end_id is not None:
            return ReasoningGrammar(matcher, self.think_end_id)
        return matcher

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class ReasoningGrammar:
    """A grammar that applies after the answer's reasoning (`--reasoning-parser`): every token is allowed
    until the model writes the end-of-reasoning token (`</think>`), then the grammar takes over. It has
    the matcher's interface, as far as the sampler uses it."""

    def __init__(self, matcher: xgr.GrammarMatcher, think_end_id: int) -> None:
        self.matcher = matcher
        self.think_end_id = think_end_id
        self.thinking = True
        self.steps = 0  # tokens accepted
        self.grammar_from = 0  # the step at which the grammar took over (while not thinking)

    def is_terminated(self) -> bool:
        return not self.thinking and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.thinking:
            bitmask[index] = -1  # every bit set: every token allowed
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        if self.thinking:
            self.thinking = token_id != self.think_end_id
            self.steps += 1
            self.grammar_from = self.steps
            return True
        accepted = self.matcher.accept_token(token_id)
        self.steps += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last `num_tokens` accepted (the reasoning's end among them, if it is)."""
        if not self.thinking:
            self.matcher.rollback(min(num_tokens, self.steps - self.grammar_from))
            self.thinking = self.steps - num_tokens < self.grammar_from
        self.steps -= num_tokens


if TYPE_CHECKING:
    Grammar = xgr.GrammarMatcher | ReasoningGrammar  # what a request's `grammar` is


def grammar_key(json_schema: str | None, regex: str | None, ebnf: str | None) -> GrammarKey | None:
    """The grammar a request's settings ask for (at most one may be set; SamplingParams checks that)."""
    for kind, source in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf)):
        if source is not None:
            return kind, source
    return None


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: every token's encoded string by id, over the model's (padded)
    vocabulary size, and how the strings encode bytes (read from the tokenizer's own decoder, as
    `TokenizerInfo.from_huggingface` does)."""
    import xgrammar as xgr

    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            vocab[token_id] = token
    decoder = json.loads(tokenizer.backend_json()).get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "ByteFallback" in types:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    add_prefix_space = any(d.get("type") == "Strip" and d.get("start") for d in decoders)
    return xgr.TokenizerInfo(
        vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids), add_prefix_space=add_prefix_space
    )


class GrammarRow(Protocol):
    """What the grammar functions read of a sampler row."""

    grammar: Grammar | None
    draft: int | None  # a verify batch's row: the draft token at its position (None after the last)


def apply_grammar_masks(logits: torch.Tensor, rows: Sequence[GrammarRow]) -> None:
    """Sets to -inf the logits of tokens each row's grammar does not allow next. Rows without one are
    left alone, as are rows whose grammar has ended: under overlap a request can be in the batch after
    the one that sampled its last token, and that row's token is thrown away. A verify batch's rows of
    one request are masked as its grammar stands after the drafts before each (accepted, then rolled
    back); the rows after a draft it refuses are left alone: their tokens are thrown away, and the
    refused draft is masked out at its own row, so verification stops there."""
    masked = [i for i, r in enumerate(rows) if r.grammar is not None and not r.grammar.is_terminated()]
    if not masked:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # (every token allowed)
    walked, ahead, lost = None, 0, False  # a request's grammar, drafts it accepted, whether one was refused
    for i in masked:
        grammar, draft = rows[i].grammar, rows[i].draft
        if grammar is not walked:
            if ahead:
                walked.rollback(ahead)
            walked, ahead, lost = grammar, 0, False
        if lost or grammar.is_terminated():
            continue
        grammar.fill_next_token_bitmask(bitmask, i)
        if draft is not None:
            lost = not grammar.accept_token(draft)
            ahead += not lost
    if ahead:
        walked.rollback(ahead)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=masked)


def accept_grammar_tokens(next_token_ids: torch.Tensor, rows: Sequence[GrammarRow]) -> dict[int, str]:
    """Advances each row's grammar by the token sampled for it; in a verify batch, by the tokens kept
    only (`kept_rows`). Returns the rows whose grammar raised, with why (the others are advanced)."""
    failures: dict[int, str] = {}
    if not any(r.grammar is not None for r in rows):
        return failures
    tokens = next_token_ids.tolist()
    for i, (row, token, kept) in enumerate(zip(rows, tokens, kept_rows(rows, tokens))):
        if row.grammar is None or row.grammar.is_terminated() or not kept:
            continue
        try:
            if not row.grammar.accept_token(token):
                logger.warning("grammar rejected token %d it had allowed", token)
        except Exception as exc:  # noqa: BLE001 - this row's request fails; the batch goes on
            failures[i] = f"its grammar failed: {type(exc).__name__}: {exc}"
    return failures


def kept_rows(rows: Sequence[GrammarRow], tokens: Sequence[int]) -> list[bool]:
    """Whether each row's token is one its answer keeps: in a verify batch, a row after a draft's row
    whose token differs from the draft (or that was not kept itself) is not."""
    kept, rejected = [], False
    for row, token in zip(rows, tokens):
        kept.append(not rejected)
        rejected = row.draft is not None and (rejected or token != row.draft)
    return kept


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/file.cc:83: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(exc).split()))
    return text[:500] or type(exc).__name__
