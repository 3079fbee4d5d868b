"""Turns the last-token logits of a batch into next token ids."""

from __future__ import annotations

import torch

from vlm_serve.sampling_params import SamplingParams


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits: (batch, vocab) float. Greedy rows take the argmax; the others sample after
        temperature, top-k, top-p and min-p, each row with its own generator when it has a seed."""
        next_ids = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)
            probs = filter_probs(probs, p.top_k, p.top_p, p.min_p)
            if generators[i] is not None:  # seeded: sample on the CPU generator, reproducible anywhere
                probs = probs.cpu()
            next_ids[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
        return next_ids


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zeroes what top-k, top-p and min-p exclude from one row of probabilities (not renormalised)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # keep a token while the mass before it is below top_p (the top token always stays)
        keep &= (sorted_probs.cumsum(0) - sorted_probs) < top_p
    if min_p > 0.0:
        keep &= sorted_probs >= min_p * sorted_probs[0]
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered
