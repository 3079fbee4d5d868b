"""Every scheduler path gives each request exactly the greedy tokens transformers gives it alone.

One mixed workload (text only, one image, a repeated image, two images, a shared system prompt,
different lengths) runs through the Engine under each scheduling setting: small prefill chunks that
end inside images, prefix-cache hits, a KV pool small enough to force retraction, page sizes 1 and
16, every policy, mixed chunks, priorities, and the prefix cache disabled. Every setting runs under
both event loops, `event_loop_normal` and `event_loop_overlap` (batch N+1 launched before batch N's
result is processed), and with speculative decoding: n-gram drafts, drafts replayed from the expected
answers (with some spoilt) so that verification keeps all, part or none of them, and a random EAGLE-3
draft head (its KV beside the target's through every path). After each run the scheduler's own idle self-check has passed (it raises on a
leak) and is run once more here.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import vlm_serve.scheduler.drafting as drafting_module
from helpers import ReplayDrafts
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image

MAX_TOKENS = 10
RETRACT_MAX_TOKENS = 24  # longer outputs make the retraction test's pool overflow while decoding
SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly and precisely."}


def _workload() -> list[list[dict]]:
    cat, dog, bird = make_image(192, 128, seed=1), make_image(256, 160, seed=2), make_image(64, 64, seed=3)

    def user(*parts):
        return {"role": "user", "content": list(parts)}

    def text(t):
        return {"type": "text", "text": t}

    def image(img):
        return {"type": "image", "image": img}

    return [
        [SYSTEM, user(text("Tell me a story about a cat."))],
        [SYSTEM, user(image(cat), text("Describe this image."))],
        [SYSTEM, user(image(cat), text("What colours are in this picture? Answer in one word."))],
        [user(image(dog), text("What is here?"))],
        [SYSTEM, user(text("Write a long poem about the sea, the wind, the sails and the sailors " * 3))],
        [SYSTEM, user(image(bird), image(cat), text("Compare the two images."))],
        [user(text("Hi"))],
    ]


@pytest.fixture(scope="module")
def inputs(tiny_moe_dir):
    with Engine(tiny_moe_dir, dtype="float32") as engine:
        return [engine.processor.process_messages(c, add_generation_prompt=True) for c in _workload()]


@pytest.fixture(scope="module")
def long_reference(tiny_moe_dir, inputs) -> list[list[int]]:
    """transformers' greedy tokens (RETRACT_MAX_TOKENS of them) for each request alone, stopping at
    EOS like the engine."""
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    image_id = hf.config.image_token_id
    out = []
    for x in inputs:
        ids = torch.tensor([x.input_ids])
        kwargs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == image_id).int(),
        }
        if x.mm_items:
            kwargs["pixel_values"] = torch.cat([it.pixel_values for it in x.mm_items])
            kwargs["image_grid_thw"] = torch.tensor([it.grid_thw for it in x.mm_items])
        with torch.no_grad():
            gen = hf.generate(**kwargs, max_new_tokens=RETRACT_MAX_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(long_reference) -> list[list[int]]:
    return [tokens[:MAX_TOKENS] for tokens in long_reference]


NORMAL = {"disable_overlap_schedule": True}
LOOPS = {
    "normal": NORMAL,
    "overlap": {"disable_overlap_schedule": False},
    "ngram": {"speculative_algorithm": "ngram"},  # (the random model rarely copies: drafts mostly fail)
    "drafts": {"speculative_algorithm": "ngram"},  # drafts replayed from the answers: most are kept
    "drafts, normal loop": {"speculative_algorithm": "ngram", **NORMAL},
    "eagle3": {"speculative_algorithm": "eagle3"},  # a random EAGLE-3 draft: every step's drafts fail
    "eagle3, normal loop": {"speculative_algorithm": "eagle3", **NORMAL},
}


@pytest.fixture(params=list(LOOPS))
def loop(request, monkeypatch, inputs, long_reference, eagle3_drafts) -> dict:
    """The event loop an engine runs: keyword arguments for `Engine`."""
    if request.param.startswith("drafts"):
        sequences = [x.input_ids + answer for x, answer in zip(inputs, long_reference)]
        drafts = ReplayDrafts(sequences, num_draft_tokens=3)
        monkeypatch.setattr(drafting_module, "NgramProposer", lambda *settings: drafts)
    if request.param.startswith("eagle3"):
        return {**LOOPS[request.param], "speculative_draft_model_path": str(eagle3_drafts["moe"])}
    return LOOPS[request.param]


def _run(engine: Engine, inputs, **kwargs):
    outs = engine.generate_processed(inputs, max_tokens=MAX_TOKENS, temperature=0, **kwargs)
    engine.scheduler.check_memory()
    return outs


SETTINGS = {
    "default": {},  # (on CPU the vision tower runs in the scheduler's process, on CUDA in one encoder process)
    "encoder_pool_2": {"vit_dp": 2},
    "vit_inline": {"vit_dp": 0},  # the vision tower in the scheduler's process
    "small_chunks": {"chunked_prefill_size": 16},
    "page_size_16": {"page_size": 16, "chunked_prefill_size": 64},
    "no_chunking": {"chunked_prefill_size": -1},
    "no_radix_cache": {"disable_radix_cache": True},
    "mixed_chunk": {"chunked_prefill_size": 32, "enable_mixed_chunk": True},
    "lpm": {"schedule_policy": "lpm"},
    "dfs_weight": {"schedule_policy": "dfs-weight"},
    "lof": {"schedule_policy": "lof"},
    "random": {"schedule_policy": "random"},
    "tiny_batch": {"max_running_requests": 2, "max_prefill_tokens": 64},
    "torch_attention": {"attention_backend": "torch", "chunked_prefill_size": 32},  # (default: the C kernel)
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.server) if SETTINGS[name].get("vit_dp") else name for name in SETTINGS],
)
def test_every_setting_matches_transformers(tiny_moe_dir, inputs, reference, name, loop):
    with Engine(tiny_moe_dir, dtype="float32", **SETTINGS[name], **loop) as engine:
        first = _run(engine, inputs)
        assert [o.token_ids for o in first] == reference
        # the same prompts again: served from the prefix cache, same tokens
        second = _run(engine, inputs)
        assert [o.token_ids for o in second] == reference
        if not engine.server_args.disable_radix_cache:
            page = engine.server_args.page_size  # only whole pages are cached
            assert all(o.cached_tokens > 0 for o, x in zip(second, inputs) if len(x.input_ids) > page)
            assert engine.scheduler.metrics.cached_prompt_tokens > 0
        else:
            assert engine.scheduler.metrics.cached_prompt_tokens == 0


HOST_TIER = {
    "write_through": {},
    "write_back, pages of 4, small chunks": {
        "hicache_write_policy": "write_back",
        "page_size": 4,
        "chunked_prefill_size": 16,
    },
}


@pytest.mark.parametrize("name", list(HOST_TIER))
def test_a_host_tier_under_a_small_pool_serves_evicted_prefixes_exactly(tiny_moe_dir, inputs, reference, name, loop):
    """The KV pool holds about two requests: the prompts of a second round were evicted to the host tier,
    from where they are loaded back (cut by chunks where chunks are small), giving the same tokens."""
    longest = max(len(x.input_ids) for x in inputs) + MAX_TOKENS
    settings = {
        "enable_hierarchical_cache": True,
        "hicache_ratio": 8,
        "max_total_tokens": 2 * longest,
        **HOST_TIER[name],
    }
    with Engine(tiny_moe_dir, dtype="float32", **settings, **loop) as engine:
        assert [o.token_ids for o in _run(engine, inputs)] == reference
        tree, metrics = engine.scheduler.tree_cache, engine.scheduler.metrics
        cached_before, loaded_before = metrics.cached_prompt_tokens, tree.host_hit_tokens
        second = _run(engine, inputs)
        assert [o.token_ids for o in second] == reference
        assert tree.host_hit_tokens > loaded_before and tree.evicted_tokens > 0
        # the tokens loaded back count as cached, as the usage reports them
        assert sum(o.cached_tokens for o in second) == metrics.cached_prompt_tokens - cached_before


def test_small_chunks_cut_through_images(tiny_moe_dir, inputs, reference, loop):
    """With 16-token chunks every image (more than 16 tokens) is split across prefill chunks."""
    with Engine(tiny_moe_dir, dtype="float32", chunked_prefill_size=16, **loop) as engine:
        longest = max(len(x.input_ids) for x in inputs)
        assert any(end - start > 16 for x in inputs for it in x.mm_items for start, end in it.spans)
        outs = _run(engine, inputs)
        assert [o.token_ids for o in outs] == reference
        assert engine.scheduler.metrics.num_prefill_batches >= longest // 16


def test_mixed_chunk_runs_decodes_inside_prefill_chunks(tiny_moe_dir, inputs, reference, loop):
    with Engine(tiny_moe_dir, dtype="float32", chunked_prefill_size=32, enable_mixed_chunk=True, **loop) as engine:
        assert [o.token_ids for o in _run(engine, inputs)] == reference
        assert engine.scheduler.metrics.num_mixed_batches > 0


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_kv_pool_retracts_and_still_matches(tiny_moe_dir, inputs, long_reference, page_size, loop):
    """A small pool, filled by admitting requests with almost no room reserved for their outputs
    (low schedule_conservativeness), forces retraction; retracted requests are prefilled again later
    and still produce their own tokens."""
    longest = max(len(x.input_ids) for x in inputs) + RETRACT_MAX_TOKENS
    pool = (longest // page_size + 4) * page_size
    with Engine(
        tiny_moe_dir,
        dtype="float32",
        max_total_tokens=pool,
        page_size=page_size,
        schedule_conservativeness=0.05,
        **loop,
    ) as engine:
        outs = engine.generate_processed(inputs * 2, max_tokens=RETRACT_MAX_TOKENS, temperature=0)
        engine.scheduler.check_memory()
        assert [o.token_ids for o in outs] == long_reference * 2
        assert engine.scheduler.metrics.num_retractions > 0


def test_priority_preemption_keeps_outputs_exact(tiny_moe_dir, inputs, reference, loop):
    """Low-priority requests are running when high-priority ones arrive in a full pool: they are
    preempted, requeued, and still finish with their own tokens. (No prefix cache, so the
    high-priority copies of the same prompts need memory of their own.)"""
    longest = max(len(x.input_ids) for x in inputs) + MAX_TOKENS
    with Engine(
        tiny_moe_dir,
        dtype="float32",
        max_total_tokens=longest * 2,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0,
        disable_radix_cache=True,
        **loop,
    ) as engine:
        sampling = {"max_tokens": MAX_TOKENS, "temperature": 0}
        low = [engine.submit(x, priority=0, **sampling) for x in inputs]
        for _ in range(3):
            engine.step()
        high = [engine.submit(x, priority=10, **sampling) for x in inputs]
        while not all(job.done for job in low + high):
            engine.step()
        while not engine.scheduler.is_idle():
            engine.step()
        engine.scheduler.check_memory()
        assert engine.scheduler.metrics.num_preemptions > 0
        assert [engine.result(job).token_ids for job in low] == reference
        assert [engine.result(job).token_ids for job in high] == reference
