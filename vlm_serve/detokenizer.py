"""Incremental detokenization and stop-string search, shared by the scheduler and the streaming API."""

from __future__ import annotations

import re
from collections import deque

from vlm_serve.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces.

    Only the ids not yet turned into text are decoded each time. A piece that ends in an incomplete
    UTF-8 character (decoded as U+FFFD) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.read_offset = 0  # ids before this are in `text`
        self.text = ""

    def update(self, ids: list[int]) -> str:
        """`ids` is every id so far; returns the text they add (possibly empty)."""
        piece = self.tokenizer.decode(ids[self.read_offset :])
        if not piece or piece.endswith("\ufffd"):
            return ""
        self.read_offset = len(ids)
        self.text += piece
        return piece

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is left, incomplete characters included."""
        piece = self.tokenizer.decode(ids[self.read_offset :])
        self.read_offset = len(ids)
        self.text += piece
        return piece


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last `new_chars` characters of `text`, as
    (start index, stop string); earlier text was already searched."""
    best = None
    for stop in stops:
        pos = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


# how far before an answer's new text a stop_regex match may start: a longer match is not seen
STOP_REGEX_LOOKBACK = 1024


def find_stop_regex(text: str, patterns: list[str], new_chars: int) -> str | None:
    """The first of `patterns` (regular expressions) that the last `new_chars` characters of `text`
    give a match it did not have without them: a match ending in them, or one whose look-ahead needed
    them. A match may start up to STOP_REGEX_LOOKBACK characters before them; look-behinds, `^` and `\\b`
    still see the whole text."""
    old_end = len(text) - new_chars
    start = max(0, old_end - STOP_REGEX_LOOKBACK)
    for pattern in patterns:
        compiled = re.compile(pattern)  # (from `re`'s cache after the first time)
        pos = start
        while (found := compiled.search(text, pos)) is not None:
            before = compiled.match(text, found.start(), old_end)  # the text as it was without the new part
            if before is None or before.end() != found.end():
                return pattern
            pos = found.start() + 1
    return None


def final_text(tokenizer: Tokenizer, ids: list[int], matched: int | str | None, output_text: str | None) -> str:
    """The answer of a finished request: the text cut before its stop string, or its ids decoded
    without the stop token that ended it."""
    if output_text is not None:
        return output_text
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    return tokenizer.decode(ids)


class TextStream:
    """The text of one growing answer, handed out in pieces that are never taken back: the last
    `holdback` characters wait while a stop string could still be forming in them, and an incomplete
    UTF-8 character waits for the token that completes it.

    Each piece comes with the number of tokens whose text it completes, so that whatever belongs to
    a token (its id, its logprobs) is handed out with the text of that token, never before it.
    """

    def __init__(self, tokenizer: Tokenizer, holdback: int) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.holdback = holdback
        self.sent = ""
        self.released = 0  # tokens whose whole text is in `sent`
        self._ends: deque[tuple[int, int]] = deque()  # (tokens decoded, text length) not yet released

    def update(self, ids: list[int]) -> tuple[str, int]:
        """`ids` is every id so far; returns the text that can be sent now and the number of tokens
        (following those already released) whose text it completes."""
        if self.detokenizer.update(ids):
            self._ends.append((self.detokenizer.read_offset, len(self.detokenizer.text)))
        text = self.detokenizer.text
        piece = self._advance(text[: max(len(text) - self.holdback, len(self.sent))])
        released = self.released
        while self._ends and self._ends[0][1] <= len(self.sent):
            self.released = self._ends.popleft()[0]
        return piece, self.released - released

    def finish(self, ids: list[int], matched: int | str | None, output_text: str | None) -> tuple[str, int]:
        """The rest of the answer once the request has finished, and the number of tokens not yet
        released (all the rest)."""
        piece = self._advance(final_text(self.detokenizer.tokenizer, ids, matched, output_text))
        released, self.released = self.released, len(ids)
        self._ends.clear()
        return piece, self.released - released

    def _advance(self, text: str) -> str:
        piece, self.sent = text[len(self.sent) :], text
        return piece


def stop_holdback(stops: list[str]) -> int:
    """Characters of streamed text to hold back so a stop string never has to be taken back."""
    return max((len(s) for s in stops), default=1) - 1
