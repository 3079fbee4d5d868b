"""Speculative decoding's parts: n-gram drafts are what followed the latest earlier occurrence of the
sequence's longest matching suffix; verification keeps exactly what the target would produce: greedy
drafts up to the first the target disagrees with, sampled ones by rejection sampling, whose emitted
tokens are distributed as the target's (a fixed-seed statistical test, with a bound that a sampler that
keeps drafts too readily fails)."""

from __future__ import annotations

import pytest
import torch

from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.llm.speculative.ngram import NgramProposer
from vlm_serve.llm.speculative.rejection import rejection_sample, verify_greedy
from vlm_serve.testing.media import make_image


@pytest.mark.parametrize(
    "tokens,draft",
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 1]),  # the longest window (3) that recurs
        ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], [7, 1, 2]),  # its latest earlier occurrence
        ([8, 2, 3, 6, 7, 2, 3], [6, 7, 2]),  # a window of 2 where 3 does not recur
        ([5, 6, 7], []),  # nothing recurs
        ([4, 9, 9, 4], [9, 9, 4]),  # the draft runs into the suffix itself
        ([2, 2], [2]),  # the last token after an earlier copy of itself
        ([7], []),
    ],
)
def test_ngram_drafts_continue_the_latest_earlier_occurrence_of_the_longest_suffix(tokens, draft):
    assert NgramProposer(num_draft_tokens=3).propose(tokens) == draft


def test_ngram_drafts_stop_at_image_pads_and_never_match_them():
    vocab = 100
    proposer = NgramProposer(num_draft_tokens=4, vocab_size=vocab)
    assert proposer.propose([1, 2, 7, 500, 500, 3, 1, 2]) == [7]  # (the pads after 7 are not proposed)
    assert proposer.propose([500, 500, 4, 500]) == []  # (a pad at the end is no window)
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1, 2]


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement_then_the_targets_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [4, 6, 7]) == [5]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, and the bonus token
    assert verify_greedy([5], []) == [5]


VOCAB, DRAFTS, TRIALS = 6, 3, 20000
# chi-square with VOCAB - 1 = 5 degrees of freedom; 25 is exceeded with probability 1.4e-4 by a right
# sampler (the test is deterministic: fixed seeds)
CHI2_BOUND = 25.0


def chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples, dtype=torch.int64), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target (DRAFTS + 1, VOCAB) and draft (DRAFTS, VOCAB) distributions, different at every position."""
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(DRAFTS + 1, VOCAB, generator=g), -1)
    draft = torch.softmax(2 * torch.randn(DRAFTS, VOCAB, generator=g), -1)
    return target, draft


def emitted(sampler, target: torch.Tensor, draft: torch.Tensor | None, seed: int) -> list[list[int]]:
    """`TRIALS` verifications: drafts drawn from `draft` (None: the fixed drafts 0, 1, 2, as n-gram's)."""
    g = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(TRIALS):
        if draft is None:
            runs.append(sampler(target, list(range(DRAFTS)), None, g))
        else:
            ids = torch.multinomial(draft, 1, generator=g).squeeze(1).tolist()
            runs.append(sampler(target, ids, draft, g))
    return runs


def worst_position_chi2(runs: list[list[int]], target: torch.Tensor) -> float:
    """The largest chi-square over positions i of the i-th emitted token against target[i], among the
    runs that reached position i with the same tokens as their drafts before it (what the target's
    distribution at i is conditioned on)."""
    worst = 0.0
    for i in range(DRAFTS + 1):
        reached = [run[i] for run in runs if len(run) > i]
        if len(reached) >= 500:
            worst = max(worst, chi2(reached, target[i]))
    return worst


@pytest.mark.parametrize("drafted", ["n-gram", "draft model"])
def test_rejection_sampling_emits_the_targets_distribution_at_every_position(drafted):
    target, draft = distributions(seed=1)
    draft = None if drafted == "n-gram" else draft
    runs = emitted(rejection_sample, target, draft, seed=2)
    assert worst_position_chi2(runs, target) < CHI2_BOUND
    # drafts are kept as often as the theory says: draft i with probability p_i(x_i) (a fixed draft) or
    # sum(min(p_i, q_i)) (drawn from q), given the ones before it were
    keep = [float(target[i, i]) if draft is None else float(torch.minimum(target[i], draft[i]).sum()) for i in range(DRAFTS)]
    expected = sum(torch.tensor(keep[:m]).prod().item() for m in range(1, DRAFTS + 1))
    assert abs(sum(len(run) - 1 for run in runs) / TRIALS - expected) < 0.03 * max(expected, 0.1)


def test_the_bound_fails_a_sampler_that_keeps_drafts_without_checking_them():
    def keep_every_draft(target, ids, draft, g):
        return ids + [int(torch.multinomial(target[len(ids)], 1, generator=g))]

    target, draft = distributions(seed=1)
    assert worst_position_chi2(emitted(keep_every_draft, target, draft, seed=2), target) > CHI2_BOUND


# ---- in the scheduler -----------------------------------------------------------------------------

COPY = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


def conversations() -> list[list[dict]]:
    image = make_image(96, 64, seed=3)
    return [
        [{"role": "user", "content": COPY}],
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": COPY}]}],
        [{"role": "user", "content": "Count: one two three one two three one two"}],
    ]


def answers(engine: Engine) -> list[list[int]]:
    inputs = [engine.processor.process_messages(c) for c in conversations()]
    greedy = engine.generate_processed(inputs, max_tokens=40, temperature=0, ignore_eos=True)
    # a sampled request beside them gets no drafts, and draws what it draws without them
    sampled = engine.generate_processed(inputs[:1] * 2, max_tokens=12, temperature=0.8, seed=5)
    return [out.token_ids for out in greedy + sampled]


@pytest.mark.parametrize("arch,page_size", [("dense", 1), ("dense", 4), ("moe", 1)])
def test_greedy_answers_with_ngram_drafts_are_those_without(arch, page_size, request):
    """Several requests at once (text, an image), on a copy-heavy prompt; the idle self-check after each
    batch of answers finds every KV slot free or in the prefix cache (rejected drafts' slots released)."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    with Engine(path, vit_dp=0, page_size=page_size) as plain:
        want = answers(plain)
    with Engine(path, vit_dp=0, page_size=page_size, speculative_algorithm="ngram") as speculative:
        assert answers(speculative) == want
        stats = speculative.scheduler.get_stats()  # (what /metrics reports)
        assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens


def test_drafts_never_run_past_max_tokens_or_a_stop_token(tiny_dense_dir):
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        full = plain.chat([{"role": "user", "content": COPY}], max_tokens=24, temperature=0).token_ids
    stop = full[9]
    with Engine(tiny_dense_dir, vit_dp=0, speculative_algorithm="ngram") as speculative:
        assert speculative.chat([{"role": "user", "content": COPY}], max_tokens=7, temperature=0).token_ids == full[:7]
        stopped = speculative.chat([{"role": "user", "content": COPY}], max_tokens=24, temperature=0, stop_token_ids=[stop])
        assert stopped.token_ids == full[: full.index(stop) + 1]


def test_speculative_settings_out_of_range_are_refused_by_name():
    with pytest.raises(ValueError, match="speculative_algorithm must be one of ngram"):
        ServerArgs(speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be >= 1"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_match_window_size .4. must not exceed"):
        ServerArgs(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2)


class WrongDrafts:
    """Proposes the last (padding) vocabulary row, which the tiny models never pick."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, token_ids: list[int]) -> list[int]:
        return [self.vocab_size - 1]


def test_a_request_whose_drafts_keep_failing_drafts_ever_less_often(tiny_dense_dir):
    """Rejected drafts cost a wider forward for nothing: after each failure the request goes 1, 2, 4 ...
    (at most 16) steps without drafts; its answer stays the plain one."""
    conversation = [{"role": "user", "content": COPY}]
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        want = plain.chat(conversation, max_tokens=40, temperature=0, ignore_eos=True).token_ids
    with Engine(tiny_dense_dir, vit_dp=0, speculative_algorithm="ngram") as speculative:
        speculative.scheduler.drafter = WrongDrafts(speculative.scheduler.vocab_size)
        assert speculative.chat(conversation, max_tokens=40, temperature=0, ignore_eos=True).token_ids == want
        metrics = speculative.scheduler.metrics
        # drafts at decode steps 0, 2, 5, 10, 19, 36 of the 39 (after the prefill's token)
        assert (metrics.spec_verified, metrics.spec_accepted) == (6, 0)
