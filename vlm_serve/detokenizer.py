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
