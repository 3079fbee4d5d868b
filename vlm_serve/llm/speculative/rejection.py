"""Verifying draft tokens against the target model's distributions, keeping exactly what the target
would produce: greedy drafts are kept while they equal the target's argmax; sampled ones by rejection
sampling (Leviathan et al. 2023; Chen et al. 2023), which leaves each emitted token distributed as the
target's."""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """The tokens to emit, given the target's choice at each of the k + 1 verified positions (after the
    last accepted token, then after each draft): the drafts up to the first that differs from the
    target's choice, then the target's own token there (or after the last draft, the bonus token)."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return target_ids[: n + 1]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens to emit for one request: `target_probs` (k + 1, vocab) are the target's sampling
    distributions at each verified position (after temperature and filters), `draft_probs` (k, vocab)
    the draft's, from which draft_ids were drawn; None for a deterministic draft (n-gram: all its
    mass on the draft token). Draft i is kept with probability min(1, p(x) / q(x)); the first one
    rejected is replaced by a draw from the residual max(p - q, 0), normalized; when all are kept, a
    bonus token is drawn from the last position."""
    k = len(draft_ids)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    out: list[int] = []
    for i, token in enumerate(draft_ids):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_token > 0 and uniforms[i] * q_token < float(p[token]):  # u < p / q
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - draft_probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # (p equal to q: nothing is left to draw; p itself is the answer)
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
