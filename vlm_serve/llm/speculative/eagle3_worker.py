"""An EAGLE-3 draft head run beside the target model (`Eagle3Worker`).

After every target forward, `extend` runs the draft's layer over the same positions, with the same
attention metadata: each position reads the token after it and the target's hidden states there, so the
draft's KV (the paged pool's last layer, at the target's slots) follows every request through prefill
chunks, decode and verify steps. A request's output at its last kept position gives its first draft.
Before a verify forward, `chain` drafts the others one position at a time, each step reading the draft's
own output before it; their KV goes to the slots the verify forward has taken for those positions, and
the next `extend` overwrites it with what the target saw there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlm_serve.llm.forward_batch import ForwardBatch, ForwardMode
from vlm_serve.llm.speculative.draft_state import ChainRequest, DraftState

if TYPE_CHECKING:
    from vlm_serve.llm.model_runner import ModelRunner


class Eagle3Worker:
    """Runs the runner's EAGLE-3 draft (`ModelRunner.draft`) on its attention backend and KV pool."""

    def __init__(self, runner: ModelRunner) -> None:
        if runner.draft is None:
            raise ValueError("the model runner has no EAGLE-3 draft loaded")
        self.runner, self.draft = runner, runner.draft
        self.vocab_size = runner.model_config.text.vocab_size
        self.image_token_id = runner.model_config.image_token_id

    @torch.inference_mode()
    def extend(
        self, batch: ForwardBatch, next_ids: list[int], aux_hidden: torch.Tensor, last_rows: list[int]
    ) -> list[DraftState]:
        """The draft over the positions the target forward `batch` computed. `next_ids[row]` is the
        token after that row's position (anything past a request's last kept one: its KV is dropped);
        image and video pads read as the image token. Returns each request's state at `last_rows`."""
        device = batch.input_ids.device
        ids = torch.tensor(next_ids, dtype=torch.int64, device=device)
        ids = ids.masked_fill(ids >= self.vocab_size, self.image_token_id)
        self.runner.attn_backend.begin_forward(batch)
        normed, prenorm = self.draft(ids, aux_hidden, batch.positions, batch)
        rows = torch.tensor(last_rows, device=device)
        firsts = self.draft.draft_tokens(normed[rows]).tolist()
        return [DraftState(first, hidden) for first, hidden in zip(firsts, prenorm[rows])]

    def chain(self, reqs: list[ChainRequest]) -> list[list[int]]:
        """Each request's `count` drafts: its state's first, then one per step, the step at position
        start + j - 1 reading draft j's token and the draft's output for the step before. (A request
        getting none may have no state.)"""
        drafted = iter(self._chain([r for r in reqs if r.count]))
        return [next(drafted) if r.count else [] for r in reqs]

    @torch.inference_mode()
    def _chain(self, reqs: list[ChainRequest]) -> list[list[int]]:
        if not reqs:
            return []
        drafts = [[r.state.first] for r in reqs]
        hidden = torch.stack([r.state.hidden for r in reqs])
        req_to_token = self.runner.req_to_token_pool.req_to_token
        device = hidden.device
        for step in range(1, max((r.count for r in reqs), default=0)):
            active = [i for i, r in enumerate(reqs) if r.count > step]
            positions = [reqs[i].start + step - 1 for i in active]
            pool_idx = torch.tensor([reqs[i].req_pool_idx for i in active], device=device)
            seq_lens = [p + 1 for p in positions]
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                input_ids=torch.tensor([drafts[i][-1] for i in active], dtype=torch.int64, device=device),
                positions=torch.tensor(
                    [p + reqs[i].mrope_delta for i, p in zip(active, positions)], device=device
                ).expand(3, -1),
                req_pool_indices=pool_idx,
                seq_lens=torch.tensor(seq_lens, device=device),
                out_cache_loc=req_to_token[pool_idx, torch.tensor(positions, device=device)].long(),
                seq_lens_cpu=seq_lens,
                prefix_lens_cpu=positions,
                extend_lens_cpu=[1] * len(active),
            )
            self.runner.init_forward_metadata(batch)
            self.runner.attn_backend.begin_forward(batch)
            normed, prenorm = self.draft(batch.input_ids, hidden[active], batch.positions, batch)
            for i, token in zip(active, self.draft.draft_tokens(normed).tolist()):
                drafts[i].append(token)
            hidden[active] = prenorm
        return drafts
