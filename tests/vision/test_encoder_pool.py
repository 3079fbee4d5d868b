"""The encoder pool: ranks in their own processes give the single-process tower's embeddings, share
work by patch count, encode a repeated image once, and survive a rank being killed."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from helpers import run_process
from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.engine import Engine
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.multimodal.items import MultimodalItem
from vlm_serve.multimodal.pixels import PatchPixels
from vlm_serve.multimodal.processor import MultimodalProcessor
from vlm_serve.process import llm_threads
from vlm_serve.scheduler.schedule_batch import Req
from vlm_serve.testing.media import make_image, make_video
from vlm_serve.tokenizer import Tokenizer
from vlm_serve.vision import pool as encoder_pool
from vlm_serve.vision.encoder import EncodeResult, EncodeTask, VisionEncoder, encode_tasks
from vlm_serve.vision.pool import EncoderConcerns, EncoderPool

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def media(tiny_moe_dir, tmp_path_factory) -> list[MultimodalItem]:
    """Three images of different sizes and an 8-group video."""
    processor = MultimodalProcessor.from_pretrained(tiny_moe_dir, Tokenizer.from_pretrained(tiny_moe_dir))
    video = make_video(tmp_path_factory.mktemp("v") / "clip.mp4", num_frames=16, fps=4, size=(64, 96))
    content = [
        {"type": "image", "image": make_image(96, 64, seed=1)},
        {"type": "video", "video": str(video)},
        {"type": "image", "image": make_image(160, 128, seed=2)},
        {"type": "image", "image": make_image(32, 32, seed=3)},
        {"type": "text", "text": "Describe."},
    ]
    return processor.process_messages([{"role": "user", "content": content}]).mm_items


def _tasks(items: list[MultimodalItem]) -> list[EncodeTask]:
    return [EncodeTask(it.hash, it.grid_thw, it.pixels) for it in items]


def _encode_all(encoder: VisionEncoder, items: list[MultimodalItem]) -> dict[int, EncodeResult]:
    encoder.submit(_tasks(items))
    results: dict[int, EncodeResult] = {}
    deadline = time.monotonic() + 120
    while len(results) < len(items) and time.monotonic() < deadline:
        results.update((r.key, r) for r in encoder.poll(timeout=0.1))
    assert len(results) == len(items), "the encoder did not answer"
    return results


def _wait_until_ready(pool: EncoderPool) -> None:
    deadline = time.monotonic() + 120
    while not all(r.ready for r in pool.ranks) and time.monotonic() < deadline:
        pool.poll(timeout=0.1)
    assert all(r.ready for r in pool.ranks)
    assert all(p.is_alive() for p in pool.supervisor.processes)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-5 * b.abs().max())


@pytest.mark.server
def test_one_and_two_ranks_give_the_single_process_embeddings(tiny_moe_dir, media):
    visual = load_vision_model(ModelConfig.from_pretrained(tiny_moe_dir), CPU, torch.float32)
    reference = {r.key: r.output for r in encode_tasks(visual, _tasks(media), 10**9)}
    for dp in (1, 2):
        pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=dp)), CPU)
        processes = pool.supervisor.processes
        try:
            results = _encode_all(pool, media)
        finally:
            pool.shutdown()
        assert not any(p.is_alive() for p in processes)
        for key, result in results.items():
            assert result.error is None and result.vit > 0 and result.wait >= 0
            ours, ref = result.output, reference[key]
            assert _close(ours.embeds, ref.embeds)
            assert len(ours.deepstack) == len(ref.deepstack) > 0
            assert all(_close(a, b) for a, b in zip(ours.deepstack, ref.deepstack))
        ranks = {r.rank for r in results.values()}
        assert ranks == set(range(dp))


@pytest.mark.server
def test_work_is_balanced_by_patch_count_not_item_count(tiny_moe_dir):
    """A 512-patch video outweighs three 64-patch images together: it gets a rank to itself."""
    grids = [(8, 8, 8), (1, 8, 8), (1, 8, 8), (1, 8, 8)]
    gen = torch.Generator().manual_seed(0)
    items = [
        MultimodalItem("video" if t > 1 else "image", torch.randn(t * h * w, 1536, generator=gen), (t, h, w), hash=i)
        for i, (t, h, w) in enumerate(grids)
    ]
    pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=2)), CPU)
    try:
        results = _encode_all(pool, items)
    finally:
        pool.shutdown()
    ranks = [results[i].rank for i in range(4)]
    assert ranks.count(ranks[0]) == 1 and len(set(ranks)) == 2


@pytest.mark.server
def test_a_rank_killed_mid_run_is_restarted_and_its_requests_complete(tiny_moe_dir):
    images = [make_image(64 + 32 * i, 96, seed=10 + i) for i in range(6)]
    convs = [
        [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": "Describe."}]}]
        for im in images
    ]
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=0) as inline:
        expected = [o.token_ids for o in inline.chat_batch(convs, max_tokens=4, temperature=0, ignore_eos=True)]

    with Engine(tiny_moe_dir, dtype="float32", vit_dp=2) as engine:
        scheduler, pool = engine.scheduler, engine.scheduler.encoding.encoder
        params = engine.sampling_params(max_tokens=4, temperature=0, ignore_eos=True)
        reqs = []
        for i, conv in enumerate(convs):
            x = engine.processor.process_messages(conv)
            reqs.append(Req(f"r{i}", x.input_ids, params, x.mm_items))
            scheduler.add_request(reqs[-1])
        scheduler.process_encoding_results()  # hands the six images to the ranks
        assert pool.ranks[0].jobs  # it holds some of the images
        os.kill(pool.ranks[0].pid, signal.SIGKILL)
        while not all(r.finished for r in reqs):
            engine.step()
        assert [r.output_ids for r in reqs] == expected
        _wait_until_ready(pool)
        assert pool.num_restarts == 1
        _wait_until_ready(pool)
        assert len(pool.ranks) == 2
        scheduler.check_memory()


@pytest.mark.server
def test_a_task_whose_ranks_keep_dying_comes_back_as_an_error(tiny_moe_dir, media):
    """Killed while encoding it, twice: the task is given up (a rank that never began a job is not
    charged for it), and the pool still works."""
    pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=1)), CPU)
    try:
        grid = (4, 64, 64)  # a second or so of encoding
        pool.submit(
            [
                EncodeTask(
                    7, grid, PatchPixels(torch.randn(4 * 64 * 64, 1536, generator=torch.Generator().manual_seed(0)))
                )
            ]
        )
        results = []
        for attempt in range(2):
            deadline = time.monotonic() + 120
            while not pool.ranks[0].started and time.monotonic() < deadline:  # (restarted, and) on it
                results += pool.poll(timeout=0.05)
            os.kill(pool.ranks[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pool.ranks[0].ready and time.monotonic() < deadline:  # until its death is noticed
                results += pool.poll(timeout=0.1)
        while not results and time.monotonic() < deadline:
            results += pool.poll(timeout=0.1)
        assert len(results) == 1 and results[0].output is None
        assert "encoder ranks died 2 times" in results[0].error
        _wait_until_ready(pool)  # and the pool still works
        assert pool.num_restarts == 2
        assert _encode_all(pool, media[:1])[media[0].hash].error is None
    finally:
        pool.shutdown()


@pytest.mark.server
def test_a_pool_shut_down_while_its_ranks_read_their_jobs_says_nothing(tiny_moe_dir, capfd):
    """A rank reading a job fetches its pixels' file descriptors from this process (multiprocessing's
    resource sharer): stopped in the middle, it left this process printing the broken handshake."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=2)), CPU)
        pool.submit([EncodeTask(k, (1, 8, 8), PatchPixels(torch.randn(64, 1536, generator=gen))) for k in range(8)])
        pool.shutdown()
    assert capfd.readouterr().err == ""


