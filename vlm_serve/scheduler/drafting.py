"""Speculative decoding as the scheduler decides it: which decode steps carry drafts, and which drafts.

N-gram drafts are proposed here from each request's own tokens. EAGLE-3 drafts are only counted here: its
worker drafts them when the verify forward runs (`Eagle3Worker.chain`), from the draft state each request
keeps between steps. A request whose drafts all fail pauses drafting, longer each time (1, 2, 4 ...
`MAX_DRAFT_PAUSE` steps) until one is kept; after a partial success its next drafts are one longer than
those kept.
"""

from __future__ import annotations

from vlm_serve.config import SpeculativeSettings
from vlm_serve.llm.forward_batch import ForwardMode
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.speculative.draft_state import DraftState
from vlm_serve.llm.speculative.eagle3_worker import Eagle3Worker
from vlm_serve.llm.speculative.ngram import NgramProposer
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch

MAX_DRAFT_PAUSE = 16  # decode steps a request goes without drafts at most, after failed ones


class Drafting:
    """The drafts of each decode step (`--speculative-algorithm`): `ngram` proposes them, `eagle` (the
    EAGLE-3 worker) drafts them at forward time; neither without speculation."""

    def __init__(self, settings: SpeculativeSettings, runner: ModelRunner) -> None:
        self.num_draft_tokens = settings.speculative_num_draft_tokens
        self.disable_by_batch_size = settings.speculative_disable_by_batch_size
        self.context_len = runner.context_len
        self.ngram: NgramProposer | None = None
        self.eagle: Eagle3Worker | None = None
        if settings.speculative_algorithm == "ngram":
            self.ngram = NgramProposer(
                settings.speculative_num_draft_tokens,
                settings.speculative_ngram_min_match_window_size,
                settings.speculative_ngram_max_match_window_size,
                runner.model_config.text.vocab_size,
            )
        elif settings.speculative_algorithm == "eagle3":
            self.eagle = Eagle3Worker(runner)

    def enabled(self, decode_batch_size: int) -> bool:
        """Whether a decode step of this many requests drafts (`speculative_disable_by_batch_size`)."""
        return (self.ngram is not None or self.eagle is not None) and (
            self.disable_by_batch_size is None or decode_batch_size <= self.disable_by_batch_size
        )

    def skips(self, batch: ScheduleBatch) -> bool:
        """Whether the EAGLE-3 draft skips a batch: a decode step too large to draft (its requests draft no
        more: `draft_gap`), or one of requests that draft no more."""
        return batch.forward_mode == ForwardMode.DECODE and (
            not self.enabled(len(batch.reqs)) or all(r.draft_gap for r in batch.reqs)
        )

    def drafts(self, decoding: list[Req]) -> list[list[int]]:
        """Each request's drafts for this step (EAGLE-3: placeholders, as many as it gets)."""
        if self.ngram is not None:
            return [self._ngram_drafts(r) for r in decoding]
        return [[0] * self.room(r) if r.draft_state is not None else [] for r in decoding]

    def room(self, req: Req) -> int:
        """How many drafts the request can take: as many as its answer and context still have room for."""
        room = (
            min(req.sampling_params.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len) - 1
        )  # (the step's own token comes on top of the drafts)
        return max(min(room, self.num_draft_tokens), 0)

    def _ngram_drafts(self, req: Req) -> list[int]:
        """The request's n-gram drafts for this step: at most one more than it kept last time."""
        if req.draft_pause > 0:
            req.draft_pause -= 1
            return []
        room = self.room(req)
        if req.draft_limit is not None:
            room = min(room, req.draft_limit)
        return self.ngram.propose(req.fill_ids)[:room]

    @staticmethod
    def verified(req: Req, kept: int) -> None:
        """After a verify step that kept `kept` tokens (the step's own and the drafts it kept): drafts that
        all failed cost a wider forward for nothing, so the request pauses drafting; the next drafts are
        one longer than those kept."""
        req.draft_backoff = 0 if kept > 1 else min(max(2 * req.draft_backoff, 1), MAX_DRAFT_PAUSE)
        req.draft_pause = req.draft_backoff
        req.draft_limit = kept

    def drafted(self, reqs: list[Req], keep_aux: bool, states: list[DraftState] | None) -> None:
        """After a batch: each request's EAGLE-3 draft state (a step without the draft leaves them none)."""
        if self.eagle is None:
            return
        for i, req in enumerate(reqs):
            if not keep_aux:  # (a step without drafts costs no draft forward either)
                req.draft_state, req.draft_gap = None, True
            else:
                req.draft_state = None if req.draft_gap else states[i]
