"""Speculative decoding: n-gram drafts are what followed the latest earlier occurrence of the sequence's
longest matching suffix; verification keeps exactly what the target would produce: the drafts up to the
first that differs from the token sampled at its position. Sampled, the emitted tokens are distributed as
the target's (a fixed-seed statistical test, with a bound that a verifier keeping drafts unchecked
fails); in the scheduler, every answer (greedy or seeded, with grammars, penalties, log-probs, stop
strings) is the one without drafts, token for token."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from eagle3_reference import draft_reference, fuse
from helpers import ReplayDrafts, running_server
from vlm_serve.builtin import BUILTIN_DRAFT, BUILTIN_MODEL
from vlm_serve.builtin.scenes import random_example, random_scene, render
from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.llm.forward_batch import ForwardMode
from vlm_serve.llm.layers.sampler import Sampler, SampleRow
from vlm_serve.llm.speculative.eagle3 import Eagle3Draft
from vlm_serve.llm.speculative.eagle3_worker import Eagle3Worker
from vlm_serve.llm.speculative.ngram import NgramProposer
from vlm_serve.llm.speculative.verify import verify_drafts
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.testing.media import make_image
from vlm_serve.tools.builtin_train import greedy_answer, messages


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


def test_verification_keeps_drafts_up_to_the_first_that_differs_then_the_sampled_token():
    assert verify_drafts([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_drafts([5, 6, 7, 8], [4, 6, 7]) == [5]
    assert verify_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, and the bonus token
    assert verify_drafts([5], []) == [5]


VOCAB, DRAFT, TRIALS = 6, [0, 1, 2], 20000
# chi-square with VOCAB - 1 = 5 degrees of freedom; 25 is exceeded with probability 1.4e-4 by a right
# sampler (the test is deterministic: fixed seeds)
CHI2_BOUND = 25.0


def chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples, dtype=torch.int64), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def target_logits(seed: int) -> torch.Tensor:
    """(len(DRAFT) + 1, VOCAB): a different distribution at every verified position."""
    return 2 * torch.randn(len(DRAFT) + 1, VOCAB, generator=torch.Generator().manual_seed(seed))


def verified(keep, logits: torch.Tensor, seeded: bool) -> list[list[int]]:
    """`TRIALS` requests verifying `DRAFT` at temperature 1, in one batch through the sampler (each with
    a seed of its own, or all on the global generator), and the tokens `keep` emits for each."""
    torch.manual_seed(0)
    seeds = range(TRIALS) if seeded else [None] * TRIALS
    rows = [
        SampleRow(SamplingParams(temperature=1.0, seed=seed), [], [], j, None, draft)
        for seed in seeds
        for j, draft in enumerate([*DRAFT, None])
    ]
    sampled = Sampler([])(logits.repeat(TRIALS, 1), rows).next_token_ids.view(TRIALS, -1).tolist()
    return [keep(tokens, DRAFT) for tokens in sampled]


def worst_position_chi2(runs: list[list[int]], probs: torch.Tensor) -> float:
    """The largest chi-square over positions i of the i-th emitted token against probs[i], among the
    runs that reached position i (their drafts before it were kept: what probs[i] is conditioned on)."""
    worst = 0.0
    for i in range(len(DRAFT) + 1):
        reached = [run[i] for run in runs if len(run) > i]
        if len(reached) >= 500:
            worst = max(worst, chi2(reached, probs[i]))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "seeded"])
def test_sampled_verification_emits_the_targets_distribution_at_every_position(seeded):
    logits = target_logits(seed=1)
    probs = torch.softmax(logits, dim=-1)
    runs = verified(verify_drafts, logits, seeded)
    assert worst_position_chi2(runs, probs) < CHI2_BOUND
    # draft i is kept with probability p_i(draft i), given the ones before it were
    keep = [float(probs[i, token]) for i, token in enumerate(DRAFT)]
    expected = sum(torch.tensor(keep[:m]).prod().item() for m in range(1, len(DRAFT) + 1))
    assert abs(sum(len(run) - 1 for run in runs) / TRIALS - expected) < 0.03 * max(expected, 0.1)


def test_the_bound_fails_a_verifier_that_keeps_drafts_without_checking_them():
    def keep_every_draft(sampled: list[int], drafts: list[int]) -> list[int]:
        return drafts + sampled[len(drafts) :]

    logits = target_logits(seed=1)
    assert worst_position_chi2(verified(keep_every_draft, logits, False), torch.softmax(logits, -1)) > CHI2_BOUND


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32),
    choices=st.lists(st.sampled_from(["best", "second", "random"]), min_size=1, max_size=5),
    logprobs=st.booleans(),
    top_k=st.sampled_from([-1, 3, 50]),
)
def test_a_seeded_verify_batch_keeps_the_tokens_and_log_probs_of_plain_steps(seed, choices, logprobs, top_k):
    """Whatever the drafts (a row's most likely token, its second, any token; after a draft that was not
    kept too), a seeded request's kept tokens and their log-probs are those of one plain step per
    position, and every row holds a real token id (a row's log-prob is read at it)."""
    vocab = 64
    logits = 3 * torch.randn(len(choices) + 1, vocab, generator=torch.Generator().manual_seed(seed))
    ranked = logits.argsort(dim=-1, descending=True)
    pick = {"best": 0, "second": 1}
    drafts = [int(ranked[j, pick[c]]) if c in pick else (seed + 7 * j) % vocab for j, c in enumerate(choices)]
    params = SamplingParams(temperature=0.8, top_k=top_k, seed=seed, logprobs=logprobs, top_logprobs=2 * logprobs)
    rows = [SampleRow(params, [], [], j, None, d) for j, d in enumerate([*drafts, None])]
    out = Sampler([])(logits.clone(), rows)
    sampled = out.next_token_ids.tolist()
    assert all(0 <= t < vocab for t in sampled)
    kept = verify_drafts(sampled, drafts)

    want, want_logprobs = [], []
    for j in range(len(kept)):
        plain = Sampler([])(logits[j : j + 1].clone(), [SampleRow(params, [], [], j)])
        want.append(int(plain.next_token_ids[0]))
        want_logprobs.append((plain.logprobs[0], plain.top_logprobs[0]))
    assert kept == want
    assert [(out.logprobs[j], out.top_logprobs[j]) for j in range(len(kept))] == want_logprobs


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
        assert stats.spec.draft_tokens > stats.spec.accepted_tokens


FEATURES = {  # requests with every sampling feature that shapes the token at each verified position
    "regex": dict(temperature=0, regex="[a-z]+( [a-z]+)*\\."),
    "log-probs": dict(temperature=0, logprobs=True, top_logprobs=3),
    "penalties": dict(
        temperature=0, repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=0.5, min_tokens=6
    ),
    "logit bias": dict(temperature=0, logit_bias={"5": 3.0}),
    "seeded": dict(temperature=0.9, top_k=20, top_p=0.9, seed=7, n=2),
    "seeded log-probs": dict(temperature=1.0, seed=42, n=3, logprobs=True, top_logprobs=2),
}


def feature_answers(engine: Engine, features: dict[str, dict], max_tokens: int) -> dict[str, list]:
    """Each request's choices as (token ids, finish reason, log-probs), all in flight together."""
    prompt = engine.processor.process_messages([{"role": "user", "content": COPY}])
    submissions = {name: engine.submit(prompt, max_tokens=max_tokens, **params) for name, params in features.items()}
    while not all(s.done for s in submissions.values()):
        engine.step()
    return {
        name: [(c.token_ids, c.finish_reason, c.logprobs) for c in engine.result(s).choices]
        for name, s in submissions.items()
    }


def test_every_sampling_feature_answers_with_drafts_as_without(tiny_dense_dir):
    """Grammars (walked through the drafts, a refused draft ends the acceptance), penalties and
    min_tokens (counting the drafts before each position), logit bias, log-probs of the kept tokens,
    seeded sampling (n = 2), and a stop string, a stop regex and a stop token that drafts run past."""
    features = dict(FEATURES)
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        longer = feature_answers(plain, features, max_tokens=30)
        greedy = longer["log-probs"][0][0]
        text = plain.tokenizer.decode(greedy)
        features["stop string"] = dict(temperature=0, stop=[text[len(text) // 2 : len(text) // 2 + 3]])
        features["stop regex"] = dict(temperature=0, stop_regex=[re.escape(text[len(text) // 3 :][:2]) + r"[\s\S]"])
        # the stop token at the answer's 6th token, allowed from the 5th: a verify batch from before the
        # 5th holds positions on both sides
        features["min tokens"] = dict(temperature=0, min_tokens=4, stop_token_ids=[greedy[5]])
        want = feature_answers(plain, features, max_tokens=20)
        prompt = plain.processor.process_messages([{"role": "user", "content": COPY}]).input_ids
    with Engine(tiny_dense_dir, vit_dp=0, speculative_algorithm="ngram") as speculative:
        drafts = ReplayDrafts([prompt + ids for choices in longer.values() for ids, _, _ in choices])
        speculative.scheduler.drafting.ngram = drafts
        got = feature_answers(speculative, features, max_tokens=20)
        metrics = speculative.scheduler.metrics
    for name in features:
        for (ids, reason, logprobs), (want_ids, want_reason, want_logprobs) in zip(got[name], want[name]):
            assert (ids, reason) == (want_ids, want_reason), name
            assert logprobs == pytest.approx(want_logprobs, abs=1e-4), name
    assert want["stop string"][0][1] == "stop" and len(want["stop string"][0][0]) < 20
    assert want["stop regex"][0][1] == "stop" and len(want["stop regex"][0][0]) < 20
    assert want["min tokens"][0][0] == greedy[:6]
    assert 0 < metrics.spec.accepted_tokens < metrics.spec.draft_tokens


def test_drafts_never_run_past_max_tokens_or_a_stop_token(tiny_dense_dir):
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        full = plain.chat([{"role": "user", "content": COPY}], max_tokens=24, temperature=0).token_ids
    stop = full[9]
    with Engine(tiny_dense_dir, vit_dp=0, speculative_algorithm="ngram") as speculative:
        assert speculative.chat([{"role": "user", "content": COPY}], max_tokens=7, temperature=0).token_ids == full[:7]
        stopped = speculative.chat(
            [{"role": "user", "content": COPY}], max_tokens=24, temperature=0, stop_token_ids=[stop]
        )
        assert stopped.token_ids == full[: full.index(stop) + 1]


def test_speculative_settings_out_of_range_are_refused_by_name():
    with pytest.raises(ValueError, match="speculative_algorithm must be one of ngram, eagle3, none"):
        ServerArgs(speculative_algorithm="medusa")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be >= 1"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="min_match_window_size .4. must not exceed"):
        ServerArgs(speculative_ngram_min_match_window_size=4, speculative_ngram_max_match_window_size=2)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be >= 1"):
        ServerArgs(speculative_algorithm="ngram", speculative_disable_by_batch_size=0)


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
        speculative.scheduler.drafting.ngram = WrongDrafts(speculative.scheduler.vocab_size)
        assert speculative.chat(conversation, max_tokens=40, temperature=0, ignore_eos=True).token_ids == want
        metrics = speculative.scheduler.metrics
        # drafts at decode steps 0, 2, 5, 10, 19, 36 of the 39 (after the prefill's token)
        assert (metrics.spec.verify_steps, metrics.spec.accepted_tokens) == (6, 0)


@pytest.mark.server
def test_the_server_speculates_and_reports_the_drafts_of_each_answer_and_in_all(tiny_dense_dir):
    """The answer is the engine's without drafts; `usage.speculative` (and SGLang's meta_info) say how
    its drafts fared, and /metrics the same for the whole server (one request so far)."""
    conversation = [{"role": "user", "content": COPY}]
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        want = plain.chat(conversation, max_tokens=40, temperature=0, ignore_eos=True).text
    with running_server(tiny_dense_dir, "--speculative-algorithm", "ngram", "--vit-dp", "0") as server:
        body = {"messages": conversation, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        metrics = httpx.get(server.url + "/metrics").text
        native = httpx.post(
            server.url + "/generate", json={"text": "one two one two one two", "sampling_params": {"max_new_tokens": 8}}
        ).json()
    assert answer["choices"][0]["message"]["content"] == want
    spec = answer["usage"]["speculative"]
    assert spec["verify_steps"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verify_steps"])
    for name, value in [
        ("drafts", "verify_steps"),
        ("draft_tokens", "draft_tokens"),
        ("accepted_tokens", "accepted_tokens"),
    ]:
        assert f"vlm_serve:spec_decode_num_{name}_total {spec[value]}" in metrics
    assert "spec_verify_ct" in native["meta_info"] and "spec_accept_length" in native["meta_info"]


def reference_ngram(tokens: list[int], k: int, low: int, high: int, vocab: int) -> list[int]:
    """The definition, window by window and position by position."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        pattern = tokens[-n:]
        if any(t >= vocab for t in pattern):
            continue
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == pattern]
        if starts:
            draft = tokens[starts[-1] + n : starts[-1] + n + k]
            draft = draft[: next((j for j, t in enumerate(draft) if t >= vocab), len(draft))]
            if draft:
                return draft
    return []


def test_ngram_drafts_are_the_definitions_on_random_sequences():
    rng = torch.Generator().manual_seed(0)
    for trial in range(300):
        length = int(torch.randint(1, 40, (1,), generator=rng))
        tokens = torch.randint(0, 6, (length,), generator=rng).tolist()  # (few ids: many repeats; 5 is a pad)
        low, high = sorted(torch.randint(1, 5, (2,), generator=rng).tolist())
        proposer = NgramProposer(num_draft_tokens=3, min_match_window=low, max_match_window=high, vocab_size=5)
        assert proposer.propose(tokens) == reference_ngram(tokens, 3, low, high, 5), (tokens, low, high)


# ---- EAGLE-3 ---------------------------------------------------------------------------------------


def short_and_long(engine: Engine) -> list:
    """A short and a long answer decoding side by side, then the long one alone."""
    conversation = engine.processor.process_messages([{"role": "user", "content": COPY}])
    jobs = [engine.submit(conversation, max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 30)]
    while not all(job.done for job in jobs):
        engine.step()
    return [engine.result(job) for job in jobs]


def test_decode_steps_above_the_batch_limit_run_without_ngram_drafts(tiny_dense_dir):
    """`speculative_disable_by_batch_size` 1: the short answer only ever decodes beside the long one and
    never drafts; the long one drafts once it decodes alone. Answers stay the plain ones. (Drafts are
    replayed from the answers: there is one to propose at every step.)"""
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        want = [out.token_ids for out in short_and_long(plain)]
        prompt = plain.processor.process_messages([{"role": "user", "content": COPY}]).input_ids
    with Engine(tiny_dense_dir, vit_dp=0, speculative_algorithm="ngram", speculative_disable_by_batch_size=1) as gated:
        gated.scheduler.drafting.ngram = ReplayDrafts([prompt + want[1]], num_draft_tokens=3)
        short, long = short_and_long(gated)
        assert [short.token_ids, long.token_ids] == want
        assert short.choices[0].spec.draft_tokens == 0 and long.choices[0].spec.draft_tokens > 0


def test_a_request_decoded_without_its_eagle3_draft_drafts_no_more(tiny_dense_dir, eagle3_drafts):
    """A step above the limit does not run the draft either (nor does the target keep the states it would
    read), so the draft's KV misses that position: the requests of that step draft no more (not even alone),
    while a request that never missed one drafts."""
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        want = [out.token_ids for out in short_and_long(plain)]
    settings = {**eagle3(eagle3_drafts, "dense"), "speculative_disable_by_batch_size": 1}
    with Engine(tiny_dense_dir, vit_dp=0, **settings) as gated:
        runner, kept = gated.scheduler.runner, []
        forward = runner.forward_batch_generation

        def recording(batch):
            out = forward(batch)
            kept.append((batch.forward_mode, batch.batch_size, out.aux_hidden is not None))
            return out

        runner.forward_batch_generation = recording
        short, long = short_and_long(gated)
        # (nor once the long one decodes alone: it drafts no more)
        assert (ForwardMode.DECODE, 2, False) in kept and (ForwardMode.DECODE, 1, False) in kept
        assert not any(mode == ForwardMode.DECODE and aux for mode, _, aux in kept)
        assert [short.token_ids, long.token_ids] == want
        assert short.choices[0].spec.draft_tokens == long.choices[0].spec.draft_tokens == 0
        alone = gated.chat([{"role": "user", "content": COPY}], max_tokens=8, temperature=0, ignore_eos=True)
        assert alone.token_ids == want[1][:8] and alone.choices[0].spec.draft_tokens > 0


def test_requests_without_a_draft_state_verify_beside_drafting_ones(tiny_dense_dir, eagle3_drafts):
    """Limit 2: three requests decode together, so all three stop drafting; once two have finished, a
    new one (drafting) decodes beside the last of them (not drafting) in verify steps."""
    conversation = [{"role": "user", "content": COPY}]
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        want = plain.chat(conversation, max_tokens=40, temperature=0, ignore_eos=True).token_ids
    settings = {**eagle3(eagle3_drafts, "dense"), "speculative_disable_by_batch_size": 2}
    with Engine(tiny_dense_dir, vit_dp=0, **settings) as gated:
        prompt = gated.processor.process_messages(conversation)
        jobs = [gated.submit(prompt, max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 40, 8)]
        while not jobs[2].done:
            gated.step()
        jobs.append(gated.submit(prompt, max_tokens=20, temperature=0, ignore_eos=True))
        while not all(job.done for job in jobs):
            gated.step()
        outs = [gated.result(job) for job in jobs]
        assert [out.token_ids for out in outs] == [want[:n] for n in (4, 40, 8, 20)]
        assert outs[1].choices[0].spec.draft_tokens == 0 and outs[3].choices[0].spec.draft_tokens > 0


def eagle3(drafts: dict, arch: str) -> dict:
    return {"speculative_algorithm": "eagle3", "speculative_draft_model_path": str(drafts[arch])}


@pytest.mark.parametrize("arch,page_size", [("dense", 1), ("dense", 4), ("moe", 1)])
def test_answers_with_a_random_eagle3_draft_are_those_without(arch, page_size, request, eagle3_drafts):
    """Its drafts are almost never the target's tokens: every step verifies and rejects them, and the
    answers (text and an image, greedy and seeded) stay exact; the idle check finds every slot free."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    with Engine(path, vit_dp=0, page_size=page_size) as plain:
        want = answers(plain)
    with Engine(path, vit_dp=0, page_size=page_size, **eagle3(eagle3_drafts, arch)) as speculative:
        assert answers(speculative) == want
        assert speculative.scheduler.metrics.spec.draft_tokens > 0


def test_the_draft_follows_each_request_through_verify_steps_as_its_definition_says(
    tiny_dense_dir, eagle3_drafts, monkeypatch
):
    """Prefill, verify steps that keep all, some or none of the drafts, and chained drafting in between:
    every chain's drafts, and the draft's state at the end, are what the published draft computes
    (written out here) from transformers' hidden states of the sequence so far. (The drafts verified are
    replayed from the answer, some spoilt, after the draft's own chain has run and written its KV.)"""
    conversation = [{"role": "user", "content": COPY}]
    draft_dir = eagle3_drafts["dense"]
    with Engine(tiny_dense_dir, vit_dp=0) as plain:
        prompt = plain.processor.process_messages(conversation).input_ids
        answer = plain.chat(conversation, max_tokens=24, temperature=0, ignore_eos=True).token_ids
    sequence = prompt + answer
    chains, states, chained_hidden = [], [], []
    chain, extend, draft_forward = Eagle3Worker.chain, Eagle3Worker.extend, Eagle3Draft.forward
    replay = ReplayDrafts([sequence], num_draft_tokens=4)

    def replayed(self, reqs):
        chained_hidden.clear()
        drafts = chain(self, reqs)[0]  # (its KV written at the drafts' slots)
        chains.append((reqs[0].start, drafts, list(chained_hidden)))
        # (the request's tokens so far: the answer's, up to its last token at position `start`)
        return [(replay.propose(sequence[: r.start + 1]) + [0] * r.count)[: r.count] for r in reqs]

    def forward(self, input_ids, hidden, positions, batch):
        normed, prenorm = draft_forward(self, input_ids, hidden, positions, batch)
        chained_hidden.append(prenorm[0].clone())
        return normed, prenorm

    def recording(self, batch, next_ids, aux_hidden, last_rows):
        states.extend(extend(self, batch, next_ids, aux_hidden, last_rows))
        return states[-len(last_rows) :]

    monkeypatch.setattr(Eagle3Worker, "chain", replayed)
    monkeypatch.setattr(Eagle3Worker, "extend", recording)
    monkeypatch.setattr(Eagle3Draft, "forward", forward)
    with Engine(tiny_dense_dir, vit_dp=0, **eagle3(eagle3_drafts, "dense")) as speculative:
        assert speculative.chat(conversation, max_tokens=24, temperature=0, ignore_eos=True).token_ids == answer
        metrics = speculative.scheduler.metrics.spec
    assert 0 < metrics.accepted_tokens < metrics.draft_tokens

    # the reference: transformers' states entering layers 0, 1 and 2 (the tiny model's low, middle, high)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(tiny_dense_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states_in = hf(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
    weights = load_file(str(draft_dir / "model.safetensors"))
    config = json.loads((draft_dir / "config.json").read_text())
    aux = fuse(weights, torch.cat([states_in[i][0] for i in (0, 1, 2)], dim=-1))
    embed = hf.model.language_model.embed_tokens.weight.detach()

    def reference(n: int, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        """The draft's tokens after positions 0..n-1 of the sequence, chained through `drafts`, and its
        pre-norm outputs at position n - 1 and at each chained one."""
        ids, hidden = torch.tensor(sequence[1 : n + 1]), aux[:n]
        tokens = []
        for step in range(len(drafts) + 1):
            _, prenorm, out = draft_reference(weights, config, embed[ids], hidden, torch.arange(len(ids)))
            tokens.append(int(out[-1]))
            if step < len(drafts):
                ids, hidden = torch.cat([ids, torch.tensor([drafts[step]])]), torch.cat([hidden, prenorm[-1:]])
        return tokens, prenorm[n - 1 :]

    assert len(chains) > 3
    for start, drafts, hidden in chains:  # the chain after position start - 1 reads the sequence up to `start`
        tokens, want = reference(start, drafts[:-1])
        assert tokens == drafts
        torch.testing.assert_close(torch.stack(hidden), want[1:], rtol=1e-4, atol=1e-4)
    final = states[-1]
    tokens, hidden = reference(len(sequence) - 1, [])
    assert final.first == tokens[0]
    torch.testing.assert_close(final.hidden, hidden[0], rtol=1e-4, atol=1e-4)


def test_eagle3_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="eagle3 needs speculative_draft_model_path"):
        ServerArgs(model="/models/Qwen3-VL-8B-Instruct", speculative_algorithm="eagle3")
    with pytest.raises(ValueError, match="speculative_draft_model_path is for speculative_algorithm eagle3"):
        ServerArgs(speculative_algorithm="ngram", speculative_draft_model_path="/tmp/draft")


def test_the_built_in_model_drafts_with_its_own_head_by_default_in_small_decode_steps():
    """Its trained draft makes its answers faster at small batches (benchmarks/bench_speculative.py), so it
    is on unless set otherwise, under TP, EP and on both sides of PD too; other models do not speculate
    unless asked."""
    default = ServerArgs()
    assert (default.speculative_algorithm, default.speculative_draft_model_path) == ("eagle3", str(BUILTIN_DRAFT))
    assert default.speculative_disable_by_batch_size == 4 and default.speculating
    assert ServerArgs(speculative_disable_by_batch_size=8).speculative_disable_by_batch_size == 8
    assert ServerArgs(speculative_algorithm="eagle3").speculative_disable_by_batch_size is None  # (as asked)
    assert not ServerArgs(speculative_algorithm="none").speculating
    assert ServerArgs(model="/models/Qwen3-VL-8B-Instruct").speculative_algorithm is None
    assert ServerArgs(disaggregation_mode="prefill").speculative_algorithm == "eagle3"
    assert ServerArgs(tp_size=2, ep_size=2).speculative_algorithm == "eagle3"


def test_the_built_in_model_drafts_with_its_own_trained_head_and_keeps_most_drafts():
    """`--speculative-algorithm eagle3` without a draft path: the built-in model's shipped head
    (`tools/builtin_train_eagle3.py`), whose drafts the model keeps (mean accepted length above 3 of 5), answers
    unchanged."""
    assert ServerArgs(speculative_algorithm="eagle3").speculative_draft_model_path == str(BUILTIN_DRAFT)
    rng = random.Random(7)
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": render(random_scene(rng, count=3))},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ]
        for _ in range(4)
    ]
    with Engine(vit_dp=0, speculative_algorithm="none") as plain:
        want = [out.token_ids for out in plain.chat_batch(conversations, max_tokens=48, temperature=0)]
    with Engine(vit_dp=0) as speculative:  # (by default)
        assert [out.token_ids for out in speculative.chat_batch(conversations, max_tokens=48, temperature=0)] == want
        assert speculative.scheduler.metrics.spec.mean_accepted_length > 3


def test_the_built_in_model_drafting_with_its_trained_head_answers_as_transformers_generate():
    """The oracle itself: in float32, with prefill chunks of 16 and its own draft, the built-in model's
    answers to its kinds of question (pictures, clips, pairs, greetings) are transformers' greedy ones."""
    rng = random.Random(23)
    examples = [random_example(rng) for _ in range(8)]
    with Engine(vit_dp=0, dtype="float32", chunked_prefill_size=16, speculative_algorithm="eagle3") as engine:
        got = [out.text for out in engine.chat_batch([messages(e) for e in examples], max_tokens=64, temperature=0)]
        assert engine.scheduler.metrics.spec.mean_accepted_length > 2
    hf = transformers.AutoModelForImageTextToText.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        assert got == [greedy_answer(hf, engine.processor, e, 64) for e in examples]


TRAINED_DRAFT_SETTINGS = {  # scheduler paths the trained draft's long kept runs go through
    "small_chunks": {"chunked_prefill_size": 16},
    "page_size_4": {"page_size": 4},
    "retraction": {"max_total_tokens": 220, "schedule_conservativeness": 0.05, "disable_radix_cache": True},
    "mixed_chunk": {"chunked_prefill_size": 32, "enable_mixed_chunk": True},
}


@pytest.mark.parametrize("setting", list(TRAINED_DRAFT_SETTINGS))
def test_the_trained_draft_keeps_answers_exact_through_every_scheduler_path(setting):
    """The random draft of the parity grid keeps almost nothing; the built-in model's own head keeps most
    of its drafts, so its KV chained into verify slots stays and is extended on: through prefill chunks
    ending inside pictures, pages, retraction and mixed batches, answers stay those without drafts."""
    rng = random.Random(11)
    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": render(random_scene(rng, count=1 + i % 4))},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ]
        for i in range(5)
    ] + [[{"role": "user", "content": "What can you do?"}]]
    settings = {"vit_dp": 0, **TRAINED_DRAFT_SETTINGS[setting]}
    with Engine(speculative_algorithm="none", **settings) as plain:
        want = [out.token_ids for out in plain.chat_batch(conversations, max_tokens=40, temperature=0)]
    with Engine(speculative_algorithm="eagle3", **settings) as speculative:  # (drafting at every batch size)
        assert [out.token_ids for out in speculative.chat_batch(conversations, max_tokens=40, temperature=0)] == want
        metrics = speculative.scheduler.metrics
        assert metrics.spec.mean_accepted_length > 2
        if setting == "retraction":
            assert metrics.num_retractions > 0


@pytest.mark.server
@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2-ep2"])
def test_two_tp_ranks_draft_with_the_built_in_head_and_answer_as_one_engine_without(tmp_path, ep_size):
    """The draft's heads and vocabulary are split over the TP ranks as the target's are (gloo), with the
    target's experts split too or not (the draft has none: it runs the same on every rank)."""
    rng = random.Random(3)
    pictures = [render(random_scene(rng, count=2)) for _ in range(2)]
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": p}, {"type": "text", "text": "Describe the image."}]}]
        for p in pictures
    ]
    with Engine(vit_dp=0, speculative_algorithm="none") as plain:
        want = [out.text for out in plain.chat_batch(conversations, max_tokens=40, temperature=0)]
    for i, picture in enumerate(pictures):
        picture.save(tmp_path / f"{i}.png")
    with running_server(
        BUILTIN_MODEL,
        "--tp-size",
        "2",
        "--ep-size",
        str(ep_size),
        "--speculative-algorithm",
        "eagle3",
        "--vit-dp",
        "0",
        "--allowed-local-media-path",
        str(tmp_path),
    ) as server:
        for i, text in enumerate(want):
            content = [
                {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/{i}.png"}},
                {"type": "text", "text": "Describe the image."},
            ]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 40, "temperature": 0}
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["message"]["content"] == text
            assert answer["usage"]["speculative"]["mean_accepted_length"] > 2
