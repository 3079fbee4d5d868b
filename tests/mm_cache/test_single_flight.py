"""Single flight: an image or video that many requests want at once is preprocessed once (in the HTTP
process's threads) and run through a vision tower once (by the encoder pool, the inline tower, or rank 0
of a TP group); the requests that waited for it are counted as in-flight hits, not as cache misses."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.engine import Engine, _QueueIO
from vlm_serve.errors import MediaError
from vlm_serve.llm.model_runner import ModelRunner, RunnerConcerns
from vlm_serve.messages.backend import BatchTokenIdOut, TokenizedGenerateReq
from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.scheduler.concerns import SchedulerConcerns
from vlm_serve.scheduler.scheduler import Scheduler
from vlm_serve.testing.media import make_image
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision.pool import EncoderConcerns, create_encoder

SAFETY_WAIT = 60.0  # seconds a held computation waits for the others to queue behind it, at most


def conversation(image: Any, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def hold_until(condition) -> None:
    """Blocks a computation until `condition()` holds (bounded, so a broken build fails instead of hanging)."""
    deadline = time.monotonic() + SAFETY_WAIT
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


# ---- the processed-input cache, shared by threads ----------------------------------------------------


@pytest.mark.parametrize("budget", [1 << 20, 0], ids=["stored", "not-stored"])
def test_threads_asking_for_a_key_being_computed_wait_for_that_computation(budget):
    cache: MultimodalCache[str] = MultimodalCache(budget)
    n, calls = 6, []

    def compute() -> str:
        calls.append(1)
        hold_until(lambda: cache.inflight_hits == n - 1)
        return "value"

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: cache.get_or_compute(7, compute, len), range(n)))
    assert len(calls) == 1
    assert sorted(results) == [("value", False)] * (n - 1) + [("value", True)]
    assert (cache.misses, cache.inflight_hits, cache.hits) == (1, n - 1, 0)
    assert len(cache) == (1 if budget else 0)


def test_threads_waiting_for_a_computation_that_fails_get_its_error_and_a_later_call_computes_again():
    cache: MultimodalCache[str] = MultimodalCache(1 << 20)
    n, calls = 4, []

    def compute() -> str:
        calls.append(1)
        hold_until(lambda: cache.inflight_hits == n - 1)
        raise MediaError("cannot decode the image")

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(cache.get_or_compute, 7, compute, len) for _ in range(n)]
    errors = [f.exception() for f in futures]
    assert len(calls) == 1
    assert all(isinstance(e, MediaError) and "cannot decode" in str(e) for e in errors)
    assert cache.get_or_compute(7, lambda: "fixed", len) == ("fixed", True)  # a failure is not remembered


def test_concurrent_first_requests_for_one_image_preprocess_it_once(tiny_moe_dir, monkeypatch):
    tokenizer = Tokenizer.from_pretrained(tiny_moe_dir)
    processor = MultimodalProcessor.from_pretrained(tiny_moe_dir, tokenizer, cache_mb=64)
    n, calls = 8, []
    real_preprocess = processor.image_processor.preprocess

    def held_preprocess(*args, **kwargs):
        calls.append(1)
        hold_until(lambda: processor.cache.inflight_hits == n - 1)  # every other thread is waiting for it
        return real_preprocess(*args, **kwargs)

    monkeypatch.setattr(processor.image_processor, "preprocess", held_preprocess)
    url = png_data_url(make_image(120, 90, seed=31))
    with ThreadPoolExecutor(n) as pool:  # as the HTTP server's --tokenizer-workers threads
        outs = list(pool.map(lambda i: processor.process_messages(conversation(url, f"Request {i}.")), range(n)))
    assert len(calls) == 1
    cache = processor.cache
    assert (cache.misses, cache.inflight_hits, cache.hits) == (1, n - 1, 0)
    assert sorted(o.mm_items[0].timings.processor_cache_hit for o in outs) == [False] + [True] * (n - 1)
    reference = MultimodalProcessor.from_pretrained(tiny_moe_dir, tokenizer).process_messages(conversation(url))
    for out in outs:
        item = out.mm_items[0]
        assert item.hash == reference.mm_items[0].hash and item.grid_thw == reference.mm_items[0].grid_thw
        assert torch.equal(item.pixel_values, reference.mm_items[0].pixel_values)
    assert len({id(o.mm_items[0].timings) for o in outs}) == n  # each request keeps its own timings


# ---- the encoding stage: pool and inline tower ---------------------------------------------------------


@pytest.fixture(scope="module", params=[0, pytest.param(1, marks=pytest.mark.server)], ids=["inline", "pool"])
def engine(request, tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=request.param) as engine:
        yield engine


def stage_counts(engine: Engine) -> dict[str, int]:
    stage = engine.scheduler.encoding
    return {
        "vit": stage.encoder.num_items,
        "misses": stage.cache.misses,
        "hits": stage.cache.hits,
        "inflight": stage.inflight_hits,
    }


def counts_since(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in stage_counts(engine).items()}


def test_requests_submitted_together_with_one_new_image_run_the_tower_once(engine):
    n = 12
    image = make_image(112, 80, seed=41)
    before = stage_counts(engine)
    outs = engine.chat_batch([conversation(image)] * n, max_tokens=3, temperature=0)
    assert counts_since(engine, before) == {"vit": 1, "misses": 1, "hits": 0, "inflight": n - 1}
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.media_timings[0].embedding_source == "encoder" for o in outs)


def test_requests_arriving_while_their_image_is_encoded_wait_for_that_encode(engine, monkeypatch):
    n = 6
    encoder, stage = engine.scheduler.encoding.encoder, engine.scheduler.encoding
    held, release = [], []
    real_poll = encoder.poll

    def poll(timeout: float = 0.0, llm_busy: bool = False):  # results kept back until `release`: still in flight
        held.extend(real_poll(timeout, llm_busy))
        if not release:
            return []
        results = list(held)
        held.clear()
        return results

    monkeypatch.setattr(encoder, "poll", poll)
    image = make_image(96, 112, seed=43)
    inputs = [engine.processor.process_messages(conversation(image), add_generation_prompt=True) for _ in range(n)]
    key = inputs[0].mm_items[0].hash
    before = stage_counts(engine)
    first = engine.submit(inputs[0], max_tokens=3, temperature=0)
    engine.step()
    assert key in stage.inflight
    later = [engine.submit(x, max_tokens=3, temperature=0) for x in inputs[1:]]
    engine.step()
    assert len(stage.inflight[key]) == n and len(stage) == n
    release.append(True)
    submissions = [first, *later]
    while not all(s.done for s in submissions):
        engine.step()
    outs = [engine.result(s) for s in submissions]
    assert counts_since(engine, before) == {"vit": 1, "misses": 1, "hits": 0, "inflight": n - 1}
    assert len({tuple(o.token_ids) for o in outs}) == 1


# ---- tensor parallelism: rank 0 encodes once, every rank gets the embeddings --------------------------

TP_REQUESTS = 5
TP_TOKENS = 4
TP_ITERATIONS = TP_TOKENS + 6  # every rank runs the same number of loop iterations; the last ones idle


def _run_same_image(model_dir: str, tp_size: int) -> dict[str, Any]:
    """TP_REQUESTS requests with one image, all at once: rank 0's stage counters and everyone's tokens."""
    config = ModelConfig.from_pretrained(model_dir)
    args = ServerArgs(model=model_dir, tp_size=tp_size, max_total_tokens=2048, vit_dp=0, disable_overlap_schedule=True)
    runner = ModelRunner(RunnerConcerns.of(args), config)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    processor = MultimodalProcessor.from_pretrained(model_dir, tokenizer, cache_mb=64)
    params = SamplingParams(max_new_tokens=TP_TOKENS, temperature=0, ignore_eos=True)
    image = make_image(96, 96, seed=47)
    io = _QueueIO()  # read by rank 0 only; the others get its requests by broadcast
    io.inbox.extend(
        TokenizedGenerateReq(f"r{i}", x.input_ids, params, x.mm_items)
        for i, x in enumerate(processor.process_messages(conversation(image)) for _ in range(TP_REQUESTS))
    )
    rank_0 = not dist.is_initialized() or dist.get_rank() == 0
    encoder = create_encoder(EncoderConcerns.of(args), config, runner.device) if rank_0 else None  # as in the server
    scheduler = Scheduler(SchedulerConcerns.of(args), runner, tokenizer, encoder, io)
    for _ in range(TP_ITERATIONS):
        scheduler.run_iteration()
    stage = scheduler.encoding
    counts = (stage.encoder.num_items, stage.cache.misses, stage.inflight_hits) if stage.encoder is not None else None
    scheduler.shutdown()
    tokens: dict[str, list[int]] = {}
    for message in io.outbox:
        if isinstance(message, BatchTokenIdOut):
            for out in message.outs:
                tokens.setdefault(out.rid, []).extend(out.new_ids)
    return {"counts": counts, "tokens": tokens}


def _tp_worker(rank: int, port: int, model_dir: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = _run_same_image(model_dir, 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.server
@pytest.mark.slow
def test_with_two_tp_ranks_rank_0_encodes_the_shared_image_once(tiny_moe_dir):
    reference = _run_same_image(str(tiny_moe_dir), 1)
    assert reference["counts"] == (1, 1, TP_REQUESTS - 1)
    results = mp.Manager().dict()
    mp.spawn(_tp_worker, args=(free_port(), str(tiny_moe_dir), results), nprocs=2)
    assert results[0]["counts"] == (1, 1, TP_REQUESTS - 1)
    assert results[1]["counts"] is None  # only rank 0 has an encoder
    assert results[0]["tokens"] == reference["tokens"]
    assert all(len(t) == TP_TOKENS for t in reference["tokens"].values())


# ---- through a real server ---------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.mark.server
def test_40_concurrent_requests_with_one_new_image_run_the_vision_tower_once(server):
    n = 40
    url = png_data_url(make_image(160, 120, seed=53))
    before = scrape(server.url)

    async def one(http: httpx.AsyncClient, model: str) -> str:
        body = {
            "model": model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ],
            "max_tokens": 3,
            "temperature": 0,
        }
        response = await http.post(server.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            model = (await http.get(server.url + "/v1/models")).json()["data"][0]["id"]
            return await asyncio.gather(*(one(http, model) for _ in range(n)))

    answers = asyncio.run(run())
    after = scrape(server.url)

    def delta(name: str) -> float:
        return after[f"vlm_serve:{name}_total"] - before[f"vlm_serve:{name}_total"]

    assert len(set(answers)) == 1
    assert delta("vit_items") == 1
    assert delta("processor_cache_misses") == 1
    assert delta("processor_cache_hits") + delta("processor_cache_inflight_hits") == n - 1
    assert delta("embedding_cache_misses") == 1
    # the others waited for the encode, found its embeddings cached, or (later) their prefix in the KV cache
    assert delta("embedding_cache_hits") + delta("embedding_cache_inflight_hits") <= n - 1
