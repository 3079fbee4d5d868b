"""Prompt log-probs as a request's answer carries them (vLLM's `prompt_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptLogprobs:
    """Log-probs of prompt tokens from the second on (nothing predicts the first): entry j is prompt
    token j + 1, as predicted by the logits at position j."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # 1 = the most likely token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # (token id, log-prob), best first

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, more: PromptLogprobs) -> None:
        self.token_ids += more.token_ids
        self.logprobs += more.logprobs
        self.ranks += more.ranks
        self.top_logprobs += more.top_logprobs
