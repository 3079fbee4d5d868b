"""A request the server could not serve is never a success. It ends as an error whose status says whose
fault it is (400 the request's, 5xx the server's) and whose message names the cause; only a client's own
cancellation ends as a quiet "abort". Here, through `Engine` and the encoder pool: each failure path
raised as the server's error class (a killed rank's work, a refusal, a tower that raises, a grammar that
fails or never compiles, the idle self-check). Through real servers: test_fault_injection.py."""

from __future__ import annotations

import os
import re
import select
import signal
import time
from concurrent.futures import Future

import pytest
import torch

import request_faults
from vlm_serve.config import ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.errors import BadRequest, InternalError, ServiceUnavailable
from vlm_serve.multimodal.pixels import PatchPixels
from vlm_serve.testing.media import make_image
from vlm_serve.vision.encoder import EncodeTask
from vlm_serve.vision.pool import EncoderConcerns, EncoderPool

MAX_TOKENS = 6
TEXT = [{"role": "user", "content": "Tell me about the sea."}]


# ---- the encoder pool ----------------------------------------------------------------------------------


@pytest.mark.server
def test_work_never_goes_to_a_rank_known_to_be_dead(tiny_moe_dir):
    """A rank whose process has exited gets no new work, even before the pool has taken its old work
    back, so no attempt is wasted on it."""
    pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=2)), torch.device("cpu"))
    try:
        dead = pool.ranks[0]
        os.kill(dead.pid, signal.SIGKILL)
        select.select([dead.pidfd], [], [], 30)  # (readable once it has exited)
        gen = torch.Generator().manual_seed(0)
        tasks = [EncodeTask(i, (1, 8, 8), PatchPixels(torch.randn(64, 1536, generator=gen))) for i in range(3)]
        pool.submit(tasks)
        assert not dead.jobs and sum(map(len, pool.ranks[1].jobs.values())) == 3
        results = []
        deadline = time.monotonic() + 60
        while len(results) < 3 and time.monotonic() < deadline:
            results += pool.poll(timeout=0.1)
        assert sorted(r.key for r in results) == [0, 1, 2]
        assert all(r.error is None and r.rank == 1 for r in results)
        assert [t.attempts for t in tasks] == [0, 0, 0]
    finally:
        pool.shutdown()


# ---- through the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0) as engine:
        yield engine


def _settled(engine: Engine) -> None:
    """Nothing is left behind: no request, no text stream, no KV slot."""
    engine.step()
    while not engine.scheduler.is_idle():
        engine.step()
    assert not engine.scheduler.reqs and not engine.detokenizer.streams
    engine.scheduler.check_memory()


def test_a_request_the_scheduler_refuses_is_the_requests_fault(engine):
    before = engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text
    with pytest.raises(BadRequest, match="This model's maximum context length is") as raised:
        engine.chat(TEXT, max_tokens=10**6)
    assert isinstance(raised.value, ValueError) and raised.value.code == "context_length_exceeded"
    _settled(engine)
    assert engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text == before


def test_an_image_the_vision_tower_raises_on_is_an_internal_error_streamed_or_not(engine, monkeypatch):
    parts = [{"type": "image", "image": make_image(96, 64, seed=7)}, {"type": "text", "text": "Hi"}]
    conversation = [{"role": "user", "content": parts}]
    visual = engine.scheduler.encoding.encoder.visual

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    with monkeypatch.context() as patch:
        patch.setattr(visual, "forward", broken)
        with pytest.raises(InternalError, match="image 0 of the request could not be encoded: .*illegal") as raised:
            engine.chat(conversation, max_tokens=MAX_TOKENS)
        assert raised.value.status == 500 and raised.value.code == "encoder_error"
        with pytest.raises(InternalError, match="illegal memory"):
            list(engine.stream(conversation, max_tokens=MAX_TOKENS))
        _settled(engine)
    assert engine.chat(conversation, max_tokens=MAX_TOKENS, temperature=0).finish_reason in ("stop", "length")


