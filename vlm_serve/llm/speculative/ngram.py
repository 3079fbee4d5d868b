"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of a request's
last few tokens, in its own prompt and output. No model: it pays off where answers copy from the prompt
(OCR, extraction, editing, JSON with repeated keys)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `num_draft_tokens` tokens: the longest suffix of the sequence, from
    `max_match_window` tokens down to `min_match_window`, that occurred earlier in it, and what followed
    its latest earlier occurrence. Ids of `vocab_size` or more (image and video pads) are never matched
    against nor proposed. (Its settings are checked where they are given, in `ServerArgs`.)"""

    num_draft_tokens: int
    min_match_window: int = 1
    max_match_window: int = 3
    vocab_size: int | None = None

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """The draft for the token after `token_ids` (prompt then output); [] where no window matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # every earlier position holding the last token ends a match; how far back each match runs is
        # counted a token at a time (a few vector compares, not one per window and position)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        matched = np.ones(len(ends), dtype=np.int64)
        running = np.ones(len(ends), dtype=bool)
        for k in range(1, min(self.max_match_window, last)):
            running &= ends >= k
            running[running] = tokens[ends[running] - k] == tokens[last - k]
            matched += running
        pads = np.flatnonzero(tokens >= self.vocab_size) if self.vocab_size is not None else np.empty(0, np.int64)
        pad_free = last - pads[-1] if pads.size else len(tokens)  # the longest suffix without a pad
        for n in range(min(self.max_match_window, last, pad_free), self.min_match_window - 1, -1):
            hits = ends[matched >= n]
            if not hits.size:
                continue
            draft = tokens[hits[-1] + 1 : hits[-1] + 1 + self.num_draft_tokens]
            if self.vocab_size is not None:
                stop = np.flatnonzero(draft >= self.vocab_size)
                draft = draft[: stop[0]] if stop.size else draft
            if draft.size:
                return draft.tolist()
        return []
