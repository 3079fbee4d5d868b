"""Qwen2.5-VL, the second model family, against transformers' `Qwen2_5_VLForConditionalGeneration` on the tiny
random checkpoint the factory writes (`create_tiny_model(arch="qwen2.5")`).

The checkpoint is in the published layout and transformers loads every tensor of it; the vision tower (windowed
attention, full attention at `fullatt_block_indexes`, no deepstack) gives transformers' embeddings; the Engine's
prefill logits agree at every prompt position and its 16 greedy tokens are transformers' for text, pictures, a
video (one run of pads, its patch groups `second_per_grid * tokens_per_second` positions apart in time) and a
picture with a video, also through prefill chunks smaller than a picture and prefix-cache hits. What the family
is not served with (LoRA adapters, EAGLE-3 drafts, quantized checkpoints) is refused, saying so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from helpers import hf_inputs
from vlm_serve.config import ModelConfig
from vlm_serve.engine import Engine
from vlm_serve.llm.models.loader import load_vision_model
from vlm_serve.llm.models.registry import model_family
from vlm_serve.testing.logits import prefill_logits
from vlm_serve.testing.media import make_image, make_video
from vlm_serve.vision.encoder import encode_in_passes

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf(tiny_qwen2_5_dir: Path) -> transformers.Qwen2_5_VLForConditionalGeneration:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen2_5_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tiny_qwen2_5_dir: Path):
    with Engine(tiny_qwen2_5_dir, dtype="float32", max_total_tokens=8192) as engine:
        yield engine


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("clips")
    # 12 frames at 6 a second: 4 kept, 2 patch groups a second apart; 16 at 2: 8 groups, whose positions in
    # time (2 a second) reach past the grid's, and past the text after it
    short = make_video(folder / "short.mp4", num_frames=12, fps=6, size=(64, 96))
    long = make_video(folder / "long.mp4", num_frames=16, fps=2, size=(64, 64))
    text = {"type": "text", "text": "Describe what you see in a few words."}

    def user(*parts: dict) -> list[dict]:
        return [{"role": "user", "content": [*parts, text]}]

    return {
        "text": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a story about a cat."},
        ],
        # 230 x 170 pixels: 6 x 8 merged patches, in 4 x 4 attention windows and the smaller ones at its edges
        "picture": user({"type": "image", "image": make_image(230, 170, seed=1)}),
        "pictures_of_different_sizes": user(
            {"type": "image", "image": make_image(64, 64, seed=2)},
            {"type": "image", "image": make_image(300, 120, seed=3)},
        ),
        "video": user({"type": "video", "video": str(short)}),
        "long_video": user({"type": "video", "video": str(long)}),
        "picture_and_video": user(
            {"type": "image", "image": make_image(80, 120, seed=5)}, {"type": "video", "video": str(short)}
        ),
    }


@pytest.fixture(scope="module")
def reference(engine, hf, conversations) -> dict[str, list[int]]:
    """transformers' greedy tokens for each conversation."""
    tokens = {}
    for case, conversation in conversations.items():
        processed = engine.processor.process_messages(conversation, add_generation_prompt=True)
        with torch.no_grad():
            out = hf.generate(
                **hf_inputs(engine, processed), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        tokens[case] = out[0, len(processed.input_ids) :].tolist()
    return tokens


def test_the_checkpoint_is_in_the_published_layout_and_transformers_loads_it(tiny_qwen2_5_dir: Path):
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    config = json.loads((tiny_qwen2_5_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and "text_config" not in config  # (the text settings on top)
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    vision = config["vision_config"]
    assert (vision["patch_size"], vision["window_size"], vision["fullatt_block_indexes"]) == (14, 112, [2])
    # every tensor under its published name arrives unchanged, where our classes name it too
    ours = load_file(tiny_qwen2_5_dir / "model.safetensors")
    assert {name.split(".")[0] for name in ours} == {"visual", "model", "lm_head"}
    assert "model.layers.0.self_attn.q_proj.bias" in ours and "visual.merger.ln_q.weight" in ours
    served = ModelConfig.from_pretrained(tiny_qwen2_5_dir)
    name_of = model_family(served).checkpoint_name
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name_of(name)], tensor), name
    # what the engine reads of the config
    text = model.config.text_config
    assert served.text.head_dim == text.hidden_size // text.num_attention_heads == 16
    assert served.text.mrope_section == text.rope_parameters["mrope_section"]
    assert served.text.rope_theta == text.rope_parameters["rope_theta"]
    assert served.vision.tokens_per_second == model.config.vision_config.tokens_per_second == 2
    assert served.vision.deepstack_visual_indexes == [] and served.vision.num_position_embeddings == 0


def test_the_vision_tower_gives_transformers_embeddings_and_no_deepstack(engine, hf, conversations):
    """As an encoder rank loads it (from the checkpoint's vision tensors alone), whole and in passes that
    cut the video between its patch groups."""
    visual = load_vision_model(engine.model_config, torch.device("cpu"), torch.float32)
    conversation = conversations["picture"][0]["content"][:1] + conversations["picture_and_video"][0]["content"]
    items = engine.processor.process_messages([{"role": "user", "content": conversation}]).mm_items
    grids = [item.grid_thw for item in items]
    assert grids[0] == (1, 12, 16) and grids[-1][0] > 1
    pixels = torch.cat([item.pixel_values for item in items])
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        ours = visual(pixels, grids)
        passes = encode_in_passes(visual, pixels, grids, max_patches=grids[-1][1] * grids[-1][2])
    assert ours.deepstack == [] and ours.embeds.shape == ref.shape
    assert (ours.embeds - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (passes.embeds - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize(
    "case", ["text", "picture", "pictures_of_different_sizes", "video", "long_video", "picture_and_video"]
)
def test_logits_and_greedy_tokens_match_transformers(engine, hf, conversations, reference, case):
    processed = engine.processor.process_messages(conversations[case], add_generation_prompt=True)
    if "video" in case:
        (video,) = [item for item in processed.mm_items if item.modality == "video"]
        assert len(video.spans) == 1 and video.timestamps is None and video.second_per_grid > 0
    with torch.no_grad():
        ref_logits = hf(**hf_inputs(engine, processed)).logits[0]
    ours = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
    assert (ours - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max()
    out = engine.generate_processed([processed], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)[0]
    assert out.token_ids == reference[case]


def test_small_prefill_chunks_and_prefix_hits_give_transformers_tokens(tiny_qwen2_5_dir, conversations, reference):
    """8-token chunks end inside the pictures and videos; the second round is served from the prefix cache."""
    with Engine(tiny_qwen2_5_dir, dtype="float32", chunked_prefill_size=8) as engine:
        inputs = [engine.processor.process_messages(c, add_generation_prompt=True) for c in conversations.values()]
        assert any(end - start > 8 for x in inputs for item in x.mm_items for start, end in item.spans)
        for attempt in ("first", "again"):
            outs = engine.generate_processed(inputs, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            assert [out.token_ids for out in outs] == list(reference.values()), attempt
            engine.scheduler.check_memory()
        assert all(out.cached_tokens > 0 for out in outs)
        assert engine.scheduler.metrics.num_prefill_batches >= max(len(x.input_ids) for x in inputs) // 8


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"enable_lora": True}, "is not served with LoRA adapters"),
        (
            {"speculative_algorithm": "eagle3", "speculative_draft_model_path": "/no/draft"},
            "is not served with EAGLE-3 speculative decoding",
        ),
    ],
    ids=["lora", "eagle3"],
)
def test_what_the_family_is_not_served_with_is_refused(tiny_qwen2_5_dir, options, refusal):
    with pytest.raises(ValueError, match=f"Qwen2_5_VLForConditionalGeneration {refusal}"):
        Engine(tiny_qwen2_5_dir, dtype="float32", **options)


def test_a_quantized_checkpoint_is_refused(tiny_qwen2_5_dir, tmp_path):
    folder = shutil.copytree(tiny_qwen2_5_dir, tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration is not served with quantized checkpoints"):
        Engine(folder, dtype="float32")
