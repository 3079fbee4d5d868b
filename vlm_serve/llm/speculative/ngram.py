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
        for n in range(min(self.max_match_window, len(tokens) - 1), self.min_match_window - 1, -1):
            pattern = tokens[-n:]
            if self.vocab_size is not None and (pattern >= self.vocab_size).any():
                continue
            # windows that start before the suffix itself, and have a token after them
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                draft = tokens[start : start + self.num_draft_tokens]
                if self.vocab_size is not None:
                    pads = np.flatnonzero(draft >= self.vocab_size)
                    draft = draft[: pads[0]] if pads.size else draft
                if draft.size:
                    return draft.tolist()
        return []
