"""The in-process Engine API: chat, batches, streaming, `n` choices, stop conditions, logprobs, aborts,
bad input, observability. Every test ends with the scheduler's idle self-check."""

from __future__ import annotations

import base64
import gc
import io
import logging
import re
import sys
import weakref

import pytest

import vlm_serve
from helpers import run_process
from vlm_serve.detokenizer import STOP_REGEX_LOOKBACK, find_stop_regex
from vlm_serve.testing.media import make_image

PROMPT = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    engine = vlm_serve.Engine(model=tiny_moe_dir, dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def idle_after_each_test(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").scheduler.check_memory()


def _image_messages(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]


def test_chat_returns_text_and_token_ids(engine):
    out = engine.chat(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.text == engine.tokenizer.decode(out.token_ids)
    assert out.prompt_tokens > 0 and len(out.choices) == 1


def test_image_as_path_data_url_or_pil_gives_the_same_answer(engine, tmp_path):
    image = make_image(128, 96, seed=7)
    path = tmp_path / "img.png"
    image.save(path)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    outs = [engine.chat(_image_messages(x), max_tokens=8, temperature=0) for x in (image, str(path), data_url)]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # The path and the data URL hold the same bytes, so the same pad value: the image's KV is reused.
    image_end = engine.processor.process_messages(_image_messages(data_url)).mm_items[0].spans[0][1]
    assert outs[2].cached_tokens >= image_end


def test_two_different_images_do_not_share_the_image_prefix(engine):
    a = engine.chat(_image_messages(make_image(128, 96, seed=21)), max_tokens=4, temperature=0)
    b = engine.chat(_image_messages(make_image(128, 96, seed=22)), max_tokens=4, temperature=0)
    image_start = (
        engine.processor.process_messages(_image_messages(make_image(128, 96, seed=22))).mm_items[0].spans[0][0]
    )
    assert b.cached_tokens <= image_start
    assert a.prompt_tokens == b.prompt_tokens


def test_batch_matches_single_calls(engine):
    convs = [PROMPT, _image_messages(make_image(64, 64, seed=3)), [{"role": "user", "content": "Hi"}]]
    together = engine.chat_batch(convs, max_tokens=6, temperature=0)
    alone = [engine.chat(c, max_tokens=6, temperature=0) for c in convs]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_stream_pieces_add_up_to_the_blocking_answer(engine):
    full = engine.chat(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    chunks = list(engine.stream(PROMPT, max_tokens=10, temperature=0, ignore_eos=True))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


def test_closing_a_stream_early_aborts_and_frees_everything(engine):
    stream = engine.stream(PROMPT, max_tokens=50, temperature=0, ignore_eos=True)
    next(stream)
    stream.close()
    assert engine.scheduler.is_idle()


def _split_stop(engine) -> tuple[str, str]:
    """A stop string made of the end of one generated token and the start of the next."""
    out = engine.chat(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    pieces = [engine.tokenizer.decode([t]) for t in out.token_ids]
    for k in range(2, len(pieces) - 1):
        left, right = pieces[k].strip(), pieces[k + 1].strip()
        if len(left) >= 2 and len(right) >= 2 and pieces[k + 1][0] != " ":
            stop = left[-2:] + right[:2]
            if stop not in "".join(pieces[: k + 1]):
                return out.text, stop
    pytest.skip("no adjacent pair of tokens to build a split stop string from")


def test_stop_string_split_across_tokens_is_caught_and_trimmed(engine):
    full_text, stop = _split_stop(engine)
    out = engine.chat(PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.choices[0].matched_stop == stop
    assert out.text == full_text[: full_text.index(stop)]


def test_streaming_never_shows_a_stop_string(engine):
    full_text, stop = _split_stop(engine)
    chunks = list(engine.stream(PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop=stop))
    streamed = "".join(c.text for c in chunks)
    assert streamed == full_text[: full_text.index(stop)]
    assert chunks[-1].finish_reason == "stop"


def _regex_stop(engine) -> tuple[list[int], int, str]:
    """A greedy answer's ids, the token k whose text completes the only match of a regex built from the
    answer (a match ending one character before that token's end), and the regex."""
    ids = engine.chat(PROMPT, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    text = engine.tokenizer.decode(ids)
    for k in range(2, len(ids)):
        before, through = engine.tokenizer.decode(ids[:k]), engine.tokenizer.decode(ids[: k + 1])
        tail = through[-4:-1]
        if len(through) - len(before) >= 2 and tail.strip() and tail not in before and text.count(tail) == 1:
            return ids, k, rf"zzz\d+|{re.escape(tail)}"
    pytest.skip("no token to build a stop_regex match from")


def test_a_stop_regex_ends_the_answer_at_the_token_completing_its_first_match(engine):
    """As in SGLang: the match stays in the answer (with the rest of the token that completed it), and
    the pattern is what matched."""
    ids, k, pattern = _regex_stop(engine)
    out = engine.chat(PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_regex=[pattern])
    assert out.token_ids == ids[: k + 1]
    assert out.finish_reason == "stop" and out.choices[0].matched_stop == pattern
    assert out.text == engine.tokenizer.decode(ids[: k + 1])
    chunks = list(engine.stream(PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_regex=pattern))
    assert "".join(c.text for c in chunks) == out.text and chunks[-1].finish_reason == "stop"


def test_a_stop_regex_match_before_min_tokens_does_not_end_the_answer_later(engine):
    ids, k, pattern = _regex_stop(engine)
    out = engine.chat(PROMPT, max_tokens=16, temperature=0, ignore_eos=True, stop_regex=pattern, min_tokens=k + 2)
    assert out.token_ids == ids and out.finish_reason == "length"


def test_an_invalid_stop_regex_is_refused_naming_it(engine):
    with pytest.raises(ValueError, match=r"stop_regex '\(a' is not a valid regular expression"):
        engine.chat(PROMPT, max_tokens=4, stop_regex=["ok", "(a"])


def test_a_stop_regex_matches_what_the_new_text_makes():
    """A match counts once: when the text a token adds ends it or completes its look-ahead; matches
    the text had before (during min_tokens) do not count again, and look-behinds see the whole text."""
    assert find_stop_regex("Hello.", [r"[.!?]\s*$"], 1) == r"[.!?]\s*$"
    assert find_stop_regex("Hello. W", [r"[.!?]\s*$"], 2) is None
    assert find_stop_regex("one\ntwo", [r"\n"], 3) is None
    assert find_stop_regex("one\ntwo\n", [r"\n"], 1) == r"\n"
    assert find_stop_regex("the cat dog", [r"cat(?= dog)"], 4) == r"cat(?= dog)"
    assert find_stop_regex("foo bar baz", [r"\w+ \w+"], 4) == r"\w+ \w+"  # overlapping an old match
    assert find_stop_regex("a cat", ["dog", r"\bc\w+"], 2) == r"\bc\w+"
    assert find_stop_regex("x" * 5000 + "ab", [r"(?<=x)ab"], 1) == r"(?<=x)ab"
    # a match starting more than STOP_REGEX_LOOKBACK characters before the new text is not seen
    long = "<a>" + "x" * (STOP_REGEX_LOOKBACK + 10) + "</a>"
    assert find_stop_regex(long, [r"<a>x*</a>"], 1) is None
    assert find_stop_regex("<a>" + "x" * 100 + "</a>", [r"<a>x*</a>"], 1) == r"<a>x*</a>"


def test_stop_token_id_ends_the_answer_without_its_text(engine):
    full = engine.chat(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = engine.chat(PROMPT, max_tokens=8, temperature=0, stop_token_ids=[stop_id])
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.choices[0].matched_stop == stop_id
    assert out.text == engine.tokenizer.decode(full.token_ids[:first])


def test_n_choices_share_the_prompt_and_seeds_reproduce(engine):
    kwargs = dict(max_tokens=8, temperature=1.0, top_k=50, seed=1234, n=3, ignore_eos=True)
    before = engine.scheduler.metrics.cached_prompt_tokens
    out = engine.chat([{"role": "user", "content": "A brand new prompt about n choices " * 4}], **kwargs)
    assert len(out.choices) == 3
    assert len({tuple(c.token_ids) for c in out.choices}) > 1  # seeds seed, seed+1, seed+2 differ
    # choices 2 and 3 waited one round and then reused the first one's prompt KV
    assert engine.scheduler.metrics.cached_prompt_tokens - before >= 2 * (out.prompt_tokens - 1)
    again = engine.chat([{"role": "user", "content": "A brand new prompt about n choices " * 4}], **kwargs)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    kwargs = dict(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    alone = engine.chat(PROMPT, **kwargs)
    together = engine.chat_batch([[{"role": "user", "content": "Hello there"}], PROMPT], **kwargs)
    assert together[1].token_ids == alone.token_ids


def test_in_batch_prefix_caching_defers_a_request_sharing_an_uncached_prefix(engine):
    system = {"role": "system", "content": "A long shared system prompt that nobody has cached yet. " * 3}
    convs = [[system, {"role": "user", "content": q}] for q in ("First question?", "Second question?")]
    outs = engine.chat_batch(convs, max_tokens=4, temperature=0)
    assert outs[1].cached_tokens >= outs[0].cached_tokens + 32


def test_logprobs_of_chosen_tokens_and_alternatives(engine):
    out = engine.chat(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    assert len(choice.logprobs) == len(choice.top_logprobs) == 6
    for token, lp, top in zip(choice.token_ids, choice.logprobs, choice.top_logprobs):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp)
        assert top[0][1] >= top[1][1] >= top[2][1] and lp <= 0
    assert engine.chat(PROMPT, max_tokens=2, temperature=0).choices[0].logprobs is None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 10**6}, "context length"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must"),
        ({"top_logprobs": 3}, "logprobs"),
    ],
)
def test_bad_sampling_values_are_rejected_and_the_engine_keeps_working(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.chat(PROMPT, **kwargs)
    assert engine.chat(PROMPT, max_tokens=2, temperature=0).token_ids


def test_unknown_arguments_are_type_errors(engine, tiny_moe_dir):
    with pytest.raises(TypeError, match="max_new"):
        engine.chat(PROMPT, max_new=3)
    with pytest.raises(TypeError, match="chunk_size"):
        vlm_serve.Engine(model=tiny_moe_dir, chunk_size=3)
    with pytest.raises(ValueError, match="schedule_policy"):
        vlm_serve.Engine(model=tiny_moe_dir, schedule_policy="shortest")


def test_a_rejected_input_in_a_batch_leaves_nothing_queued(engine):
    huge = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(ValueError, match="context length|KV cache"):
        engine.chat_batch([PROMPT, huge], max_tokens=4)
    assert engine.scheduler.is_idle()


@pytest.mark.parametrize("option", ["tp_size", "port", "api_key", "limit_mm_per_prompt", "not_a_setting"])
def test_a_setting_an_engine_cannot_use_is_refused_by_name(tiny_moe_dir, option):
    """The HTTP server's, its requests' limits and multi-rank settings are `vlm-serve serve`'s: an Engine
    refuses them before it loads anything, naming them and the concerns it takes."""
    with pytest.raises(TypeError, match=f"unknown engine option\\(s\\): {option} .*cache and scheduling"):
        vlm_serve.Engine(model=tiny_moe_dir, **{option: 2})


def test_log_line_and_counters(tiny_moe_dir, caplog):
    engine = vlm_serve.Engine(model=tiny_moe_dir, dtype="float32", log_interval=1)
    with caplog.at_level(logging.INFO, logger="vlm_serve.scheduler.stats"):
        engine.chat_batch([PROMPT, PROMPT], max_tokens=5, temperature=0, ignore_eos=True)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("extend batch") for line in lines)
    decode = [line for line in lines if line.startswith("decode batch")]
    assert decode and "KV usage" in decode[0] and "cache hit rate" in decode[0] and "queued" in decode[0]
    m = engine.scheduler.metrics
    assert m.generated_tokens == 10 and m.num_finished == 2
    assert m.time_forward > 0 and m.time_schedule > 0 and m.time_process > 0


def _submit(engine, content: str, max_tokens: int):
    x = engine.processor.process_messages([{"role": "user", "content": content}])
    return engine.submit(x, max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("stage", ["waiting", "chunked", "running"])
def test_abort_at_any_stage_frees_everything(tiny_moe_dir, stage, overlap):
    engine = vlm_serve.Engine(
        model=tiny_moe_dir,
        dtype="float32",
        chunked_prefill_size=8,
        max_running_requests=2,
        disable_overlap_schedule=not overlap,
    )
    scheduler = engine.scheduler
    other = _submit(engine, "A request that keeps running.", 12)
    victim = _submit(engine, "The request that will be aborted, with a prompt long enough to be chunked.", 12)
    third = _submit(engine, "A third one.", 12)  # waits: two rows only
    for _ in range(200):
        engine.step()
        req = scheduler.reqs.get(victim.rids[0])
        if stage == "waiting" and req in scheduler.waiting_queue:
            break
        if stage == "chunked" and scheduler.chunked_req is req:
            break
        if stage == "running" and req in scheduler.running_batch.reqs and len(req.output_ids) > 2:
            break
    else:
        pytest.fail(f"the victim never reached stage {stage}")
    engine.abort(victim, "client went away")
    while not (other.done and victim.done and third.done):
        engine.step()
    aborted = engine.result(victim).choices[0]
    assert aborted.finish_reason == "abort" and aborted.message == "client went away"
    assert len(engine.result(other).token_ids) == len(engine.result(third).token_ids) == 12
    while not scheduler.is_idle():
        engine.step()
    scheduler.check_memory()
    engine.shutdown()


def test_requests_leaving_the_decode_batch_do_not_disturb_the_others(engine):
    """Requests of different lengths finish one by one; the rest keep decoding on the same K/V."""
    prompts = [[{"role": "user", "content": f"Question number {i}: why is the sky blue?"}] for i in range(4)]
    alone = [engine.chat(p, max_tokens=12, temperature=0, ignore_eos=True).token_ids for p in prompts]
    jobs = [
        engine.submit(engine.processor.process_messages(p), max_tokens=3 + 3 * i, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    while not all(job.done for job in jobs):
        engine.step()
    assert [engine.result(job).token_ids for job in jobs] == [a[: 3 + 3 * i] for i, a in enumerate(alone)]
    while not engine.scheduler.is_idle():
        engine.step()


def test_a_repeated_image_skips_preprocessing_and_the_vision_tower(engine):
    """Text before the image keeps the prefix cache from covering it: the embedding cache serves it."""
    encoding, processor = engine.scheduler.encoding, engine.processor
    image = make_image(160, 128, seed=99)

    def ask(question: str):
        content = [{"type": "text", "text": question}, {"type": "image", "image": image}]
        return engine.chat([{"role": "user", "content": content}], max_tokens=4, temperature=0)

    first = ask("First, a question about this picture:")
    assert first.media_timings[0].embedding_source == "encoder" and not first.media_timings[0].processor_cache_hit
    items, embed_hits, pre_hits = encoding.encoder.num_items, encoding.cache.hits, processor.cache.hits
    second = ask("Another, different question:")
    assert encoding.encoder.num_items == items
    assert encoding.cache.hits == embed_hits + 1
    assert processor.cache.hits == pre_hits + 1
    assert second.media_timings[0].embedding_source == "cache" and second.media_timings[0].processor_cache_hit
    with vlm_serve.Engine(model=engine.server_args.model, dtype="float32", mm_cache_mb=0) as fresh:
        content = [{"type": "text", "text": "Another, different question:"}, {"type": "image", "image": image}]
        assert (
            fresh.chat([{"role": "user", "content": content}], max_tokens=4, temperature=0).token_ids
            == second.token_ids
        )


def test_submit_returns_at_once_and_step_drives_it(engine):
    job = engine.submit(engine.processor.process_messages(PROMPT), max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="has not finished"):
        engine.result(job)
    while not job.done:
        engine.step()
    assert engine.result(job).token_ids == engine.chat(PROMPT, max_tokens=3, temperature=0).token_ids


def test_an_engine_shut_down_leaves_its_model_runner_to_one_garbage_collection(tiny_moe_dir):
    """Its model, KV pool and (on CUDA) graphs are device memory: a runner that only a second collection
    frees (here, a cycle through it outlived the first, which ran the scheduler's finalizers) kept a GPU's
    memory from the next engine."""
    engine = vlm_serve.Engine(model=tiny_moe_dir, dtype="float32")
    engine.generate("Count to three:", max_tokens=2)
    runner = weakref.ref(engine.scheduler.runner)
    engine.shutdown()
    gc.collect()
    assert runner() is None


@pytest.mark.server
@pytest.mark.slow
def test_a_script_that_never_shuts_its_engine_down_exits_cleanly(tiny_moe_dir, tmp_path):
    """As most scripts are written: the engine is left to the interpreter's exit. Its forward thread, which
    has run the vision tower, must have ended before the exit tears down the C++ runtime (else, now and
    then, "terminate called without an active exception" and SIGABRT). Eight runs, each must be clean."""
    script = tmp_path / "describe.py"
    script.write_text(
        "from vlm_serve import Engine\n"
        "from vlm_serve.testing.media import make_image\n"
        f"engine = Engine({str(tiny_moe_dir)!r}, dtype='float32')\n"
        "parts = [{'type': 'image', 'image': make_image(64, 64)}, {'type': 'text', 'text': 'Describe.'}]\n"
        "out = engine.chat([{'role': 'user', 'content': parts}], max_tokens=2, ignore_eos=True)\n"
        "print('finish:', out.finish_reason, out.media_timings[0].embedding_source)\n"
    )
    for _ in range(8):
        done = run_process([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert (done.returncode, done.stderr) == (0, "")


def test_an_engine_keeps_what_lives_as_long_as_it_out_of_the_collectors_scans_until_shutdown(tiny_dense_dir):
    """(a decode step's small objects trigger collections; full ones would scan the model, pools and tokenizer
    again each time: benchmarks/bench_host_overhead.py)"""
    with vlm_serve.Engine(model=tiny_dense_dir, vit_dp=0) as engine:
        assert gc.get_freeze_count() > 0
        assert engine.chat(PROMPT, max_tokens=2).text is not None
    assert gc.get_freeze_count() == 0  # given back to the collector
