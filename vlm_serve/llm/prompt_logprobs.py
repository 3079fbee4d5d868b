"""Prompt log-probs (vLLM's `prompt_logprobs`): how likely the model found each prompt token, from the
logits of the position before it.

A request that asks for them computes its whole prompt (no prefix from the RadixCache: a cached
position has no logits) and may do so over several chunked-prefill forwards; each forward gives back
the log-probs of the positions it computed, and the scheduler joins them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlm_serve.messages.logprobs import PromptLogprobs

# Vocabulary-wide logits of this many rows at most are held at once (a long prompt's would not fit).
BLOCK_ROWS = 1024


@dataclass
class PromptLogprobSpan:
    """One request's prompt positions in a forward: rows `first_row ...` of the flattened batch predict
    `target_ids`, each with its `top` best alternatives."""

    index: int  # the request's row in the batch
    first_row: int
    target_ids: list[int]
    top: int


def compute_prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    spans: list[PromptLogprobSpan],
    batch_size: int,
) -> list[PromptLogprobs | None]:
    """Per request of the batch, the log-probs of its span (None without one): log_softmax of the
    logits `logits_of` gives for the span's rows of `hidden`, the final hidden states of every new token."""
    out: list[PromptLogprobs | None] = [None] * batch_size
    if not spans:
        return out
    device = hidden.device
    rows = torch.cat([torch.arange(s.first_row, s.first_row + len(s.target_ids)) for s in spans]).to(device)
    targets = torch.tensor([t for s in spans for t in s.target_ids], dtype=torch.int64, device=device)
    k = max(s.top for s in spans)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for lo in range(0, len(rows), BLOCK_ROWS):
        logprobs = torch.log_softmax(logits_of(hidden[rows[lo : lo + BLOCK_ROWS]]), dim=-1)
        token = logprobs.gather(1, targets[lo : lo + BLOCK_ROWS, None])
        chosen.append(token.squeeze(1))
        ranks.append((logprobs >= token).sum(dim=1))  # vLLM's rank: ties count as better
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    chosen_list, rank_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    top_value_list = torch.cat(top_values).tolist() if k else [[]] * len(rows)
    top_id_list = torch.cat(top_ids).tolist() if k else [[]] * len(rows)
    start = 0
    for s in spans:
        end = start + len(s.target_ids)
        top = [list(zip(top_id_list[j][: s.top], top_value_list[j][: s.top])) for j in range(start, end)]
        out[s.index] = PromptLogprobs(list(s.target_ids), chosen_list[start:end], rank_list[start:end], top)
        start = end
    return out
