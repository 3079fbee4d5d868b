"""The sampler (penalties, min_new_tokens, log-probs, greedy, filtered and seeded draws) and the
validation of SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import pytest
import torch

from vlm_serve.llm.layers.sampler import Sampler, filter_probs
from vlm_serve.sampling_params import SamplingParams

EOS = 3


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    grammar: None = None
    draft: None = None
    pending: torch.Tensor | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids)


def make_req(prompt: Sequence[int] = (), output: Sequence[int] = (), **params) -> FakeReq:
    return FakeReq(SamplingParams(**params), list(prompt), list(output))


def filtered(probs: list[list[float]], top_k: list[int], top_p: list[float], min_p: list[float]) -> list[list[float]]:
    return filter_probs(torch.tensor(probs), torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p)).tolist()


# exactly representable, no ties; the mass before each (in sorted order) is 0, 0.5, 0.75, 0.90625
P = [0.15625, 0.5, 0.09375, 0.25]


def test_top_k_keeps_the_k_most_likely():
    assert filtered([P], [2], [1.0], [0.0]) == [[0.0, 0.5, 0.0, 0.25]]
    assert filtered([P], [1], [1.0], [0.0]) == [[0.0, 0.5, 0.0, 0.0]]
    assert filtered([P], [10], [1.0], [0.0]) == [P]


def test_top_p_keeps_a_token_while_the_mass_before_it_is_strictly_below_top_p():
    assert filtered([P], [-1], [0.75], [0.0]) == [[0.0, 0.5, 0.0, 0.25]]  # 0.15625 has 0.75 before it
    assert filtered([P], [-1], [0.751], [0.0]) == [[0.15625, 0.5, 0.0, 0.25]]
    assert filtered([P], [-1], [0.5], [0.0]) == [[0.0, 0.5, 0.0, 0.0]]
    assert filtered([P], [-1], [0.01], [0.0]) == [[0.0, 0.5, 0.0, 0.0]]  # the top token always stays
    assert filtered([P], [-1], [5e-324], [0.0]) == [[0.0, 0.5, 0.0, 0.0]]  # (0 as a float32)


def test_top_p_applies_to_what_top_k_left_like_transformers():
    # top-2 leaves 0.5 and 0.25, i.e. 2/3 and 1/3 once renormalised: top_p 0.6 keeps only the first
    assert filtered([P], [2], [0.6], [0.0]) == [[0.0, 0.5, 0.0, 0.0]]
    assert filtered([P], [-1], [0.6], [0.0]) == [[0.0, 0.5, 0.0, 0.25]]


def test_top_p_of_one_keeps_even_tokens_after_the_mass_has_rounded_to_one():
    probs = torch.softmax(torch.tensor([[0.0] + [-40.0] * 5]), dim=-1)  # the top token rounds to 1.0
    out = filter_probs(probs, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert (out[0, 1:] > 0).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    assert filtered([P], [-1], [1.0], [0.5]) == [[0.0, 0.5, 0.0, 0.25]]  # threshold 0.25, inclusive
    assert filtered([P], [-1], [1.0], [0.3125]) == [[0.15625, 0.5, 0.0, 0.25]]  # threshold 0.15625
    assert filtered([P], [-1], [1.0], [1.0]) == [[0.0, 0.5, 0.0, 0.0]]


def test_rows_of_one_batch_use_their_own_settings():
    rows = [P, P, P, P, [0.25, 0.25, 0.375, 0.125]]
    out = filtered(rows, [-1, 3, -1, 3, -1], [1.0, 1.0, 0.6, 0.75, 1.0], [0.0, 0.0, 0.0, 0.0, 0.5])
    assert out == [
        P,
        [0.15625, 0.5, 0.0, 0.25],
        [0.0, 0.5, 0.0, 0.25],
        [0.0, 0.5, 0.0, 0.25],  # top-k 3 would keep three, top-p 0.75 only two
        [0.25, 0.25, 0.375, 0.0],  # min-p threshold 0.1875
    ]


def test_sampled_tokens_come_only_from_what_the_filters_keep():
    logits = torch.log(torch.tensor([P] * 300))
    reqs = [make_req(top_k=2)] * 100 + [make_req(top_p=0.5)] * 100
    reqs += [make_req(min_p=0.3125, seed=i) for i in range(100)]
    ids = Sampler([])(logits, reqs).tolist()
    assert set(ids[:100]) == {1, 3}
    assert set(ids[100:200]) == {1}
    assert set(ids[200:]) == {0, 1, 3}


def run_steps(sampler: Sampler, logits: torch.Tensor, reqs: list[FakeReq], steps: int) -> None:
    """Decode `steps` tokens on fixed logits, appending each request's token to its output."""
    for _ in range(steps):
        out = sampler(logits.clone(), reqs)
        out.tolist()  # (the host reads the tokens and their log-probs)
        for r, t in zip(reqs, out.tolist()):
            r.output_ids.append(t)


