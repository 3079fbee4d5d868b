"""Every scheduler path on a 4-bit base (llm-compressor's W4A16 of the tiny MoE, and its W8A8): the normal and
overlap loops, chunked prefill on pages, the prefix cache and its host-memory tier, n-gram drafts and a
float EAGLE-3 draft head, a LoRA adapter over the quantized layers, and a prefill/decode pair all give the
greedy tokens the plain overlap loop gives.

The checkpoints are made by llm-compressor in a process of its own: these tests are marked `server`."""

from __future__ import annotations

import pytest

from pd_loopback import PDPair
from vlm_serve.engine import Engine
from vlm_serve.testing.lora_adapter import make_adapter
from vlm_serve.testing.media import make_image

pytestmark = pytest.mark.server

TEXT = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]
PICTURE = [
    {
        "role": "user",
        "content": [{"type": "image", "image": make_image(96, 64, seed=1)}, {"type": "text", "text": "Describe it."}],
    }
]
PATHS = {
    "normal loop": {"disable_overlap_schedule": True},
    "chunks of 8 on pages of 4": {"chunked_prefill_size": 8, "page_size": 4},
    "host-memory tier": {"enable_hierarchical_cache": True, "max_total_tokens": 1024, "hicache_ratio": 4},
    "n-gram drafts": {"speculative_algorithm": "ngram"},
    "EAGLE-3 drafts, normal loop": {"speculative_algorithm": "eagle3", "disable_overlap_schedule": True},
    "EAGLE-3 drafts, chunks of 16": {"speculative_algorithm": "eagle3", "chunked_prefill_size": 16},
}


def greedy(engine: Engine, messages: list[dict], **sampling) -> list[int]:
    return engine.chat(messages, max_tokens=12, temperature=0, ignore_eos=True, **sampling).token_ids


@pytest.fixture(scope="module", params=["moe-w4a16-asym", "moe-w8a8"])
def base(request, int_checkpoints):
    path = int_checkpoints[request.param]
    with Engine(path, device="cpu") as engine:
        expected = {"text": greedy(engine, TEXT), "picture": greedy(engine, PICTURE)}
    return request.param, path, expected


@pytest.mark.parametrize("path_name", list(PATHS))
def test_each_scheduler_path_gives_the_plain_loops_tokens(base, path_name, eagle3_drafts):
    _, path, expected = base
    options = dict(PATHS[path_name])
    if options.get("speculative_algorithm") == "eagle3":
        options["speculative_draft_model_path"] = str(eagle3_drafts["moe"])  # (float, over the quantized target)
    with Engine(path, device="cpu", **options) as engine:
        for _ in range(2):  # (the second time from the prefix cache, or its host tier)
            assert greedy(engine, TEXT) == expected["text"]
            assert greedy(engine, PICTURE) == expected["picture"]
        engine.scheduler.check_memory()


def test_a_lora_adapter_over_the_quantized_layers(base, tmp_path, tiny_fp16_dirs):
    """The adapter's deltas add to the 4-bit layers' products (attention, experts, vision tower): its
    answers differ from the base's and are the same each time; the base's stay the base's."""
    _, path, expected = base
    adapter = make_adapter(tmp_path / "adapter", tiny_fp16_dirs["moe"])  # (the checkpoint's shapes, in float)
    with Engine(path, device="cpu", enable_lora=True, lora_paths=[f"a={adapter}"]) as engine:
        adapted = [
            engine.chat(m, max_tokens=12, temperature=0, ignore_eos=True, lora="a").token_ids for m in (TEXT, PICTURE)
        ]
        assert adapted[0] != expected["text"] and adapted[1] != expected["picture"]
        assert greedy(engine, TEXT) == expected["text"] and greedy(engine, PICTURE) == expected["picture"]
        assert engine.chat(TEXT, max_tokens=12, temperature=0, ignore_eos=True, lora="a").token_ids == adapted[0]


def test_a_prefill_decode_pair_answers_as_one_engine(base, monkeypatch):
    _, path, expected = base
    pair = PDPair(path, monkeypatch, device="cpu")
    try:
        for messages, want in ((TEXT, expected["text"]), (PICTURE, expected["picture"])):
            x = pair.decode.processor.process_messages(messages, add_generation_prompt=True)
            prefill, decode = pair.submit(x, max_tokens=12, temperature=0, ignore_eos=True)
            pair.run(prefill, decode)
            assert pair.decode.result(decode).token_ids == want
    finally:
        pair.close()
