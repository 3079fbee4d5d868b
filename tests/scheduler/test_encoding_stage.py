"""The encoding stage in front of `waiting_queue`: which items get encoded, the embedding cache and its
pins, errors, and the per-item timings."""

from __future__ import annotations

import dataclasses
import io
import threading

import pytest
import torch

import vlm_serve.vision.encoder as encoder_module
from vlm_serve.config import ModelConfig
from vlm_serve.engine import Engine
from vlm_serve.errors import InternalError
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.multimodal.items import MEDIA_STAGES
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.metrics import Histogram
from vlm_serve.scheduler.schedule_batch import Req
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.encoder import InlineEncoder


def _conv(image, text: str = "Describe.", text_first: bool = False) -> list[dict]:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts[::-1] if text_first else parts}]


@pytest.fixture(scope="module")
def engine(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32") as engine:
        yield engine


# ---- the stage alone -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def make_req(tiny_moe_dir):
    processor = MultimodalProcessor.from_pretrained(tiny_moe_dir, Tokenizer.from_pretrained(tiny_moe_dir))
    vision = ModelConfig.from_pretrained(tiny_moe_dir).vision

    def make(seed: int) -> Req:
        x = processor.process_messages(_conv(make_image(128, 128, seed=seed)))
        req = Req(f"r{seed}", x.input_ids, SamplingParams(), x.mm_items)
        req.init_positions(vision)
        return req

    return make


def test_a_tiny_cache_evicts_unpinned_entries_only(tiny_moe_dir, make_req):
    visual = load_vision_model(ModelConfig.from_pretrained(tiny_moe_dir), torch.device("cpu"), torch.float32)
    probe = make_req(0)
    entry = EncodingStage(InlineEncoder(visual, 10**9), 10**9)
    entry.add(probe, 0)
    entry.poll()
    size = probe.mm_embeds[0].nbytes
    stage = EncodingStage(InlineEncoder(visual, 10**9), 3 * size)  # room for three entries

    held = make_req(1)  # ready, not yet prefilled: its entry is pinned
    assert stage.add(held, 0)  # it waits for its embeddings
    assert stage.poll() == ([held], [])
    for seed in range(2, 9):  # requests that come and finish their prefill
        req = make_req(seed)
        stage.add(req, 0)
        assert stage.poll() == ([req], [])
        stage.release(req)
        assert stage.cache.usage_bytes <= stage.cache.budget_bytes
        assert held.mm_items[0].hash in stage.cache
    assert stage.cache.evictions >= 4
    stage.release(held)  # its prefill is done: now it may go
    for seed in range(9, 12):
        req = make_req(seed)
        stage.add(req, 0)
        stage.poll()
        stage.release(req)
    assert held.mm_items[0].hash not in stage.cache


def test_an_item_the_encoder_rejects_fails_only_its_request(tiny_moe_dir, monkeypatch):
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0) as engine:
        good, bad = (engine.processor.process_messages(_conv(make_image(64 * k, 64, seed=k))) for k in (1, 2))
        encode = encoder_module.encode_in_passes

        def fail_on_the_bad_grid(visual, pixels, grids, max_patches, slots=None):
            if bad.mm_items[0].grid_thw in grids:
                raise RuntimeError("out of memory")
            return encode(visual, pixels, grids, max_patches, slots)

        monkeypatch.setattr(encoder_module, "encode_in_passes", fail_on_the_bad_grid)
        ok, failed = (engine.submit(x, max_tokens=3, temperature=0) for x in (good, bad))
        while not (ok.done and failed.done and engine.scheduler.is_idle()):
            engine.step()
        assert engine.result(ok).finish_reason in ("stop", "length")
        with pytest.raises(InternalError) as raised:  # the server's failure (a 500), not an answer
            engine.result(failed)
        assert raised.value.code == "encoder_error"
        assert (
            raised.value.message == "image 0 of the request could not be encoded: "
            "the vision encoder failed on this item: out of memory"
        )
        engine.scheduler.check_memory()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_a_picture_arriving_while_requests_run_is_encoded_beside_them_on_its_share_of_the_cores(
    tiny_moe_dir, overlap, monkeypatch
):
    """On CPU the tower of `--vit-dp 0` encodes a picture that arrives while requests decode on a thread
    of its own, with half the threads, while the decoding goes on with the other half (here: while the
    encode is held back, the running request gets tokens); the answer is the one an idle engine gives."""
    if torch.get_num_threads() < 2:
        pytest.skip("sharing the cores needs at least 2 torch threads; this process has 1")
    picture = _conv(make_image(96, 64, seed=9))
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0, disable_overlap_schedule=not overlap) as engine:
        alone = engine.chat(picture, max_tokens=6, temperature=0).token_ids  # encoded with the LLM idle
        assert engine.scheduler.flush_cache().success  # (the picture is encoded again)
        encoder = engine.scheduler.encoding.encoder
        cores = encoder.cores
        threads = torch.get_num_threads()
        assert (cores.total, cores.aside) == (threads, threads // 2)
        held, seen = threading.Event(), []
        encode = encoder_module.encode_tasks

        def held_encode(visual, tasks, max_patches):
            seen.append((threading.current_thread().name, torch.get_num_threads(), cores.llm_threads()))
            assert held.wait(60), "the running request got no tokens while the picture was encoded"
            return encode(visual, tasks, max_patches)

        text = engine.processor.process_messages([{"role": "user", "content": "Count to a hundred."}])
        running = engine.submit(text, max_tokens=200, temperature=0, ignore_eos=True)
        engine.step()
        decoding = engine.scheduler.reqs[running.rids[0]]
        while len(decoding.output_ids) < 2:
            engine.step()
        monkeypatch.setattr(encoder_module, "encode_tasks", held_encode)
        try:
            late = engine.submit(engine.processor.process_messages(picture), max_tokens=6, temperature=0)
            while not seen:
                engine.step()
            before = len(decoding.output_ids)
            for _ in range(8):
                engine.step()
            grew = len(decoding.output_ids) - before
            held.set()
            while not late.done:
                engine.step()
        finally:
            held.set()  # (a failing test leaves no encode waiting)
        assert grew > 0
        assert seen[0][0].startswith("vit") and seen[0][1:] == (threads // 2, threads - threads // 2)
        assert engine.result(late).token_ids == alone
        assert cores.llm_threads() == threads
        engine.abort(running)
        while not engine.scheduler.is_idle():
            engine.step()
        engine.scheduler.check_memory()


def test_pixel_values_that_do_not_fit_the_grid_are_rejected(engine):
    x = engine.processor.process_messages(_conv(make_image(64, 64)))
    item = x.mm_items[0]
    item.pixels = dataclasses.replace(item.pixels, data=item.pixels.data[:-1])
    with pytest.raises(ValueError, match=r"pixel values of shape .* do not match its grid"):
        engine.generate_processed([x], max_tokens=1)


# ---- through the engine ----------------------------------------------------------------------------


def test_an_image_the_prefix_cache_covers_is_not_encoded(engine):
    conv = _conv(make_image(96, 96, seed=31))
    first = engine.chat(conv, max_tokens=3, temperature=0)
    items = engine.scheduler.encoding.encoder.num_items
    again = engine.chat(conv, max_tokens=3, temperature=0)
    assert again.token_ids == first.token_ids
    assert again.media_timings[0].embedding_source == "prefix"
    assert engine.scheduler.encoding.encoder.num_items == items


def test_a_request_whose_prefix_was_evicted_goes_back_to_the_encoder(tiny_moe_dir):
    """Covered when it arrived, gone from the prefix cache when admitted: it is encoded then."""
    conv = _conv(make_image(96, 96, seed=32))
    with Engine(tiny_moe_dir, dtype="float32", mm_cache_mb=0) as engine:
        first = engine.chat(conv, max_tokens=3, temperature=0)
        scheduler, encoder = engine.scheduler, engine.scheduler.encoding.encoder
        x = engine.processor.process_messages(conv)
        req = Req("late", x.input_ids, engine.sampling_params(max_tokens=3, temperature=0), x.mm_items)
        scheduler.add_request(req)
        assert req.mm_items[0].timings.embedding_source == "prefix" and req in scheduler.waiting_queue
        items = encoder.num_items
        scheduler.tree_cache.evict(scheduler.max_total_tokens)
        while not req.finished:
            engine.step()
        assert req.output_ids == first.token_ids
        assert encoder.num_items == items + 1
        scheduler.check_memory()


def test_media_timings_show_where_the_time_went(engine):
    buffer = io.BytesIO()
    make_image(200, 150, seed=33).save(buffer, format="PNG")
    metrics = engine.scheduler.metrics
    counted = metrics.media_items
    new = engine.chat(_conv(buffer.getvalue(), "First question."), max_tokens=2, temperature=0).media_timings[0]
    assert all(getattr(new, stage) > 0 for stage in MEDIA_STAGES if stage != "encoder_wait")
    assert new.encoder_wait >= 0 and not new.processor_cache_hit and new.embedding_source == "encoder"
    # asked again after other text: both multimodal caches serve it, nothing is decoded or encoded
    seen = engine.chat(_conv(buffer.getvalue(), "Second.", text_first=True), max_tokens=2, temperature=0)
    timings = seen.media_timings[0]
    assert timings.processor_cache_hit and timings.embedding_source == "cache"
    assert timings.decode == timings.preprocess == timings.vit == 0 and timings.hash > 0
    assert metrics.media_items == counted + 2
    assert all(h.count == metrics.media_items for h in metrics.media_seconds.values())


def test_with_a_1_mb_cache_usage_stays_under_budget_and_pinned_entries_stay(tiny_moe_dir):
    """Twelve 448x448 images (about 150 KB of embeddings each) in three waves through a 1 MiB embedding
    cache: entries pinned by requests not yet prefilled stay, the others are evicted for new ones."""
    convs = [_conv(make_image(448, 448, seed=100 + i)) for i in range(12)]
    with Engine(tiny_moe_dir, dtype="float32", mm_cache_mb=1, max_running_requests=4) as engine:
        scheduler, cache = engine.scheduler, engine.scheduler.encoding.cache
        iteration = scheduler.run_iteration

        def checked_iteration():
            iteration()
            assert cache.usage_bytes <= cache.budget_bytes == 2**20
            held = [key for req in scheduler.reqs.values() for key in req.mm_pins]
            assert all(key in cache for key in held)

        scheduler.run_iteration = checked_iteration
        outs = [o for wave in range(3) for o in engine.chat_batch(convs[4 * wave : 4 * wave + 4], max_tokens=2)]
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        assert cache.evictions > 0 and len(cache) <= 6
        assert not any(req.mm_pins for req in scheduler.reqs.values())
        scheduler.check_memory()


def test_a_histogram_counts_each_value_in_the_first_bucket_it_fits():
    histogram = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0):
        histogram.observe(value)
    assert histogram.counts == [2, 1, 1]  # <= 0.1, <= 1.0, above
    assert histogram.count == 4 and histogram.sum == pytest.approx(2.65)
