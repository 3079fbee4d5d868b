"""Test checkpoints in the layouts Qwen publishes: bfloat16 (`Qwen/Qwen3-VL-235B-A22B-Instruct`) and block-wise
FP8 (`Qwen/Qwen3-VL-235B-A22B-Instruct-FP8`, `Qwen/Qwen3-VL-8B-Instruct-FP8`), checked against transformers'
own loading, and the reading of a checkpoint's `quantization_config`."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from vlm_serve.cli import build_parser, main
from vlm_serve.quantization import (
    FP8_DTYPE,
    Fp8Config,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    read_quantization_config,
)
from vlm_serve.testing.tiny_model import create_tiny_model, model_config, weight_shapes
from vlm_serve.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ARCHS = ["dense", "moe"]
CLI_SIZES = ["tiny", "small", "medium"]  # the presets `create-tiny-model --size` offers
E4M3_MANTISSA_BITS = 3
E4M3_SMALLEST_SUBNORMAL = 2.0**-9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`checkpoint(arch, kind)`: the tiny checkpoint (seed 0) of `kind` "bfloat16" or "fp8", made once."""
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in made:
            options = {"quantize": "fp8"} if kind == "fp8" else {"dtype": kind}
            made[arch, kind] = create_tiny_model(tmp_path_factory.mktemp(f"{arch}-{kind}"), arch=arch, **options)
        return made[arch, kind]

    return get


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def _is_fp8_in_the_published_layout(name: str) -> bool:
    """The language model's attention and MLP projections (experts included) are FP8; the rest is not."""
    return name.startswith("model.language_model.layers.") and name.endswith("_proj.weight")


def _per_expert(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """A bf16 checkpoint's fused experts tensor as the FP8 checkpoint's per-expert weights: name -> shape."""
    experts = name.rsplit(".", 1)[0]
    if name.endswith("gate_up_proj"):  # [E, H, 2I]
        count, hidden, inter = shape[0], shape[1], shape[2] // 2
        projections = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden)}
    else:  # down_proj [E, I, H]
        count, inter, hidden = shape
        projections = {"down_proj": (hidden, inter)}
    return {f"{experts}.{e}.{proj}.weight": s for e in range(count) for proj, s in projections.items()}


