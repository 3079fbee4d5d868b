"""Structured output in the engine: JSON schemas, regexes and EBNF grammars compiled by xgrammar, with
requests waiting in `grammar_queue` while they compile; and logit_bias. The random tiny model writes
noise, so every answer that parses is the grammar's doing. Every test ends with the idle self-check."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

import vlm_serve
from vlm_serve.errors import ServiceUnavailable
from vlm_serve.testing.media import make_image

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 3},
        "position": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "visible": {"type": "boolean"}},
            "required": ["x", "visible"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "position"],
    "additionalProperties": False,
}
LOOPS = {"normal": {"disable_overlap_schedule": True}, "overlap": {"disable_overlap_schedule": False}}


@pytest.fixture(scope="module", params=list(LOOPS))
def engine(request, tiny_moe_dir):
    # small chunks: prompts with an image are prefilled over several forwards
    engine = vlm_serve.Engine(model=tiny_moe_dir, dtype="float32", chunked_prefill_size=32, **LOOPS[request.param])
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def idle_after_each_test(request):
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert not engine.scheduler.grammar_queue
        engine.scheduler.check_memory()


def _ask(text: str, image=None) -> list[dict]:
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


def test_sampled_answers_follow_a_json_schema_with_an_image_in_the_prompt(engine):
    out = engine.chat(
        _ask("Describe the picture as JSON.", make_image(64, 48, seed=3)),
        json_schema=json.dumps(SCHEMA), temperature=1.0, n=8, seed=11, max_tokens=120,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    # the same request again: the compiled grammar is reused and the seeded answers repeat
    again = engine.chat(
        _ask("Describe the picture as JSON.", make_image(64, 48, seed=3)),
        json_schema=json.dumps(SCHEMA), temperature=1.0, n=8, seed=11, max_tokens=120,
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert list(engine.scheduler.grammar_queue.backend.cache) == [("json_schema", json.dumps(SCHEMA))]


def test_greedy_and_penalised_answers_follow_a_regex(engine):
    pattern = r"(cat|dog|bird) [0-9]{3}"
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "repetition_penalty": 1.3}):
        out = engine.chat(_ask("Name an animal and a number."), regex=pattern, max_tokens=20, n=3, **sampling)
        for choice in out.choices:
            assert re.fullmatch(pattern, choice.text), choice.text
            assert choice.finish_reason == "stop"


def test_an_ebnf_grammar_and_a_stop_string_inside_it(engine):
    grammar = 'root ::= "The answer is " ("yes" | "no") "." " Because " [a-z]+ "."'
    out = engine.chat(_ask("Yes or no?"), ebnf=grammar, max_tokens=40, temperature=1.0, seed=1, n=2)
    for choice in out.choices:
        assert (
            re.fullmatch(r"The answer is (yes|no)\. Because [a-z]+\.", choice.text) or choice.finish_reason == "length"
        )
    # a stop string still ends the answer, wherever the grammar is
    stopped = engine.chat(_ask("Yes or no?"), ebnf=grammar, max_tokens=40, temperature=0, stop=[" is "])
    assert stopped.text == "The answer" and stopped.finish_reason == "stop"


def test_a_grammar_ends_the_answer_even_with_ignore_eos(engine):
    out = engine.chat(_ask("Pick one."), regex="(left|right)", ignore_eos=True, max_tokens=30, temperature=0)
    assert out.text in ("left", "right") and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": "a(b"}, "invalid regex: Regex parsing error"),
        ({"ebnf": "root ::= missing"}, 'invalid ebnf: .*Rule "missing" is not defined'),
        ({"json_schema": json.dumps({"type": "nope"})}, 'invalid json_schema: Unsupported type "nope"'),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex and ebnf"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_with_the_reason(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.chat(_ask("Hello"), max_tokens=5, n=2, **kwargs)
    assert not engine.scheduler.reqs
    assert engine.chat(_ask("Hello"), max_tokens=3, regex="ok").text == "ok"  # the engine goes on


def _never_compiling(engine, monkeypatch) -> Future:
    """Makes the grammar backend hand out a compilation that never finishes."""
    pending: Future = Future()
    monkeypatch.setattr(engine.scheduler.grammar_queue.backend, "compile", lambda key: pending)
    return pending


def test_a_request_waiting_for_its_grammar_can_be_aborted(engine, monkeypatch):
    _never_compiling(engine, monkeypatch)
    x = engine.processor.process_messages(_ask("Hello"))
    submission = engine.submit(x, regex="a+", max_tokens=5)
    for _ in range(3):
        engine.step()
    assert [p.req.rid for p in engine.scheduler.grammar_queue] == submission.rids
    engine.abort(submission, "client went away")
    engine.step()
    assert engine.result(submission).choices[0].finish_reason == "abort"


def test_a_grammar_that_does_not_compile_in_time_fails_as_the_servers_fault(engine, monkeypatch):
    """A 503: the deadline includes waiting behind other grammars, and a retry finds it compiled."""
    _never_compiling(engine, monkeypatch)
    monkeypatch.setattr(engine.scheduler.grammar_queue, "timeout", 0.05)  # (--grammar-compile-timeout)
    with pytest.raises(ServiceUnavailable, match="did not compile within 0.05 s"):
        engine.chat(_ask("Hello"), regex="a+", max_tokens=5)


def test_logit_bias_steers_the_answer_and_bad_ids_are_refused(engine):
    token = engine.tokenizer.encode(" cat")[0]
    out = engine.chat(_ask("Hello"), logit_bias={str(token): 100}, max_tokens=4, temperature=0, ignore_eos=True)
    assert out.token_ids == [token] * 4
    with pytest.raises(ValueError, match="logit_bias token id 999999 is outside the vocabulary"):
        engine.chat(_ask("Hello"), logit_bias={"999999": 1}, max_tokens=4)
    with pytest.raises(ValueError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        engine.chat(_ask("Hello"), logit_bias={str(token): 101}, max_tokens=4)


def test_with_reasoning_the_grammar_starts_after_the_end_of_thinking(engine):
    think_end = engine.tokenizer.token_to_id("</think>")
    # still thinking: the grammar does not apply yet (a random model never closes its thoughts by itself)
    free = engine.chat(_ask("Pick one."), regex="(left|right)", reasoning=True, max_tokens=8, temperature=0)
    assert think_end not in free.token_ids and free.finish_reason == "length"
    assert not re.fullmatch("(left|right)", free.text)
    # pushed to close them at once: then the answer follows the grammar
    out = engine.chat(
        _ask("Pick one."), regex="(left|right)", reasoning=True, max_tokens=8, temperature=0,
        logit_bias={str(think_end): 100},
    )  # fmt: skip
    assert out.token_ids[0] == think_end and out.finish_reason == "stop"
    assert engine.tokenizer.decode(out.token_ids[1:]) in ("left", "right")


def test_a_grammar_after_reasoning_rolls_back_across_the_end_of_thinking(engine):
    """What verifying speculative drafts needs of a grammar: accept them, then forget them again."""
    import xgrammar as xgr

    backend = engine.scheduler.grammar_queue.backend
    grammar = backend.matcher(backend.compile(("regex", "(left|right)")).result(), after_reasoning=True)
    think_end = engine.tokenizer.token_to_id("</think>")
    vocab = engine.scheduler.vocab_size
    left = engine.tokenizer.encode("left")

    def allowed() -> int:
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        grammar.fill_next_token_bitmask(bitmask, 0)
        return int(xgr.testing.bitmask_to_bool_mask(bitmask, vocab).sum())

    assert all(grammar.accept_token(t) for t in [7, 8, think_end, *left[:1]])
    constrained = allowed()
    grammar.rollback(2)  # back before `</think>`: thinking, every token allowed
    assert allowed() == vocab and not grammar.is_terminated()
    assert grammar.accept_token(think_end) and allowed() < vocab
    assert grammar.accept_token(left[0]) and allowed() == constrained
    grammar.rollback(1)
    assert not grammar.accept_token(engine.tokenizer.encode("up")[0])  # the grammar holds after rollback
