"""LoRA adapters of the vision tower and its mergers: pictures (of different sizes) and videos through an
adapter that adapts the tower alone, or the tower and the language model, get the greedy tokens PeftModel
gives, batched with the same pictures through the base: with the tower in the scheduler's process or in an
encoder pool, with chunks that end inside pictures, and with requests retracted from a full pool. The
embeddings each makes are cached apart (the base's are never served to an adapter's request or the
reverse)."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import hf_inputs
from vlm_serve.engine import Engine
from vlm_serve.testing.media import make_image, make_video

peft = pytest.importorskip("peft", reason="peft is the oracle of these tests (the test extra installs it)")

NEW_TOKENS = 16
TOWER = r".*visual\..*\.(qkv|attn\.proj|linear_fc1|linear_fc2)"  # blocks, merger and deepstack mergers
ADAPTERS = {"tower": TOWER, "both": rf"{TOWER}|.*language_model\..*\.(q_proj|v_proj|down_proj)"}
SETTINGS = {
    "tower in the scheduler's process": {"vit_dp": 0},
    # a pool that overflows while they decode (little room kept for outputs): requests are retracted and
    # prefilled again, through their own adapters
    "retraction": {"max_total_tokens": 160, "schedule_conservativeness": 0.05},
    "encoder pool of 2": {"vit_dp": 2},
    "chunks of 16 ending inside pictures, normal loop": {"chunked_prefill_size": 16, "disable_overlap_schedule": True},
}


def hf_model(model_dir):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(tiny_dense_dir, tmp_path_factory) -> dict[str, str]:
    folders = {}
    for seed, (name, targets) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        peft.get_peft_model(hf_model(tiny_dense_dir), config).save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def prompts(tiny_dense_dir, tmp_path_factory) -> list:
    clip = make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=8, fps=4, size=(64, 96))
    text = {"type": "text", "text": "What is in it?"}
    conversations = [
        [{"type": "image", "image": make_image(96, 64, seed=1)}, text],
        [
            {"type": "image", "image": make_image(64, 64, seed=2)},
            {"type": "image", "image": make_image(96, 64, seed=1)},
        ],
        [{"type": "video", "video": str(clip)}, text],
    ]
    with Engine(tiny_dense_dir, dtype="float32") as engine:
        return [
            engine.processor.process_messages([{"role": "user", "content": c}], add_generation_prompt=True)
            for c in conversations
        ]


@pytest.fixture(scope="module")
def expected(tiny_dense_dir, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of each prompt with the base model (None) and with each adapter alone, by peft."""
    with Engine(tiny_dense_dir, dtype="float32") as engine:
        inputs = [hf_inputs(engine, x) for x in prompts]

    def generate(model) -> list[list[int]]:
        with torch.no_grad():
            return [
                model.generate(**x, max_new_tokens=NEW_TOKENS, do_sample=False)[0, x["input_ids"].shape[1] :].tolist()
                for x in inputs
            ]

    result = {None: generate(hf_model(tiny_dense_dir))}
    for name, folder in adapters.items():
        result[name] = generate(peft.PeftModel.from_pretrained(hf_model(tiny_dense_dir), folder).eval())
    for name in adapters:  # (each adapter changes the answers)
        assert result[name] != result[None], name
    return result


@pytest.fixture(
    params=[pytest.param(s, marks=[pytest.mark.server] if "pool" in s else []) for s in SETTINGS], ids=list(SETTINGS)
)
def engine(request, tiny_dense_dir, adapters):
    """An engine serving both adapters (an encoder pool's processes are started here, before the test)."""
    lora_paths = [f"{name}={folder}" for name, folder in adapters.items()]
    settings = SETTINGS[request.param]
    with Engine(tiny_dense_dir, dtype="float32", enable_lora=True, lora_paths=lora_paths, **settings) as engine:
        yield engine


def test_pictures_through_a_tower_adapter_and_through_the_base_in_one_batch_get_their_own_answers(
    engine, adapters, prompts, expected
):
    for round_ in range(2):  # the second round finds each one's prompt (and embeddings) cached apart
        jobs = [
            (lora, i, engine.submit(x, lora=lora, max_tokens=NEW_TOKENS, temperature=0))
            for i, x in enumerate(prompts)
            for lora in (None, *adapters)
        ]
        while not all(job.done for _, _, job in jobs):
            engine.step()
        for lora, i, job in jobs:
            assert engine.result(job).token_ids == expected[lora][i], (lora, i, round_)
    engine.scheduler.check_memory()
    if engine.server_args.max_total_tokens == SETTINGS["retraction"]["max_total_tokens"]:
        assert engine.scheduler.metrics.num_retractions > 0
    # one embedding per item and tower: 2 pictures (one in two prompts) and a video, through the base and 2 adapters
    assert len(engine.scheduler.encoding.cache) == 3 * 3


def test_an_adapter_of_the_tower_loaded_at_run_time_is_used_and_unloaded(tiny_dense_dir, adapters, prompts, expected):
    with Engine(tiny_dense_dir, dtype="float32", enable_lora=True, max_loras=1) as engine:
        for name in ("tower", "both", "tower"):  # (one slot: each load replaces the last in the encoder too)
            engine.load_lora(name, adapters[name])
            outs = engine.generate_processed(prompts[:1], lora=name, max_tokens=NEW_TOKENS, temperature=0)
            assert outs[0].token_ids == expected[name][0][: len(outs[0].token_ids)], name
            engine.unload_lora(name)
