"""The target deployment on CPU: an encoder pool beside tensor- and expert-parallel ranks
(`--tp-size 2 --ep-size 2 --vit-dp 2`), on one launch and on two launches over loopback (`--nnodes 2`),
driven through the real server with the `openai` client. Concurrent text, image, repeated image, video
and image + video requests get exactly the one-rank greedy answers; an encoder rank killed under load
is replaced and every request still completes; SIGTERM leaves no process behind."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ServerProcess, descendants, free_port, process_name, spawn_serve, start_server, survivors
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image, make_video

pytestmark = pytest.mark.server  # every test here starts a real server

MAX_TOKENS = 8
DEPLOYMENT = ("--tp-size", "2", "--ep-size", "2", "--vit-dp", "2")


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _ask(*parts: dict, text: str) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    make_video(folder / "clip.mp4", num_frames=8, fps=4, size=(64, 48), seed=5)
    return folder


@pytest.fixture(scope="module")
def conversations(media_dir: Path) -> list[list[dict]]:
    cat, dog = _data_url(make_image(160, 96, seed=1)), _data_url(make_image(96, 128, seed=2))
    video = {"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}}
    return [
        [{"role": "user", "content": "Tell me about the sea."}],
        _ask({"type": "image_url", "image_url": {"url": cat}}, text="What is in the picture?"),
        _ask({"type": "image_url", "image_url": {"url": cat}}, text="And its colours?"),  # a repeated image
        _ask({"type": "image_url", "image_url": {"url": dog}}, text="Describe it."),
        _ask(video, text="What happens in the clip?"),
        _ask({"type": "image_url", "image_url": {"url": dog}}, video, text="Is the picture from the clip?"),
    ]


@pytest.fixture(scope="module")
def expected(tiny_moe_dir: Path, conversations: list[list[dict]]) -> list[str]:
    """One rank's greedy answers, each request alone."""
    with Engine(tiny_moe_dir, vit_dp=0) as engine:
        return [engine.chat(c, max_tokens=MAX_TOKENS, temperature=0).text for c in conversations]


def _answers(server: ServerProcess, conversations: list[list[dict]]) -> list[str]:
    """Every conversation sent at once; the answers in order."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def chat(messages: list[dict]) -> str:
        out = client.chat.completions.create(model=None, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content

    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(chat, conversations))


def _metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("vlm_serve:" + name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_tp2_ep2_with_a_pool_of_two_answers_as_one_rank_and_survives_a_killed_encoder_rank(
    tiny_moe_dir, media_dir, conversations, expected
):
    server = start_server(tiny_moe_dir, *DEPLOYMENT, "--allowed-local-media-path", str(media_dir))
    children = descendants(server.process.pid)
    names = sorted(process_name(pid) for pid in children)
    assert {"vlm-scheduler-0", "vlm-scheduler-1", "vlm-encoder-0", "vlm-encoder-1", "vlm-detokenizer"} <= set(names)
    assert _answers(server, conversations) == expected

    # new images (nothing cached), and encoder rank 0 killed while it holds some of them
    fresh = [
        _ask(
            {"type": "image_url", "image_url": {"url": _data_url(make_image(320, 256 + 32 * i, seed=40 + i))}},
            text="Describe.",
        )
        for i in range(8)
    ]
    with Engine(tiny_moe_dir, vit_dp=0) as engine:
        fresh_expected = [engine.chat(c, max_tokens=MAX_TOKENS, temperature=0).text for c in fresh]
    victim = next(pid for pid in children if process_name(pid) == "vlm-encoder-0")
    os.kill(victim, signal.SIGSTOP)  # it takes jobs but never answers
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(_answers, server, fresh)
        while _metric(server, 'encoder_load_patches{rank="0"}') == 0:
            assert not answers.done(), "rank 0 was never given work"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        assert answers.result() == fresh_expected
    deadline = time.monotonic() + 60  # the launcher replaces the rank
    while _metric(server, "encoder_restarts_total") < 1:
        assert time.monotonic() < deadline, "encoder rank 0 was not restarted"
        time.sleep(0.2)
    assert _answers(server, conversations[1:2]) == expected[1:2]

    everything = descendants(server.process.pid)
    assert server.stop() == 0, "".join(server.output)
    assert survivors(everything, timeout=20) == []


def test_two_nodes_over_loopback_answer_as_one_rank_and_stop_together(tiny_moe_dir, media_dir, conversations, expected):
    init = f"127.0.0.1:{free_port()}"
    nodes = ("--nnodes", "2", "--dist-init-addr", init)
    other = spawn_serve(tiny_moe_dir, *DEPLOYMENT, *nodes, "--node-rank", "1")
    server = start_server(
        tiny_moe_dir, *DEPLOYMENT, *nodes, "--node-rank", "0", "--allowed-local-media-path", str(media_dir)
    )
    assert any("node 1 ready" in line for line in other.output)
    assert [process_name(pid) for pid in descendants(other.process.pid)].count("vlm-scheduler-1") == 1
    assert not any(process_name(pid).startswith("vlm-scheduler-1") for pid in descendants(server.process.pid))
    assert _answers(server, conversations) == expected

    everything = descendants(server.process.pid) + descendants(other.process.pid)
    assert server.stop() == 0, "".join(server.output)
    other.process.wait(60)  # its rank loses node 0 and stops; then the node does
    assert survivors(everything, timeout=20) == []