NEIGHBOURS = {  # rows beside a seeded one: some without top_k (the batch samples over the vocabulary) or all with
    "mixed": lambda: [
        make_req(),
        make_req(seed=7, top_k=50),
        make_req(temperature=0),
        make_req(frequency_penalty=1.0, logprobs=True),
    ],
    "top-k": lambda: [make_req(top_k=5), make_req(seed=7, top_k=50), make_req(top_k=900, min_p=0.1)],
}


@pytest.mark.parametrize("neighbours", list(NEIGHBOURS))
@pytest.mark.parametrize("settings", [dict(top_p=0.95), dict(top_k=20), dict(top_k=40, top_p=0.8, min_p=0.01)])
def test_a_seed_gives_the_same_tokens_alone_or_in_any_batch(settings, neighbours):
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 1000, generator=g) * 0.1
    others = torch.randn(4, 1000, generator=g)
    sampler = Sampler([EOS])

    alone = make_req(seed=42, **settings)
    run_steps(sampler, row, [alone], steps=6)

    batched = make_req(seed=42, **settings)
    around = NEIGHBOURS[neighbours]()
    batch = around[:2] + [batched] + around[2:]
    run_steps(sampler, torch.cat([others[:2], row, others[2 : len(around)]]), batch, steps=6)
    assert batched.output_ids == alone.output_ids

    for seed in (43, 42 + 2**32):  # (torch's generators read only a seed's low 32 bits)
        other_seed = make_req(seed=seed, **settings)
        run_steps(sampler, row, [other_seed], steps=6)
        assert other_seed.output_ids != alone.output_ids


def test_unseeded_draws_follow_the_distribution_and_the_temperature():
    logits = torch.log(torch.tensor([[0.8, 0.2]])).expand(2000, 2).contiguous()
    ids = Sampler([])(logits.clone(), [make_req()] * 2000).tolist()
    assert 1500 < ids.count(0) < 1700  # expected 1600, sd ~18
    # temperature 2 flattens 0.8/0.2 to 2/3 and 1/3
    ids = Sampler([])(logits.clone(), [make_req(temperature=2.0)] * 2000).tolist()
    assert 1233 < ids.count(0) < 1433  # expected 1333, sd ~21


def test_greedy_rows_take_the_argmax():
    """Temperature 0, top_k 1, and a temperature too small to divide by (as vLLM: below 1e-5)."""
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.0]])
    for params in (
        {"temperature": 0},
        {"top_k": 1, "temperature": 5.0},
        {"temperature": 5e-324},
        {"temperature": 1e-6},
    ):
        out = Sampler([EOS])(logits.clone(), [make_req(**params), make_req(**params)])
        out.tolist()  # (the host reads the tokens and their log-probs)
        assert out.tolist() == [1, 0]
        assert out.logprobs == [None, None] and out.top_logprobs == [None, None]


@pytest.mark.parametrize(
    "feature",
    [{"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"min_new_tokens": 2}],
)
@pytest.mark.parametrize("greedy", [{"temperature": 0}, {"top_k": 1}])
def test_each_feature_takes_effect_in_an_otherwise_greedy_batch(feature, greedy):
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0]] * 2)
    reqs = [make_req(prompt=[0], output=[0], **greedy), make_req(prompt=[0], output=[0], **greedy, **feature)]
    assert Sampler([0])(logits, reqs).tolist() == [0, 1]  # token 0 is also EOS here


def all_logprobs(sampler: Sampler, logits: list[float], **kwargs) -> list[float]:
    """The full log-prob row (token order) the sampler reports for one greedy request."""
    req = make_req(temperature=0, logprobs=True, top_logprobs=len(logits), **kwargs)
    out = sampler(torch.tensor([logits]), [req])
    out.tolist()  # (the host reads the tokens and their log-probs)
    return [lp for _, lp in sorted(out.top_logprobs[0])]


def expected(logits: list[float]) -> list[float]:
    return torch.log_softmax(torch.tensor(logits), dim=-1).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    sampler = Sampler([])
    logits = [2.0, 1.5, -1.0, -1.2]
    # token 0 from the prompt, token 2 from the output
    got = all_logprobs(sampler, logits, prompt=[0], output=[2], repetition_penalty=2.0)
    assert got == pytest.approx(expected([1.0, 1.5, -2.0, -1.2]))
    out = sampler(torch.tensor([logits]), [make_req(prompt=[0], temperature=0, repetition_penalty=2.0)])
    assert out.tolist() == [1]