@pytest.mark.server
def test_a_hung_rank_is_killed_and_replaced(tiny_moe_dir, media, monkeypatch):
    monkeypatch.setattr(encoder_pool, "STALL_TIMEOUT", 1.0)
    pool = EncoderPool.start(EncoderConcerns.of(ServerArgs(model=str(tiny_moe_dir), vit_dp=1)), CPU)
    try:
        os.kill(pool.ranks[0].pid, signal.SIGSTOP)  # alive, but never answers
        assert _encode_all(pool, media[:1])[media[0].hash].error is None
        assert pool.num_restarts == 1
    finally:
        pool.shutdown()


def test_two_concurrent_requests_with_one_new_image_encode_it_once(tiny_moe_dir):
    image = make_image(128, 96, seed=42)
    convs = [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
        for question in ("What is this?", "Which colours do you see?")
    ]
    with Engine(tiny_moe_dir, dtype="float32") as engine:
        encoder = engine.scheduler.encoding.encoder
        outs = engine.chat_batch(convs, max_tokens=3, temperature=0)
        assert encoder.num_items == 1
        assert [o.media_timings[0].embedding_source for o in outs] == ["encoder", "encoder"]


@pytest.mark.server
def test_an_engine_beside_an_encoder_pool_gives_the_process_its_threads_back_at_shutdown(tiny_moe_dir):
    """Its LLM computes with the cores the pool's ranks leave; afterwards the process has them all again
    (else every engine and torch op after it in the process ran on fewer cores)."""
    before = torch.get_num_threads()
    with Engine(tiny_moe_dir, dtype="float32", vit_dp=1) as engine:
        assert torch.get_num_threads() == llm_threads(engine.server_args)
    assert torch.get_num_threads() == before


@pytest.mark.server
@pytest.mark.slow
def test_a_script_without_a_main_guard_can_start_the_pool(tiny_moe_dir, tmp_path):
    """Spawned ranks do not re-run the user's script (which would start engines recursively)."""
    script = tmp_path / "caption.py"
    script.write_text(
        "from vlm_serve import Engine\n"
        "from vlm_serve.testing.media import make_image\n"
        f"engine = Engine({str(tiny_moe_dir)!r}, dtype='float32', vit_dp=1)\n"
        "parts = [{'type': 'image', 'image': make_image(64, 64)}, {'type': 'text', 'text': 'Describe.'}]\n"
        "out = engine.chat([{'role': 'user', 'content': parts}], max_tokens=2, ignore_eos=True)\n"
        "print('finish:', out.finish_reason, out.media_timings[0].embedding_source)\n"
    )
    done = run_process([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("finish:") == 1 and "finish: length encoder" in done.stdout
