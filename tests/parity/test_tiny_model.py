"""The tiny checkpoint factory, checked against transformers' own Qwen3-VL classes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from vlm_serve.config import ModelConfig
from vlm_serve.testing.tiny_model import (
    SIZES,
    ExpertShape,
    create_tiny_model,
    model_config,
    weight_shapes,
)
from vlm_serve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def _torchvision_works() -> bool:
    """transformers' video processor (and so its Qwen3VLProcessor) needs an importable torchvision."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA build next to a CPU torch
        return False
    return True


def _load(model_dir: Path) -> tuple[torch.nn.Module, dict]:
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def moe_model(tiny_moe_dir: Path) -> torch.nn.Module:
    return _load(tiny_moe_dir)[0]


@pytest.mark.parametrize(
    ("fixture", "class_name", "model_type"),
    [
        ("tiny_moe_dir", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
        ("tiny_dense_dir", "Qwen3VLForConditionalGeneration", "qwen3_vl"),
    ],
)
def test_transformers_loads_every_tensor(
    request: pytest.FixtureRequest, fixture: str, class_name: str, model_type: str
):
    model_dir: Path = request.getfixturevalue(fixture)
    model, info = _load(model_dir)
    assert type(model).__name__ == class_name
    assert model.config.model_type == model_type
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    # The 4.57-style `rope_scaling` becomes transformers' `rope_parameters`.
    rope = model.config.text_config.rope_parameters
    assert rope["mrope_section"] == [6, 5, 5] and rope["mrope_interleaved"] is True
    assert rope["rope_type"] == "default" and rope["rope_theta"] == 10000.0
    # Every non-expert tensor arrives unchanged; lm_head is a separate tensor (untied).
    ours = load_file(model_dir / "model.safetensors")
    theirs = model.state_dict()
    for name, tensor in ours.items():
        if ".mlp.experts." not in name:
            assert torch.equal(theirs[name], tensor), name
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()


def test_moe_experts_are_in_the_457_layout(tiny_moe_dir: Path, moe_model: torch.nn.Module):
    """Files hold gate_up_proj [E, H, 2I] / down_proj [E, I, H]; transformers transposes them on load."""
    config = json.loads((tiny_moe_dir / "config.json").read_text())["text_config"]
    experts, hidden, inter = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    assert 2 * inter != hidden and inter != hidden  # else transformers could not tell the layouts apart
    ours = load_file(tiny_moe_dir / "model.safetensors")
    theirs = moe_model.state_dict()
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{layer}.mlp"
        gate_up, down = ours[f"{prefix}.experts.gate_up_proj"], ours[f"{prefix}.experts.down_proj"]
        assert gate_up.shape == (experts, hidden, 2 * inter)
        assert down.shape == (experts, inter, hidden)
        assert ours[f"{prefix}.gate.weight"].shape == (experts, hidden)
        assert torch.equal(theirs[f"{prefix}.experts.gate_up_proj"], gate_up.transpose(1, 2))
        assert torch.equal(theirs[f"{prefix}.experts.down_proj"], down.transpose(1, 2))


def test_config_matches_the_published_layout(tiny_moe_dir: Path, tiny_dense_dir: Path):
    tokenizer = Tokenizer.from_pretrained(tiny_moe_dir)
    for model_dir, arch in ((tiny_moe_dir, "qwen3_vl_moe"), (tiny_dense_dir, "qwen3_vl")):
        config = json.loads((model_dir / "config.json").read_text())
        text, vision = config["text_config"], config["vision_config"]
        assert config["model_type"] == arch and text["model_type"] == f"{arch}_text"
        assert vision["model_type"] == f"{arch}_vision"
        assert "rope_parameters" not in text
        assert text["rope_scaling"] == {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True}
        assert sum(text["rope_scaling"]["mrope_section"]) == text["head_dim"] // 2
        assert vision["out_hidden_size"] == text["hidden_size"]
        assert vision["patch_size"] == 16 and vision["temporal_patch_size"] == 2 and vision["spatial_merge_size"] == 2
        assert config["torch_dtype"] == config["dtype"] == "float32"
        assert ("num_experts" in text) == (arch == "qwen3_vl_moe")
        # Token ids agree with the tokenizer; the embedding table is padded to a multiple of 64.
        assert config["image_token_id"] == tokenizer.image_token_id
        assert config["video_token_id"] == tokenizer.video_token_id
        assert config["vision_start_token_id"] == tokenizer.vision_start_token_id
        assert config["vision_end_token_id"] == tokenizer.vision_end_token_id
        assert text["vocab_size"] % 64 == 0 and 0 <= text["vocab_size"] - len(tokenizer) < 64
    moe = json.loads((tiny_moe_dir / "config.json").read_text())["text_config"]
    assert moe["norm_topk_prob"] is True and moe["decoder_sparse_step"] == 1 and moe["mlp_only_layers"] == []
    generation = json.loads((tiny_moe_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    assert generation["pad_token_id"] == tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>")
    loaded = transformers.GenerationConfig.from_pretrained(tiny_moe_dir)
    assert loaded.do_sample and (loaded.temperature, loaded.top_p, loaded.top_k) == (0.7, 0.8, 20)


def test_same_seed_gives_identical_files_and_other_seeds_differ(tmp_path: Path, tiny_moe_dir: Path):
    again = create_tiny_model(tmp_path / "again", arch="moe", seed=0)
    for name in sorted(p.name for p in tiny_moe_dir.iterdir()):
        assert (again / name).read_bytes() == (tiny_moe_dir / name).read_bytes(), name
    other = create_tiny_model(tmp_path / "other", arch="moe", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_moe_dir / "model.safetensors").read_bytes()
    a, b = load_file(tiny_moe_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.language_model.embed_tokens.weight"], b["model.language_model.embed_tokens.weight"])
    assert (other / "tokenizer.json").read_bytes() == (tiny_moe_dir / "tokenizer.json").read_bytes()


def test_tied_variant_has_no_lm_head(tmp_path: Path):
    model_dir = create_tiny_model(tmp_path, arch="dense", tie_word_embeddings=True)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["text_config"]["tie_word_embeddings"] is True
    model, info = _load(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, model.model.language_model.embed_tokens.weight)
    # Greedy decoding does not just repeat the last token (the risk when the LM head is the embedding).
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the picture of the red cat."}])
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        new_tokens = model.generate(input_ids, max_new_tokens=16, do_sample=False)[0, input_ids.shape[1] :]
    assert len(set(new_tokens.tolist())) > 4


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_variants(tmp_path: Path, tiny_moe_dir: Path, dtype: str, torch_dtype: torch.dtype):
    model_dir = create_tiny_model(tmp_path, arch="moe", dtype=dtype)
    tensors = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch_dtype}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == config["text_config"]["dtype"] == dtype
    full = load_file(tiny_moe_dir / "model.safetensors")
    assert all(torch.equal(full[name].to(torch_dtype), tensor) for name, tensor in tensors.items())


def test_greedy_decoding_has_clear_winners(tiny_moe_dir: Path, moe_model: torch.nn.Module):
    """Logits are spread enough that 16 greedy tokens never hinge on a near-tie."""
    tokenizer = Tokenizer.from_pretrained(tiny_moe_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the picture of the red cat."}])
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = moe_model.generate(
            input_ids, max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    logits = torch.cat(out.logits)  # [16, vocab]
    top2 = logits.topk(2, dim=-1).values
    assert logits[:, : len(tokenizer)].std(dim=-1).min() > 2.0
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3  # fp32 implementations differ by ~1e-5
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    assert len(new_tokens) == 16 and len(set(new_tokens)) > 4  # not one token repeated
    # The padded tail of the vocabulary has zero logits and never wins.
    assert torch.all(logits[:, len(tokenizer) :] == 0) and max(new_tokens) < len(tokenizer)


def _image_inputs(model_dir: Path, image: Image.Image) -> dict:
    """Processor-equivalent inputs for one image, built from the image processor and the tokenizer."""
    image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    pixels = image_processor(images=[image], return_tensors="pt")
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    )
    num_tokens = int(pixels["image_grid_thw"][0].prod()) // 4
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * num_tokens)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == tokenizer.image_token_id).long(),
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
    }


def test_image_processor_and_vision_tower(tiny_moe_dir: Path, moe_model: torch.nn.Module):
    image_processor = transformers.AutoImageProcessor.from_pretrained(tiny_moe_dir)
    assert type(image_processor).__name__.startswith("Qwen2VLImageProcessor")
    assert (image_processor.size["shortest_edge"], image_processor.size["longest_edge"]) == (32 * 32, 512 * 512)
    rng = np.random.default_rng(0)
    tiny = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    big = Image.fromarray(rng.integers(0, 256, (2000, 1000, 3), dtype=np.uint8))
    grids = [image_processor(images=[im], return_tensors="pt")["image_grid_thw"][0].tolist() for im in (tiny, big)]
    assert grids[0] == [1, 2, 2]  # scaled up to one merged token
    assert grids[1][1] * grids[1][2] * 16 * 16 <= 512 * 512  # scaled down to the pixel limit

    # The image changes what the model says: two different images give different next-token logits.
    outputs = []
    for seed in (1, 2):
        pixels = np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        inputs = _image_inputs(tiny_moe_dir, Image.fromarray(pixels))
        assert inputs["image_grid_thw"][0].tolist() == [1, 4, 6]
        with torch.no_grad():
            outputs.append(moe_model(**inputs).logits[0, -1])
    assert (outputs[0] - outputs[1]).abs().max() > 0.1


def test_the_builtin_shape_sees_every_picture_at_about_256_pixels_square(tmp_path: Path):
    """Small pictures scaled up, large ones down, to 8 x 8 tokens or near (transformers' processor and ours)."""
    from vlm_serve.multimodal.processor import MultimodalProcessor

    model_dir = create_tiny_model(tmp_path / "builtin", arch="moe", size="builtin", tie_word_embeddings=True)
    theirs = transformers.AutoImageProcessor.from_pretrained(model_dir)
    ours = MultimodalProcessor.from_pretrained(model_dir, Tokenizer.from_pretrained(model_dir), cache_mb=0)
    for (width, height), grid in {(96, 96): [1, 16, 16], (640, 640): [1, 16, 16], (160, 96): [1, 14, 22]}.items():
        picture = Image.new("RGB", (width, height), "white")
        assert theirs(images=[picture], return_tensors="pt")["image_grid_thw"][0].tolist() == grid
        assert list(ours.image_processor.preprocess(picture).grid_thw) == grid


def test_video_processor_config(tiny_moe_dir: Path):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    config = json.loads((tiny_moe_dir / "video_preprocessor_config.json").read_text())
    assert config["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert config["processor_class"] == "Qwen3VLProcessor"
    processor = Qwen3VLVideoProcessor.from_pretrained(tiny_moe_dir)
    assert (processor.fps, processor.min_frames, processor.max_frames) == (2, 4, 768)
    assert (processor.patch_size, processor.temporal_patch_size, processor.merge_size) == (16, 2, 2)
    assert processor.size["shortest_edge"] == 32 * 32
    assert processor.cap_pixels_per_frame is False


@pytest.mark.skipif(not _torchvision_works(), reason="transformers' Qwen3VLVideoProcessor needs a working torchvision")
def test_auto_processor(tiny_moe_dir: Path):
    processor = transformers.AutoProcessor.from_pretrained(tiny_moe_dir)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]},
    ]
    rendered = Tokenizer.from_pretrained(tiny_moe_dir).apply_chat_template(messages)
    assert processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    video = np.random.default_rng(1).integers(0, 256, (8, 64, 64, 3), dtype=np.uint8)
    inputs = processor(text=[rendered], images=[image], videos=[video], return_tensors="pt")
    assert inputs["image_grid_thw"][0].tolist() == [1, 4, 6]
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 6


