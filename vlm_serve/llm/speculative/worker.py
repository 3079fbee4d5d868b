"""The forward side of speculative decoding: a launched batch's EAGLE-3 drafts, its verification and the
draft's extend over the positions kept, run in launch order around the target's forward (on the forward
thread under the overlap loop). The scheduler reads what each request kept from the result alone, so the
next batch is launched as soon as this one's accepted tokens are known, and the host's work on its output
(finish checks, streaming, detokenization) runs while the next one computes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlm_serve.llm.forward_batch import SAMPLED, ForwardBatch, ForwardOutput
from vlm_serve.llm.layers.sampler import set_drafts
from vlm_serve.llm.speculative.draft_state import DraftState
from vlm_serve.llm.speculative.eagle3_worker import Eagle3Worker
from vlm_serve.llm.speculative.verify import verify_drafts

if TYPE_CHECKING:
    from vlm_serve.llm.model_runner import ModelRunner


class SpeculativeWorker:
    """`forward_batch_generation` for a server that drafts (n-gram drafts come with the batch; an EAGLE-3
    draft's are made here)."""

    def __init__(self, runner: ModelRunner, eagle: Eagle3Worker | None) -> None:
        self.runner, self.eagle = runner, eagle

    def forward_batch_generation(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.chain is not None:
            self._draft(batch)
        out = self.runner.forward_batch_generation(batch)
        if batch.draft_ids is not None:
            tokens = out.sample.next_token_ids.tolist()
            out.accepted = [
                verify_drafts(tokens[rows.start : rows.stop], drafts)
                for rows, drafts in zip(batch.sample_groups(), batch.draft_ids)
            ]
        if self.eagle is not None and batch.keep_aux:
            out.draft_states = self._extend(batch, out)
        out.aux_hidden = None  # (read: its memory goes)
        return out

    def _draft(self, batch: ForwardBatch) -> None:
        """The EAGLE-3 drafts of a verify batch, into its input ids and its sampler's rows."""
        drafts = self.eagle.chain(batch.chain)
        rows, values = [], []
        for group, request_drafts in zip(batch.sample_groups(), drafts):
            set_drafts(batch.sampling[group.start : group.stop], request_drafts)
            rows += range(group.start + 1, group.start + 1 + len(request_drafts))
            values += request_drafts
        if rows:
            device = batch.input_ids.device
            batch.input_ids[torch.tensor(rows, device=device)] = torch.tensor(values, dtype=torch.int64, device=device)
        batch.draft_ids = drafts

    def _extend(self, batch: ForwardBatch, out: ForwardOutput) -> list[DraftState]:
        """The draft over the positions the target computed, each reading the token after it: the next
        known one or the token sampled (a verify batch: the tokens kept, up to the last kept position,
        where each request's drafting resumes)."""
        sampled = out.sample.next_token_ids.tolist()
        next_ids, last_rows, row = [], [], 0
        for i, (group, n) in enumerate(zip(batch.sample_groups(), batch.extend_lens_cpu)):
            if out.accepted is not None:
                kept = out.accepted[i]
                next_ids += kept + [0] * (n - len(kept))  # (past the kept positions: dropped)
                last_rows.append(row + len(kept) - 1)
            else:
                next_ids += [sampled[group.start] if t == SAMPLED else t for t in batch.draft_next_ids[row : row + n]]
                last_rows.append(row + n - 1)
            row += n
        return self.eagle.extend(batch, next_ids, out.aux_hidden, last_rows)
