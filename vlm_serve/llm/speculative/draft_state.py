"""What a request carries between EAGLE-3 drafting steps, as the scheduler's requests and the forward batch
hold it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftState:
    """Where a request's drafting resumes: the draft's token after its last kept position, and the
    draft's pre-norm output there (the next step's hidden state)."""

    first: int
    hidden: torch.Tensor  # (hidden_size,)


@dataclass
class ChainRequest:
    """What `Eagle3Worker.chain` reads of a request: its drafting state, its row of `req_to_token`, the position of
    its last token (the verify forward's first) and the MRoPE delta of its outputs."""

    state: DraftState
    req_pool_idx: int
    start: int
    mrope_delta: int
    count: int  # drafts it gets