def _dequantized(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Our reading of FP8 weight `name` (`<module>.weight`): each e4m3 value times its 128 x 128 block's scale."""
    return dequantize_fp8_blocks(tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"])


# -- float32 and bfloat16 ----------------------------------------------------------------------------------


def test_float32_default_is_unchanged(tiny_moe_dir: Path, tiny_dense_dir: Path):
    """The default checkpoints (float32, seed 0) are byte for byte those written before FP8 existed."""
    pinned = {
        tiny_moe_dir / "model.safetensors": "e27b67b1fcf3d9d47f68c409d6685b018c65e790dfd6dece04275f02cf0169ed",
        tiny_moe_dir / "config.json": "48dedb14650a9e02106925e9a90147fc78b9d56bd82d2c604cfb00888c68e60e",
        tiny_dense_dir / "model.safetensors": "3a69ef01d1310864d06c9cb33e499c3240d2cfd33f3ce13975e8190cf5cc4b52",
        tiny_dense_dir / "config.json": "370c134cc53c3dc2f9dbdb887636f629c503ce4d93faf077fe0043b7adb41d42",
    }
    for path, digest in pinned.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_checkpoint_layout(checkpoint, tiny_moe_dir: Path, tiny_dense_dir: Path, arch: str):
    """Every tensor bf16 under the float32 checkpoint's names and shapes, rounded from its values; the
    config says bfloat16 where the published bf16 configs do."""
    model_dir = checkpoint(arch, "bfloat16")
    tensors = _tensors(model_dir)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == weight_shapes(arch)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    full = _tensors(tiny_moe_dir if arch == "moe" else tiny_dense_dir)
    assert all(torch.equal(full[name].to(torch.bfloat16), t) for name, t in tensors.items())
    config = json.loads((model_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert read_quantization_config(model_dir) is None


@pytest.mark.parametrize("size", CLI_SIZES)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_preset_takes_every_dtype_and_fp8(arch: str, size: str):
    for dtype in ("float32", "bfloat16", "float16"):
        config = model_config(arch, size, dtype=dtype)
        assert config["torch_dtype"] == config["dtype"] == config["text_config"]["dtype"] == dtype
    fp8 = model_config(arch, size, quantize="fp8")
    assert fp8["torch_dtype"] == "bfloat16" and fp8["quantization_config"]["quant_method"] == "fp8"
    # transformers' CPU dequantization derives the block size from the weight and scale shapes, which is
    # right where each quantized dimension is a multiple of 128 (as in every published Qwen3-VL) or one
    # partial block: so the oracle reads every preset's FP8 weights as written.
    for name, shape in weight_shapes(arch, size).items():
        for weight, weight_shape in (_per_expert(name, shape) if ".mlp.experts." in name else {name: shape}).items():
            if _is_fp8_in_the_published_layout(weight):
                assert all(d % 128 == 0 or d < 128 for d in weight_shape), (weight, weight_shape)


# -- FP8: the layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_config_is_the_published_one(checkpoint, arch: str):
    config = json.loads((checkpoint(arch, "fp8") / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    quantization = config["quantization_config"]
    skipped = quantization.pop("modules_to_not_convert")
    assert quantization == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    # Unquantized, by exact name: every Linear of the vision tower (its blocks, merger and deepstack
    # mergers), the MoE routers and lm_head (and the embeddings, never quantized anyway).
    linears = [n.removesuffix(".weight") for n, s in weight_shapes(arch).items() if len(s) == 2]
    vision = [m for m in linears if m.startswith("model.visual.") and not m.endswith("pos_embed")]
    assert {m.rsplit(".", 1)[-1] for m in vision} == {"qkv", "proj", "linear_fc1", "linear_fc2"}
    layers = config["text_config"]["num_hidden_layers"]
    routers = [f"model.language_model.layers.{i}.mlp.gate" for i in range(layers)]
    expected = vision + (routers if arch == "moe" else []) + ["lm_head", "model.language_model.embed_tokens"]
    assert sorted(skipped) == sorted(expected) and len(skipped) == len(set(skipped))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_tensors_are_the_published_layout(checkpoint, arch: str):
    """The language model's projections as e4m3 with a float32 scale per 128 x 128 block; MoE experts one
    Linear per expert (`mlp.experts.{e}.gate_proj`, ...), not fused; everything else bfloat16, unrenamed."""
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, shape in weight_shapes(arch).items():
        weights = _per_expert(name, shape) if ".mlp.experts." in name else {name: shape}
        for weight, weight_shape in weights.items():
            if _is_fp8_in_the_published_layout(weight):
                scale = tuple(math.ceil(d / 128) for d in weight_shape)
                expected[weight] = (FP8_DTYPE, weight_shape)
                expected[weight.removesuffix("weight") + "weight_scale_inv"] = (torch.float32, scale)
            else:
                expected[weight] = (torch.bfloat16, weight_shape)
    with safe_open(checkpoint(arch, "fp8") / "model.safetensors", "pt") as f:
        written = {name: (f.get_tensor(name).dtype, tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    assert written == expected
    if arch == "moe":
        assert written["model.language_model.layers.0.mlp.experts.7.down_proj.weight"] == (FP8_DTYPE, (64, 48))
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in written)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_config_tells_which_weights_are_fp8(checkpoint, arch: str):
    """`read_quantization_config` of the checkpoint, asked about each Linear, agrees with the file."""
    model_dir = checkpoint(arch, "fp8")
    config = read_quantization_config(model_dir)
    assert config is not None and config.weight_block_size == (128, 128)
    tensors = _tensors(model_dir)
    linears = [n for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2 and "embed" not in n]
    assert linears
    for name in linears:
        assert config.is_quantized(name.removesuffix(".weight")) == (tensors[name].dtype == FP8_DTYPE), name


# -- FP8: the scale arithmetic -----------------------------------------------------------------------------


def _within_e4m3_precision(dequantized: torch.Tensor, original: torch.Tensor, scale: torch.Tensor) -> bool:
    """Round-to-nearest e4m3: relative error at most 2^-4 for normal values, and at most half the smallest
    subnormal step (2^-10) times the block's scale below e4m3's normal range."""
    rows, cols = original.shape[-2:]
    block_scale = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    bound = torch.maximum(original.abs() * 2.0 ** -(E4M3_MANTISSA_BITS + 1), block_scale * E4M3_SMALLEST_SUBNORMAL / 2)
    return bool(((dequantized - original).abs() <= bound * (1 + 1e-6)).all())


def test_block_scales_are_amax_over_448_partial_blocks_included():
    """Scales per 128 x 128 block (ceil on each side), each `amax(|block|) / 448`, so each block's largest
    value is stored as +-448; a stack of experts is quantized per expert."""
    weight = torch.randn(2, 200, 300, generator=torch.Generator().manual_seed(0))
    weight[1, 128:, 256:] *= 1000  # one partial block far larger than its neighbours
    quantized, scale = quantize_fp8_blocks(weight)
    assert quantized.dtype == FP8_DTYPE and quantized.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 2, 3)
    for e in range(2):
        for r, rows in enumerate((slice(0, 128), slice(128, 200))):
            for c, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
                block = weight[e, rows, cols]
                assert scale[e, r, c] == block.abs().max() / 448
                assert quantized[e, rows, cols].float().abs().max() == 448
    assert _within_e4m3_precision(dequantize_fp8_blocks(quantized, scale), weight, scale)


def test_zero_blocks_and_wrong_scale_shapes():
    quantized, scale = quantize_fp8_blocks(torch.zeros(130, 10))
    assert scale.tolist() == [[1.0], [1.0]] and not quantized.float().any()
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(1, 1\), expected \(2, 1\)"):
        dequantize_fp8_blocks(quantized, torch.ones(1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_weights_are_the_bfloat16_weights_within_e4m3_precision(checkpoint, arch: str):
    """The FP8 checkpoint is the bf16 checkpoint of the same seed, quantized: dequantized weights within
    e4m3's precision of the bf16 ones (experts compared with their slices of the fused tensors), every
    other tensor identical."""
    bf16, fp8 = _tensors(checkpoint(arch, "bfloat16")), _tensors(checkpoint(arch, "fp8"))
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in bf16.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.transpose(1, 2).chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                reference[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                reference[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(tensor.transpose(1, 2)):
                reference[name.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            reference[name] = tensor
    assert {n for n in fp8 if not n.endswith("_scale_inv")} == reference.keys()
    for name, original in reference.items():
        if fp8[name].dtype == FP8_DTYPE:
            scale = fp8[name.removesuffix("weight") + "weight_scale_inv"]
            assert _within_e4m3_precision(_dequantized(fp8, name), original.float(), scale), name
        else:
            assert torch.equal(fp8[name], original), name


# -- transformers, the oracle ------------------------------------------------------------------------------


def _image_inputs(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Processor-equivalent inputs for one random 64 x 96 picture and a question."""
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    image = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    )
    num_tokens = int(image["image_grid_thw"][0].prod()) // 4
    input_ids = torch.tensor([tokenizer.encode(prompt.replace("<|image_pad|>", "<|image_pad|>" * num_tokens))])
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == tokenizer.image_token_id).long(),
        "pixel_values": image["pixel_values"],
        "image_grid_thw": image["image_grid_thw"],
    }


def _load(model_dir: Path) -> torch.nn.Module:
    """transformers' model for the checkpoint, in bfloat16, with nothing missing, unexpected or resized."""
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]
    return model.eval()


def _answers_the_image(model: torch.nn.Module, model_dir: Path) -> None:
    """A forward pass with a picture gives finite logits, and another picture other logits."""
    logits = []
    for seed in (1, 2):
        with torch.no_grad():
            logits.append(model(**_image_inputs(model_dir, seed)).logits[0, -1].float())
    assert torch.isfinite(logits[0]).all() and (logits[0] - logits[1]).abs().max() > 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_the_bfloat16_checkpoint(checkpoint, arch: str):
    """As the published bf16 checkpoints load (`dtype=torch.bfloat16`): every tensor as written (experts
    transposed to transformers' own layout), and the model answers a picture."""
    model_dir = checkpoint(arch, "bfloat16")
    model = _load(model_dir)
    theirs = model.state_dict()
    assert {t.dtype for t in theirs.values()} == {torch.bfloat16}
    for name, tensor in _tensors(model_dir).items():
        expected = tensor.transpose(1, 2) if ".mlp.experts." in name else tensor
        assert torch.equal(theirs[name], expected), name
    _answers_the_image(model, model_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_the_fp8_checkpoint(checkpoint, transformers_reads_fp8_experts, arch: str):
    """Through transformers' own fine-grained FP8 loading (on a machine without a GPU it dequantizes to
    bf16): its weights are exactly our dequantization of the file (e4m3 value x block scale, rounded to
    bf16), the unquantized tensors are the file's, and the model answers a picture."""
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer requires it
    model_dir = checkpoint(arch, "fp8")
    model = _load(model_dir)
    theirs = model.state_dict()
    ours = _tensors(model_dir)
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in ours.items():
        if name.endswith("_scale_inv"):
            continue
        expected[name] = _dequantized(ours, name).to(torch.bfloat16) if tensor.dtype == FP8_DTYPE else tensor
    for layer in range(model.config.text_config.num_hidden_layers if arch == "moe" else 0):
        experts = f"model.language_model.layers.{layer}.mlp.experts"
        count = model.config.text_config.num_experts

        def stack(projection: str) -> torch.Tensor:
            return torch.stack([expected.pop(f"{experts}.{e}.{projection}.weight") for e in range(count)])

        gate, up, down = stack("gate_proj"), stack("up_proj"), stack("down_proj")
        expected[f"{experts}.gate_up_proj"] = torch.cat([gate, up], dim=1)  # transformers' [E, 2I, H]
        expected[f"{experts}.down_proj"] = down
    assert theirs.keys() == expected.keys()
    for name, tensor in expected.items():
        assert theirs[name].dtype == torch.bfloat16 and torch.equal(theirs[name], tensor), name
    # And transformers reads them as the bf16 checkpoint's weights, within e4m3's precision (plus bf16's
    # rounding of the dequantized value): FP8 weights land where their bf16 originals do.
    bf16 = _load(checkpoint(arch, "bfloat16")).state_dict()
    largest_scale = max(t.max().item() for n, t in ours.items() if n.endswith("_scale_inv"))
    for name, tensor in theirs.items():
        tolerance = {"rtol": 2**-4 + 2**-8, "atol": largest_scale * E4M3_SMALLEST_SUBNORMAL / 2}
        assert torch.allclose(tensor.float(), bf16[name].float(), **tolerance), name
    _answers_the_image(model, model_dir)


# -- reading a checkpoint's quantization -------------------------------------------------------------------


def test_modules_to_not_convert_match_whole_name_components():
    config = Fp8Config(modules_to_not_convert=("lm_head", "model.visual", "mlp.gate", "model.layers.1.self_attn"))
    assert not config.is_quantized("lm_head")  # exactly
    assert not config.is_quantized("model.visual.blocks.0.attn.qkv")  # under a listed module
    assert not config.is_quantized("model.language_model.layers.3.mlp.gate")  # ends with a listed name
    assert config.is_quantized("model.language_model.layers.3.mlp.gate_proj")  # not a substring match
    assert config.is_quantized("model.layers.11.self_attn.q_proj")  # layers.1 is not layers.11
    assert not config.is_quantized("model.layers.1.self_attn.q_proj")
    assert config.is_quantized("model.language_model.layers.0.mlp.experts.3.down_proj")
    assert config.is_quantized("model.visual_extra.proj")
    assert Fp8Config().is_quantized("lm_head")  # nothing listed: every Linear
    assert config.scale_shape(200, 64) == (2, 1)


def test_config_round_trips_through_json(checkpoint):
    config = read_quantization_config(checkpoint("dense", "fp8"))
    assert Fp8Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert Fp8Config.from_dict({"quant_method": "fp8", "weight_block_size": [64, 32]}) == Fp8Config((64, 32), ())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"quant_method": "bitsandbytes"},
            r"quant_method 'bitsandbytes' is not supported \(supported: 'fp8', 'compressed-tensors', 'awq', 'gptq'\)",
        ),
        ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
        ({"quant_method": None}, "quant_method None is not supported"),
        ({"fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0' is not supported"),
        ({"weight_block_size": None}, "per-tensor scales"),
        ({"weight_block_size": [128]}, "two positive integers"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(tmp_path: Path, change: dict, message: str):
    config = {**Fp8Config().to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(ValueError, match=message) as error:
        read_quantization_config(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)


# -- the command line --------------------------------------------------------------------------------------


def test_cli_dtype_and_quantize(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    parser = build_parser()
    assert parser.parse_args(["create-tiny-model", "out"]).dtype is None
    assert parser.parse_args(["create-tiny-model", "out", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["create-tiny-model", "out", "--quantize", "int4"])
    assert main(["create-tiny-model", str(tmp_path / "fp8"), "--arch", "dense", "--quantize", "fp8"]) == 0
    assert (tmp_path / "fp8" / "config.json").read_text() == json.dumps(
        model_config("dense", quantize="fp8"), indent=2, ensure_ascii=False
    ) + "\n"
    assert main(["create-tiny-model", str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    assert main(["create-tiny-model", str(tmp_path / "bad"), "--quantize", "fp8", "--dtype", "float32"]) == 2
    assert "FP8 checkpoints keep their unquantized weights in bfloat16, not float32" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
