"""LoRA adapters through the Engine: requests for two adapters and for the base, batched together, each get
the greedy tokens PeftModel gives with that adapter alone (or the base model's), under both event loops and
with chunks that cut prompts; a prefix computed through one adapter is never served to another or the base."""

from __future__ import annotations

import pytest
import torch
import transformers

import vlm_serve.scheduler.drafting as drafting_module
from helpers import ReplayDrafts
from vlm_serve.engine import Engine

peft = pytest.importorskip("peft", reason="peft is the oracle of these tests (the test extra installs it)")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 8
PROMPTS = [
    "Tell me about the sea.",
    "Write a long poem about the wind, the sails and the sailors who go out before dawn.",
]
LOOPS = {
    "overlap": {},
    "normal": {"disable_overlap_schedule": True},
    "chunks of 16": {"chunked_prefill_size": 16},
    "ngram drafts": {"speculative_algorithm": "ngram"},
    "replayed drafts": {"speculative_algorithm": "ngram"},  # drafts read off the answers: many are kept
    "eagle3 drafts": {"speculative_algorithm": "eagle3"},  # a random draft head for the base: drafts fail
}


def hf_model(model_dir):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_dense_dir, tmp_path_factory) -> dict[str, str]:
    """Two peft adapters with random (non-zero) weights, of ranks 4 and 8."""
    folders = {}
    for name, seed, rank in (("a", 1, 4), ("b", 2, 8)):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        peft.get_peft_model(hf_model(tiny_dense_dir), config).save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def prompts(tiny_dense_dir) -> list:
    with Engine(tiny_dense_dir, dtype="float32") as engine:
        return [
            engine.processor.process_messages([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in PROMPTS
        ]


@pytest.fixture(scope="module")
def expected(tiny_dense_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of each prompt: with the base model (None) and with each adapter alone, by peft."""

    def generate(model) -> list[list[int]]:
        outs = []
        for x in prompts:
            ids = torch.tensor([x.input_ids])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
                )
            outs.append(out[0, ids.shape[1] :].tolist())
        return outs

    result = {None: generate(hf_model(tiny_dense_dir))}
    for name, folder in adapters.items():
        result[name] = generate(peft.PeftModel.from_pretrained(hf_model(tiny_dense_dir), folder).eval())
    assert result["a"] != result[None] and result["b"] != result[None]  # (the adapters change the answers)
    return result


@pytest.mark.parametrize("loop", list(LOOPS))
def test_requests_for_several_adapters_and_the_base_in_one_batch_each_get_their_own_answer(
    tiny_dense_dir, adapters, prompts, expected, loop, eagle3_drafts, monkeypatch
):
    """(With drafts, verification runs through each request's adapter: the draft drafts for the base.)"""
    settings = dict(LOOPS[loop])
    if loop == "replayed drafts":
        answers = [x.input_ids + tokens[i] for tokens in expected.values() for i, x in enumerate(prompts)]
        monkeypatch.setattr(drafting_module, "NgramProposer", lambda *_: ReplayDrafts(answers, num_draft_tokens=3))
    if loop == "eagle3 drafts":
        settings["speculative_draft_model_path"] = str(eagle3_drafts["dense"])
    lora_paths = [f"{name}={folder}" for name, folder in adapters.items()]
    with Engine(tiny_dense_dir, dtype="float32", enable_lora=True, lora_paths=lora_paths, **settings) as engine:
        a, b = (x.input_ids for x in prompts)
        shared = next(i for i, (s, t) in enumerate(zip(a, b)) if s != t)  # (the chat template's start)
        for round_ in range(2):  # the second round finds each one's prompt in the prefix cache
            jobs = [
                (lora, i, engine.submit(x, lora=lora, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
                for i, x in enumerate(prompts)
                for lora in (None, "a", "b")
            ]
            while not all(job.done for _, _, job in jobs):
                engine.step()
            for lora, i, job in jobs:
                out = engine.result(job)
                assert out.token_ids == expected[lora][i], (lora, i, round_)
                # the same prompt through another adapter (or the base) shares nothing; its own finds it
                assert (out.cached_tokens <= shared) == (round_ == 0), (lora, i, round_)
        engine.scheduler.check_memory()
        if loop == "replayed drafts":
            assert engine.scheduler.metrics.spec.accepted_tokens > 0


def test_an_unknown_adapter_is_refused_by_name(tiny_dense_dir, adapters, prompts):
    with Engine(tiny_dense_dir, dtype="float32", enable_lora=True, lora_paths=[f"a={adapters['a']}"]) as engine:
        with pytest.raises(ValueError, match=r"no LoRA adapter named 'z' is loaded \(loaded: \['a'\]\)"):
            engine.generate_processed(prompts[:1], lora="z", max_tokens=2)
    with Engine(tiny_dense_dir, dtype="float32") as engine:
        with pytest.raises(ValueError, match="asked of a server without --enable-lora"):
            engine.generate_processed(prompts[:1], lora="a", max_tokens=2)
