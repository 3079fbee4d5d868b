"""Incremental detokenization and stop-string search, shared by the scheduler and the streaming API."""

from __future__ import annotations

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
    `holdback` characters wait while a stop string could still be forming in them."""

    def __init__(self, tokenizer: Tokenizer, holdback: int) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.holdback = holdback
        self.sent = ""

    def update(self, ids: list[int]) -> str:
        """`ids` is every id so far; returns the text that can be sent now."""
        self.detokenizer.update(ids)
        text = self.detokenizer.text
        return self._advance(text[: max(len(text) - self.holdback, len(self.sent))])

    def finish(self, ids: list[int], matched: int | str | None, output_text: str | None) -> str:
        """The rest of the answer once the request has finished."""
        return self._advance(final_text(self.detokenizer.tokenizer, ids, matched, output_text))

    def _advance(self, text: str) -> str:
        piece, self.sent = text[len(self.sent) :], text
        return piece


def stop_holdback(stops: list[str]) -> int:
    """Characters of streamed text to hold back so a stop string never has to be taken back."""
    return max((len(s) for s in stops), default=1) - 1
