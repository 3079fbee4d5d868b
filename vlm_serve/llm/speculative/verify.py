"""Verifying draft tokens, keeping exactly what the target would produce.

A verify forward computes the logits after the request's last token and after each of its k drafts; the
sampler then samples each of these k + 1 positions as a plain decode step would, as if the drafts before
it were kept (the same penalties, min_new_tokens, grammar mask, temperature, filters and seeded draw). The
drafts are kept while each equals the token sampled at its position; the first that differs is replaced
by that token, and when all are kept the token sampled after the last one comes on top.

Greedy, that is the target's own choice at every position. Sampled, it is rejection sampling for a
deterministic draft (n-gram; a draft model's argmax): draft x is kept with probability p(x), and a
rejected one is replaced by a draw from p given that it is not x, so every emitted token is distributed
as the target's (Leviathan et al. 2023). A seeded request draws each position on the generator of its seed
and that position (`sampler.draw_generator`), so its answer is the one without drafts, token for token.
"""

from __future__ import annotations


def verify_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens to emit, given the token sampled at each of the k + 1 verified positions: the drafts
    up to the first that differs from the sampled one, then the sampled token there (or after the last
    draft, the bonus token)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return sampled[: n + 1]