# Parameters (millions, fp32) of each preset, as `vlm-serve create-tiny-model --help` states them.
PARAMETERS_M = {
    ("tiny", "dense"): 0.5,
    ("tiny", "moe"): 0.6,
    ("small", "dense"): 50,
    ("small", "moe"): 233,
    ("medium", "dense"): 261,
    ("medium", "moe"): 425,
}


@pytest.mark.parametrize(("size", "arch"), sorted(PARAMETERS_M))
def test_preset_parameter_counts(size: str, arch: str):
    count = sum(math.prod(shape) for shape in weight_shapes(arch, size).values())
    expected = PARAMETERS_M[size, arch]
    assert round(count / 1e6, 1 if expected < 1 else 0) == expected


@pytest.mark.parametrize("size", ["small", "medium"])
def test_benchmark_presets_have_the_real_routing_and_vision_shapes(size: str):
    """Scaled-down Qwen3-VL-235B-A22B: 128 experts, top-8, normalised, in every layer; Qwen's patch,
    merge and temporal sizes, three deepstack layers and a 48x48 position grid."""
    for arch in ("moe", "dense"):
        config = model_config(arch, size)
        text, vision = config["text_config"], config["vision_config"]
        assert text["head_dim"] == 64 and text["num_attention_heads"] % text["num_key_value_heads"] == 0
        assert text["rope_scaling"]["mrope_section"] == [12, 10, 10]
        assert vision["out_hidden_size"] == text["hidden_size"]
        assert (vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"]) == (16, 2, 2)
        assert vision["num_position_embeddings"] == 48 * 48
        assert len(vision["deepstack_visual_indexes"]) == 3
        assert max(vision["deepstack_visual_indexes"]) < vision["depth"]
        assert vision["hidden_size"] % vision["num_heads"] == 0
    moe = model_config("moe", size)["text_config"]
    assert (moe["num_experts"], moe["num_experts_per_tok"]) == (128, 8)
    assert moe["norm_topk_prob"] is True and moe["decoder_sparse_step"] == 1 and moe["mlp_only_layers"] == []
    assert moe["moe_intermediate_size"] not in (moe["hidden_size"], moe["hidden_size"] // 2)


@pytest.mark.parametrize("size", ["small", "medium"])
@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_preset_configs_load_and_match_the_weights(tmp_path: Path, size: str, arch: str):
    """transformers and our ModelConfig read the config; transformers' model built from it (on the meta
    device, no weights) has exactly the tensors we would write, experts transposed (4.57 layout)."""
    (tmp_path / "config.json").write_text(json.dumps(model_config(arch, size)))
    ours = ModelConfig.from_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert ours.text.hidden_size == config.text_config.hidden_size
    assert ours.text.num_experts == (128 if arch == "moe" else 0)
    assert ours.text.mrope_section == config.text_config.rope_parameters["mrope_section"] == [12, 10, 10]
    assert ours.vision.deepstack_visual_indexes == config.vision_config.deepstack_visual_indexes
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    shapes = weight_shapes(arch, size)
    assert shapes.keys() == theirs.keys()
    for name, shape in shapes.items():
        assert theirs[name] == ((shape[0], shape[2], shape[1]) if ".mlp.experts." in name else shape), name


def test_config_and_shapes_are_those_written(tiny_moe_dir: Path):
    """`model_config` / `weight_shapes` tell what `create_tiny_model` writes, without writing it."""
    assert json.loads((tiny_moe_dir / "config.json").read_text()) == model_config("moe", "tiny")
    with safe_open(tiny_moe_dir / "model.safetensors", "pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == weight_shapes("moe", "tiny")


def test_cli_size_option():
    from vlm_serve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["create-tiny-model", "out"]).size == "tiny"
    assert parser.parse_args(["create-tiny-model", "out", "--size", "medium"]).size == "medium"
    with pytest.raises(SystemExit):
        parser.parse_args(["create-tiny-model", "out", "--size", "huge"])


def test_unknown_size_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="tiny.*small.*medium.*'huge'"):
        create_tiny_model(tmp_path / "model", size="huge")
    assert not (tmp_path / "model").exists()
    with pytest.raises(ValueError, match="size must be one of"):
        weight_shapes("moe", "huge")


def test_presets_refuse_ambiguous_expert_layouts_and_non_square_grids():
    small = SIZES["small"]
    hidden = small.moe.hidden
    for inter in (hidden, hidden // 2):
        with pytest.raises(ValueError, match="must differ from hidden"):
            dataclasses.replace(small, experts=ExpertShape(num_experts=128, per_token=8, intermediate=inter))
    with pytest.raises(ValueError, match="square"):
        dataclasses.replace(small, vision=dataclasses.replace(small.vision, positions=2000))
    with pytest.raises(ValueError, match="deepstack"):
        dataclasses.replace(small, vision=dataclasses.replace(small.vision, deepstack=(1, 3, 6)))


def test_the_qwen2_5_family_option(tmp_path: Path, tiny_qwen2_5_dir: Path):
    """`--arch qwen2.5` writes Qwen2.5-VL's checkpoint (checked against transformers in test_qwen2_5_vl);
    `model_config` / `weight_shapes` tell what it writes; it has no FP8 layout."""
    from vlm_serve.cli import build_parser

    assert build_parser().parse_args(["create-tiny-model", "out", "--arch", "qwen2.5"]).arch == "qwen2.5"
    assert json.loads((tiny_qwen2_5_dir / "config.json").read_text()) == model_config("qwen2.5")
    with safe_open(tiny_qwen2_5_dir / "model.safetensors", "pt") as f:
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == weight_shapes("qwen2.5")
    video = json.loads((tiny_qwen2_5_dir / "video_preprocessor_config.json").read_text())
    assert (
        video["video_processor_type"] == "Qwen2VLVideoProcessor" and video["processor_class"] == "Qwen2_5_VLProcessor"
    )
    with pytest.raises(ValueError, match="writes Qwen3-VL checkpoints only"):
        create_tiny_model(tmp_path / "fp8", arch="qwen2.5", quantize="fp8")


@pytest.mark.skipif(not _torchvision_works(), reason="transformers' Qwen2VLVideoProcessor needs a working torchvision")
def test_auto_processor_of_qwen2_5(tiny_qwen2_5_dir: Path):
    processor = transformers.AutoProcessor.from_pretrained(tiny_qwen2_5_dir)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