@pytest.mark.parametrize("penalty", [1e-244, 2.0**-149, 1e-30, 1e30, 1e300])
def test_a_repetition_penalty_that_overflows_the_logits_still_samples_from_finite_ones(penalty):
    """Dividing by a penalty near 0, or 0 as a float32 (or multiplying by a huge one) overflows: the
    penalized logits stay finite, divided by any temperature too, so draws and log-probs are still numbers,
    and the order of the tokens is kept."""
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    for params in (dict(temperature=0), dict(seed=1), dict(), dict(temperature=1e-5, top_p=1e-300)):
        req = make_req(prompt=[0, 2], output=[1], repetition_penalty=penalty, logprobs=True, top_logprobs=4, **params)
        out = Sampler([])(logits.clone(), [req])
        out.tolist()  # (the host reads the tokens and their log-probs)
        assert 0 <= out.tolist()[0] < 4
        assert math.isfinite(out.logprobs[0]) and all(math.isfinite(v) for _, v in out.top_logprobs[0])
    if penalty < 1:  # the seen tokens with positive logits now lead
        assert Sampler([])(
            logits.clone(), [make_req(prompt=[0], temperature=0, repetition_penalty=penalty)]
        ).tolist() == [0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    sampler = Sampler([])
    logits = [2.0, 1.0, -1.0, 0.5]
    history = {"prompt": [3, 3, 3], "output": [0, 0, 2]}
    got = all_logprobs(sampler, logits, frequency_penalty=0.5, **history)
    assert got == pytest.approx(expected([1.0, 1.0, -1.5, 0.5]))
    got = all_logprobs(sampler, logits, presence_penalty=0.25, **history)
    assert got == pytest.approx(expected([1.75, 1.0, -1.25, 0.5]))
    # all three: repetition first, then the subtractions
    got = all_logprobs(sampler, logits, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, **history)
    assert got == pytest.approx(expected([-0.25, 1.0, -2.75, 0.25]))
    # a negative frequency penalty rewards repeats: token 2 (-1 + 3 * 1.5 = 3.5) beats token 0 (2)
    out = sampler(torch.tensor([logits]), [make_req(output=[2, 2, 2], temperature=0, frequency_penalty=-1.5)])
    assert out.tolist() == [2]


def test_penalties_leave_other_rows_alone():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]] * 2)
    reqs = [
        make_req(output=[0, 0], temperature=0, frequency_penalty=2.0),
        make_req(output=[0, 0], temperature=0, logprobs=True, top_logprobs=4),
    ]
    out = Sampler([])(logits.clone(), reqs)
    out.tolist()  # (the host reads the tokens and their log-probs)
    assert out.tolist() == [1, 0]
    assert [lp for _, lp in sorted(out.top_logprobs[1])] == pytest.approx(expected(logits[1].tolist()))


def test_prompt_ids_beyond_the_vocabulary_are_ignored_by_the_repetition_penalty():
    got = all_logprobs(Sampler([]), [2.0, 1.0, 1.0, 1.0], prompt=[151655, 0, 4, 99], repetition_penalty=4.0)
    assert got == pytest.approx(expected([0.5, 1.0, 1.0, 1.0]))


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached():
    sampler = Sampler([EOS])
    logits = torch.tensor([[0.0, 1.0, 5.0, 10.0]])  # EOS (3) first, then stop id 2
    req = make_req(temperature=0, min_new_tokens=2, stop_token_ids=[2], logprobs=True, top_logprobs=4)
    out = sampler(logits.clone(), [req])
    out.tolist()  # (the host reads the tokens and their log-probs)
    assert out.tolist() == [1]
    assert dict(out.top_logprobs[0])[2] == dict(out.top_logprobs[0])[3] == -math.inf
    req.output_ids = [1]
    assert sampler(logits.clone(), [req]).tolist() == [1]
    req.output_ids = [1, 1]
    assert sampler(logits.clone(), [req]).tolist() == [EOS]
    # ignore_eos alone masks nothing
    assert sampler(logits.clone(), [make_req(temperature=0, ignore_eos=True)]).tolist() == [EOS]


def test_min_new_tokens_mask_holds_for_sampled_rows():
    logits = torch.tensor([[0.0, 0.0, 8.0, 8.0]] * 200)
    reqs = [make_req(min_new_tokens=1, stop_token_ids=[2])] * 200
    assert set(Sampler([EOS])(logits, reqs).tolist()) == {0, 1}


def test_logprobs_are_log_softmax_before_temperature_and_filters():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    reqs = [
        make_req(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5),
        make_req(temperature=0.7),
        make_req(temperature=0, logprobs=True),
    ]
    out = Sampler([EOS])(logits.clone(), reqs)
    out.tolist()  # (the host reads the tokens and their log-probs)
    ref = torch.log_softmax(logits, dim=-1)
    for i in (0, 2):
        assert out.logprobs[i] == pytest.approx(ref[i, out.tolist()[i]].item())
    assert out.tolist()[2] == logits[2].argmax().item()
    values, ids = ref[0].topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist())
    assert out.logprobs[1] is None and out.top_logprobs[1] is None and out.top_logprobs[2] is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 11, "max_new_tokens": 10}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_regex": ["ok", ""]}, "stop_regex"),
        ({"stop_regex": "a(b"}, "stop_regex"),
        ({"stop_regex": "(" * 5000 + ")" * 5000}, "stop_regex"),  # nested too deep to compile
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=True
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_edges_and_defaults():
    SamplingParams(frequency_penalty=-2, presence_penalty=2, repetition_penalty=5.0, n=128)
    SamplingParams(min_new_tokens=10, max_new_tokens=10, logprobs=True, top_logprobs=20)
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_regex=r"\d+").stop_regex == [r"\d+"]
    assert SamplingParams(stop_regex=None).stop_regex == []
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