def test_grammar_failures_say_whose_fault_they_are(engine, monkeypatch):
    with pytest.raises(BadRequest, match="invalid regex") as raised:
        engine.chat(TEXT, regex="(", max_tokens=MAX_TOKENS)
    assert raised.value.code == "invalid_grammar"
    with monkeypatch.context() as patch:  # a compilation that never ends
        patch.setattr(engine.scheduler.grammar_queue.backend, "compile", lambda key: Future())
        patch.setattr(engine.scheduler.grammar_queue, "timeout", 0.05)  # (--grammar-compile-timeout)
        with pytest.raises(ServiceUnavailable, match="did not compile within 0.05 s") as raised:
            engine.chat(TEXT, regex="a+", max_tokens=MAX_TOKENS)
    assert raised.value.status == 503 and raised.value.code == "grammar_timeout"
    _settled(engine)


def test_a_failed_idle_self_check_is_raised_not_passed_over(engine):
    before = engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text
    leaked = engine.scheduler.allocator.alloc(1)
    try:
        with pytest.raises(RuntimeError, match="idle self-check failed: 1 KV slots leaked"):
            engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0)
            engine.step()  # (if the call ended before the scheduler's first idle step)
    finally:
        engine.scheduler.allocator.free(leaked)
    _settled(engine)
    assert engine.chat(TEXT, max_tokens=MAX_TOKENS, temperature=0).text == before


# ---- a request's own failure -----------------------------------------------------------------------------

ENGINES = {  # the built-in model drafts with EAGLE-3 in the normal loop; the tiny one runs the overlap loop
    "built-in, EAGLE-3": dict(),
    "overlap": dict(speculative_algorithm="none"),
    "n-gram": dict(speculative_algorithm="ngram"),
}
TOGETHER = [dict(temperature=0), dict(temperature=0.8, seed=11, logprobs=True, top_logprobs=2)]


@pytest.fixture(scope="module", params=list(ENGINES))
def each_engine(request):
    with Engine(vit_dp=0, **ENGINES[request.param]) as engine:
        yield engine


def _answers(engine: Engine, requests: list[dict]) -> list[list[int] | Exception]:
    """Each request's token ids (or the error it raised), all in flight together."""
    prompt = engine.processor.process_messages(TEXT)
    submissions = [engine.submit(prompt, max_tokens=MAX_TOKENS + 4, ignore_eos=True, **r) for r in requests]
    while not all(s.done for s in submissions):
        engine.step()
    results = []
    for s in submissions:
        try:
            results.append(engine.result(s).token_ids)
        except InternalError as exc:
            results.append(exc)
    return results


@pytest.mark.parametrize("fault", ["sampling", "output", "text"])
def test_a_request_whose_own_path_raises_fails_alone_and_the_others_get_their_answers(each_engine, fault, monkeypatch):
    """Its sampling (the batch's, then its own), its output processing (at its third token) or its text
    (the detokenizer): it ends with a 500 naming the request and the cause; the requests beside it get
    the answers they get without it, nothing is left held, and the next request is served."""
    engine = each_engine
    want = _answers(engine, TOGETHER)
    request_faults.install(monkeypatch.setattr)
    faulty = {
        "sampling": dict(stop=[request_faults.SAMPLE]),
        "output": dict(stop=[request_faults.OUTPUT]),
        "text": dict(logit_bias={engine.tokenizer.token_to_id(request_faults.DETOKENIZE): 100}),
    }[fault]
    got = _answers(engine, [dict(temperature=0.5, **faulty), *TOGETHER])
    where = {"sampling": "sampling", "output": "its output was processed", "text": "its text was decoded"}[fault]
    assert isinstance(got[0], InternalError) and got[0].status == 500
    assert re.fullmatch(rf"request req\d+-0 failed while {where}: RuntimeError: injected \w+ fault", got[0].message)
    assert got[1:] == want
    _settled(engine)
    monkeypatch.undo()
    assert _answers(engine, TOGETHER) == want
