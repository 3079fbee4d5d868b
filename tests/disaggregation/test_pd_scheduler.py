"""The PD schedulers (scheduler/pd_prefill.py, pd_decode.py) as a prefill and a decode engine joined by a
loopback transfer (tests/pd_loopback.py): a request sent to both sides with one room is answered by the
decode side exactly as one colocated engine answers it — text, images, chunked prefill, pages, both event
loops, speculative decoding (n-gram, and EAGLE-3 with the draft's KV computed on the prefill side), `n`,
log-probs, stop strings, grammars — and a transfer that fails or a request aborted in any queue ends as an
error or an abort on both sides, whose KV then returns to idle."""

from __future__ import annotations

import json
import random

import pytest

from pd_loopback import PDPair
from vlm_serve.builtin import BUILTIN_MODEL
from vlm_serve.builtin.scenes import random_scene, render
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image

TEXT = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]


def image_chat(seed: int) -> list[dict]:
    image = make_image(96, 64, seed=seed)
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}]


OPTIONS = {  # the scheduler paths the PD queues must compose with
    "overlap": {},
    "normal loop, chunks of 16": {"disable_overlap_schedule": True, "chunked_prefill_size": 16},
    "pages of 4, chunks of 16": {"page_size": 4, "chunked_prefill_size": 16},
    "n-gram drafts": {"speculative_algorithm": "ngram"},  # (the decode side verifies them)
    # (a random draft head: both sides load it, the prefill side computes its KV chunk by chunk)
    "EAGLE-3 drafts, chunks of 16": {"speculative_algorithm": "eagle3", "chunked_prefill_size": 16},
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def engines(request, tiny_moe_dir, eagle3_drafts):
    monkeypatch = pytest.MonkeyPatch()
    options = {"dtype": "float32", **OPTIONS[request.param]}
    if options.get("speculative_algorithm") == "eagle3":
        options["speculative_draft_model_path"] = str(eagle3_drafts["moe"])
    pair = PDPair(tiny_moe_dir, monkeypatch, **options)
    colocated = Engine(tiny_moe_dir, **options)
    yield pair, colocated
    pair.close()
    colocated.shutdown()
    monkeypatch.undo()


@pytest.fixture(autouse=True)
def idle_after_each_test(request):
    yield
    if "engines" not in request.fixturenames:
        return
    pair, colocated = request.getfixturevalue("engines")
    for engine in (pair.prefill, pair.decode, colocated):
        engine.scheduler.check_memory()
    for engine in (pair.prefill, pair.decode):
        assert not any(engine.scheduler.disagg.queue_sizes().values())


def answer(pair: PDPair, messages: list[dict], **sampling):
    x = pair.decode.processor.process_messages(messages, add_generation_prompt=True)
    prefill, decode = pair.submit(x, **sampling)
    pair.run(prefill, decode)
    return pair.prefill.result(prefill), pair.decode.result(decode)


@pytest.mark.parametrize("messages", [TEXT, image_chat(1)], ids=["text", "image"])
def test_the_decode_side_answers_as_one_engine_does(engines, messages):
    pair, colocated = engines
    want = colocated.chat(messages, max_tokens=12, temperature=0, ignore_eos=True)
    prefill, got = answer(pair, messages, max_tokens=12, temperature=0, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.finish_reason == "length"
    assert got.prompt_tokens == want.prompt_tokens
    assert prefill.token_ids == want.token_ids[:1]  # the prefill side sampled the first token only
    assert pair.decode.scheduler.metrics.computed_prompt_tokens == 0  # the decode side computed no prompt


def test_the_decode_side_drafts_over_the_draft_kv_the_prefill_side_computed(monkeypatch):
    """With EAGLE-3 on both sides (the built-in model's default), the prefill side sends the draft's KV of
    the prompt with the target's, written before it goes: the decode side's draft, which starts drafting
    from its first decode step's state, keeps about as many drafts as one engine's (with the prompt's
    draft KV stale it keeps half as many)."""
    rng = random.Random(5)
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
        for i in range(4)
    ]
    with Engine(vit_dp=0) as colocated:
        want = [out.token_ids for out in colocated.chat_batch(conversations, max_tokens=48, temperature=0)]
        colocated_length = colocated.scheduler.metrics.spec.mean_accepted_length
    pair = PDPair(BUILTIN_MODEL, monkeypatch, vit_dp=0)
    try:
        assert pair.prefill.scheduler.drafting.eagle is not None and pair.decode.scheduler.drafting.eagle is not None
        for messages, tokens in zip(conversations, want):
            _, got = answer(pair, messages, max_tokens=48, temperature=0)
            assert got.token_ids == tokens
        assert pair.decode.scheduler.metrics.spec.mean_accepted_length > colocated_length - 0.5
    finally:
        pair.close()


def test_a_repeated_prompt_is_served_from_the_prefill_sides_prefix_cache(engines):
    pair, _ = engines
    _, first = answer(pair, image_chat(2), max_tokens=4, temperature=0)
    _, again = answer(pair, image_chat(2), max_tokens=4, temperature=0)
    assert again.token_ids == first.token_ids and again.cached_tokens > 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_choices_and_logprobs(engines, sampled):
    """`n`, log-probs and top log-probs, greedy and seeded (a seeded request with log-probs, drafts verified
    on the decode side: what took a speculating server down)."""
    pair, colocated = engines
    sampling = {"max_tokens": 10, "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2}
    if sampled:
        sampling |= {"temperature": 0.8, "seed": 42}
    want = colocated.chat(TEXT, **sampling)
    prefill, got = answer(pair, TEXT, **sampling)
    for a, b in zip(got.choices, want.choices, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    for a, b in zip(prefill.choices, want.choices, strict=True):  # (the prefill side's one token has its own)
        assert a.logprobs == pytest.approx(b.logprobs[:1], abs=1e-4) and len(a.top_logprobs) == 1


def test_stop_strings(engines):
    pair, colocated = engines
    want = colocated.chat(TEXT, max_tokens=10, temperature=0)
    stop = colocated.tokenizer.decode(want.choices[0].token_ids[3:5])
    want = colocated.chat(TEXT, max_tokens=10, temperature=0, stop=[stop])
    _, got = answer(pair, TEXT, max_tokens=10, temperature=0, stop=[stop])
    assert (got.text, got.finish_reason) == (want.text, "stop")


def test_a_grammar_holds_from_the_prefill_sides_first_token_on(engines):
    pair, colocated = engines
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    sampling = {"max_tokens": 24, "temperature": 0, "json_schema": json.dumps(schema)}
    want = colocated.chat(TEXT, **sampling)
    _, got = answer(pair, TEXT, **sampling)
    assert got.token_ids == want.token_ids
    if got.finish_reason == "stop":
        assert set(json.loads(got.text)) == {"n"}


def test_a_failed_transfer_is_an_error_on_both_sides(engines):
    pair, _ = engines
    pair.hub.fail_rooms.add(f"{pair.next_room}/0")
    x = pair.decode.processor.process_messages(TEXT, add_generation_prompt=True)
    prefill, decode = pair.submit(x, max_tokens=4, temperature=0)
    pair.run(prefill, decode)
    for engine, submission in ((pair.prefill, prefill), (pair.decode, decode)):
        with pytest.raises(Exception, match="KV transfer failed.*injected failure") as failure:
            engine.result(submission)
        assert failure.value.status == 503


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_aborted_request_ends_on_both_sides(engines, side):
    """Aborted at once, it is in the prefill side's bootstrap queue or the decode side's prealloc
    queue; the other side learns it through the transfer."""
    pair, _ = engines
    x = pair.decode.processor.process_messages(image_chat(3), add_generation_prompt=True)
    prefill, decode = pair.submit(x, max_tokens=4, temperature=0)
    submissions = {"prefill": prefill, "decode": decode}
    aborted, other = side, {"prefill": "decode", "decode": "prefill"}[side]
    getattr(pair, aborted).abort(submissions[aborted])
    pair.run(prefill, decode)
    assert getattr(pair, aborted).result(submissions[aborted]).finish_reason == "abort"
    with pytest.raises(Exception, match=f"aborted by the {aborted} side") as failure:
        getattr(pair, other).result(submissions[other])
    assert failure.value.status == 503


def step_until(pair: PDPair, done, sides: tuple[str, ...] = ("prefill", "decode"), steps: int = 200) -> None:
    for _ in range(steps):
        if done():
            return
        for side in sides:
            getattr(pair, side).step()
    raise AssertionError("the request never got there")


def test_a_request_aborted_in_the_decode_sides_transfer_queue_fails_on_the_prefill_side(engines):
    """(Its slots given, its KV not all arrived: the prefill side, still computing it, learns it failed.)"""
    pair, _ = engines
    x = pair.decode.processor.process_messages(TEXT, add_generation_prompt=True)
    prefill, decode = pair.submit(x, max_tokens=4, temperature=0)
    step_until(pair, lambda: pair.decode.scheduler.disagg.transfer_queue, sides=("decode",))
    pair.decode.abort(decode)
    step_until(pair, lambda: decode.done, sides=("decode",))  # (before the prefill side has sent it all)
    pair.run(prefill, decode)
    assert pair.decode.result(decode).finish_reason == "abort"
    with pytest.raises(Exception, match="aborted by the decode side") as failure:
        pair.prefill.result(prefill)
    assert failure.value.status == 503


def test_a_request_aborted_in_the_prefill_sides_inflight_queue_is_still_answered_by_the_decode_side(engines):
    """(Its KV and record all sent: the transfer is done, and the abort ends the prefill side's part only.)"""
    pair, colocated = engines
    want = colocated.chat(TEXT, max_tokens=4, temperature=0)
    x = pair.decode.processor.process_messages(TEXT, add_generation_prompt=True)
    prefill, decode = pair.submit(x, max_tokens=4, temperature=0)
    step_until(pair, lambda: pair.prefill.scheduler.disagg.inflight_queue)
    pair.prefill.abort(prefill)
    pair.run(prefill, decode)
    assert pair.prefill.result(prefill).finish_reason == "abort"
    assert pair.decode.result(decode).token_ids == want.token_ids


def test_the_decode_side_refuses_media_without_bootstrap_fields(engines):
    pair, _ = engines
    with pytest.raises(ValueError, match="bootstrap_room"):
        pair.decode.chat(image_chat(4), max_tokens=2)


def test_both_sides_count_their_transfers_for_metrics(engines):
    pair, _ = engines
    before = [e.scheduler.get_stats() for e in (pair.prefill, pair.decode)]
    prefill, _ = answer(pair, TEXT, max_tokens=2, temperature=0)
    pair.hub.fail_rooms.add(f"{pair.next_room}/0")
    with pytest.raises(Exception, match="KV transfer failed"):
        answer(pair, TEXT, max_tokens=2, temperature=0)
    for engine, old, queues in zip(
        (pair.prefill, pair.decode), before, ({"bootstrap", "inflight"}, {"prealloc", "transfer"})
    ):
        stats = engine.scheduler.get_stats()
        assert stats.disaggregation_queues == dict.fromkeys(queues, 0)
        token_bytes = engine.scheduler.disagg.token_bytes
        assert stats.kv_transfer_bytes - old.kv_transfer_bytes == prefill.prompt_tokens * token_bytes
        assert stats.kv_transfer_seconds["count"] == old.kv_transfer_seconds["count"] + 1
        assert stats.kv_transfer_failures.get("transfer", 0) == old.kv_transfer_failures.get("transfer", 0) + 1


def test_a_request_the_decode_side_refuses_fails_on_the_prefill_side_at_once(tiny_moe_dir, monkeypatch):
    """(Too long for the decode server's context: a 400 there, and the prefill side stops waiting.)"""
    pair = PDPair(tiny_moe_dir, monkeypatch, decode_options={"context_length": 16}, dtype="float32")
    try:
        x = pair.decode.processor.process_messages(TEXT, add_generation_prompt=True)
        prefill, decode = pair.submit(x, max_tokens=4, temperature=0)
        pair.run(prefill, decode)
        with pytest.raises(ValueError, match="maximum context length is 16 tokens"):
            pair.decode.result(decode)
        with pytest.raises(Exception, match="aborted by the decode side") as failure:
            pair.prefill.result(prefill)
        assert failure.value.status == 503
        for engine in (pair.prefill, pair.decode):
            engine.scheduler.check_memory()
    finally:
        pair.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_request_whose_other_side_never_comes_fails_after_the_timeout(tiny_moe_dir, monkeypatch, side):
    pair = PDPair(tiny_moe_dir, monkeypatch, dtype="float32", disaggregation_timeout=0.2)
    try:
        x = pair.decode.processor.process_messages(TEXT, add_generation_prompt=True)
        (alone,) = pair.submit(x, sides=(side,), max_tokens=4, temperature=0)
        pair.run(alone)
        with pytest.raises(Exception, match="did not answer within 0.2 s") as failure:
            getattr(pair, side).result(alone)
        assert failure.value.status == 503
        assert getattr(pair, side).scheduler.get_stats().kv_transfer_failures == {"timeout": 1}
        getattr(pair, side).scheduler.check_memory()
        assert not getattr(pair, side).scheduler.disagg.entered  # (nothing left behind)
    finally:
        pair.close()
