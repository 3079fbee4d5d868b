"""Reading integer-quantized checkpoints: their `quantization_config` (compressed-tensors, AWQ, GPTQ) into one
scheme per layer, each format's packing read back to the integers packed by the tests, and what is not
served refused before serving, by a message naming the setting or tensor and what is supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import run_process
from int_checkpoints import AWQ_ORDER, _words
from vlm_serve.engine import Engine
from vlm_serve.llm.layers.quantized import IntWeight, Pieces
from vlm_serve.quantization import IntQuantConfig, IntScheme, read_quantization_config
from vlm_serve.quantization.int_packing import awq_codes, ct_codes, ct_zeros, gptq_codes, gptq_zeros

W4A16_GROUP = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*visual.*", "re:.*mlp.gate$"],
    "quantization_status": "compressed",
    "sparsity_config": {},
}
W8A8 = {
    **W4A16_GROUP,
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def read(tmp_path: Path, quantization: dict, method: str | None = None):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    return read_quantization_config(tmp_path, method)


def test_compressed_tensors_schemes_by_module(tmp_path: Path):
    config = read(tmp_path, W4A16_GROUP)
    assert isinstance(config, IntQuantConfig) and config.method == "compressed-tensors"
    layer = "model.language_model.layers.3."
    assert config.layout_of(layer + "self_attn.q_proj") == (IntScheme(4, 128, True), "pack-quantized")
    assert config.layout_of(layer + "mlp.experts.7.down_proj") == (IntScheme(4, 128, True), "pack-quantized")
    for kept in ("lm_head", "model.visual.blocks.0.attn.qkv", layer + "mlp.gate"):
        assert config.layout_of(kept) is None and not config.stored_quantized(kept)
    assert config.layout_of(layer + "mlp.gate_proj") is not None  # (a regex from the start: `mlp.gate$` only)
    w8a8 = read(tmp_path, W8A8)
    assert w8a8.layout_of(layer + "mlp.up_proj") == (IntScheme(8, None, True, int8_activations=True), "int-quantized")
    assert w8a8.int8_activations and "int8 activations" in w8a8.describe()


def test_a_module_named_by_a_group_takes_its_scheme_over_the_class_target(tmp_path: Path):
    groups = {
        "attention": {
            "targets": ["re:.*self_attn.*"],
            "weights": {**W4A16_GROUP["config_groups"]["group_0"]["weights"], "num_bits": 8},
        },
        "rest": W4A16_GROUP["config_groups"]["group_0"],
    }
    config = read(tmp_path, {**W4A16_GROUP, "config_groups": groups})
    assert config.layout_of("model.language_model.layers.0.self_attn.o_proj")[0].bits == 8
    assert config.layout_of("model.language_model.layers.0.mlp.down_proj")[0].bits == 4


def test_awq_and_gptq_configs(tmp_path: Path):
    awq = read(tmp_path, {**AWQ, "modules_to_not_convert": ["visual"]}, "awq_marlin")  # (vLLM's name for it)
    assert awq.layout_of("model.language_model.layers.0.mlp.up_proj") == (IntScheme(4, 128, False), "awq")
    assert awq.layout_of("model.visual.blocks.0.mlp.linear_fc1") is None  # (AutoAWQ's: a piece of the name)
    gptq = read(tmp_path, {**GPTQ, "bits": 8, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"})
    assert gptq.layout_of("model.language_model.layers.0.mlp.up_proj") == (
        IntScheme(8, 128, False, act_order=True),
        "gptq_v2",
    )
    assert read(tmp_path, {**GPTQ, "group_size": -1}).layout_of("lm_head")[0].group_size is None
    assert not gptq.stored_quantized("lm_head")  # (GPTQ tells it by the tensors it stores)


def _with(config: dict, **weights) -> dict:
    group = config["config_groups"]["group_0"]
    return {**config, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        (_with(W4A16_GROUP, num_bits=3), r"weights.num_bits 3 is not supported \(supported: 4, 8\)"),
        (_with(W4A16_GROUP, type="float", num_bits=8), r"type 'float' is not supported \(integer weights only"),
        (
            _with(W4A16_GROUP, strategy="tensor"),
            r"strategy 'tensor' is not supported \(supported: 'group', 'channel'\)",
        ),
        (_with(W4A16_GROUP, group_size=12), r"group_size 12 is not supported \(a positive multiple of 8"),
        (_with(W4A16_GROUP, block_structure=[128, 128]), "block_structure: block-wise integer scales"),
        (_with(W4A16_GROUP, dynamic=True), "dynamic weight quantization is not supported"),
        (_with(W4A16_GROUP, actorder="random"), "actorder 'random' is not supported"),
        ({**W4A16_GROUP, "format": "marlin-24"}, r"format 'marlin-24' is not supported \(supported: pack-quantized"),
        ({**W4A16_GROUP, "sparsity_config": {"format": "sparse-24-bitmask"}}, "2:4 sparsity"),
        ({**W4A16_GROUP, "kv_cache_scheme": {"num_bits": 8}}, "a quantized KV cache is not supported"),
        ({**W4A16_GROUP, "transform_config": {"config_groups": {}}}, "transforms"),
        ({**W4A16_GROUP, "quantization_status": "frozen"}, "quantization_status 'frozen' is not supported"),
        ({**W4A16_GROUP, "config_groups": {}}, "config_groups is empty"),
        (
            {
                **W8A8,
                "config_groups": {
                    "g": {
                        **W8A8["config_groups"]["group_0"],
                        "weights": W4A16_GROUP["config_groups"]["group_0"]["weights"],
                    }
                },
            },
            "int8 activations go with symmetric per-channel int8 weights",
        ),
        (
            {
                **W8A8,
                "config_groups": {
                    "g": {
                        **W8A8["config_groups"]["group_0"],
                        "input_activations": {
                            "num_bits": 8,
                            "type": "int",
                            "symmetric": False,
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
            },
            r"symmetric False is not supported \(activations: dynamic symmetric int8 per token\)",
        ),
        (
            {
                **W8A8,
                "config_groups": {
                    "g": {
                        **W8A8["config_groups"]["group_0"],
                        "input_activations": {
                            "num_bits": 8,
                            "type": "int",
                            "symmetric": True,
                            "strategy": "tensor",
                            "dynamic": False,
                        },
                    }
                },
            },
            "strategy 'tensor' is not supported",
        ),
        ({**AWQ, "version": "gemv"}, r"AWQ version 'gemv' is not supported \(supported: 'gemm'\)"),
        ({**AWQ, "bits": 3}, "AWQ bits 3 is not supported"),
        ({**AWQ, "zero_point": False}, "AWQ zero_point false is not supported"),
        ({**GPTQ, "bits": 3}, r"GPTQ bits 3 is not supported \(supported: 4, 8\)"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
        ({**GPTQ, "lm_head": True}, "a quantized lm_head is not supported"),
        ({**GPTQ, "dynamic": {"-:.*mlp.*": {}}}, "per-module overrides are not supported"),
        ({**GPTQ, "group_size": 100}, "GPTQ group_size 100 is not supported"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(tmp_path: Path, quantization: dict, message: str):
    with pytest.raises(ValueError, match=message) as error:
        read(tmp_path, quantization)
    assert str(tmp_path / "config.json") in str(error.value)


@pytest.mark.parametrize(
    ("quantization", "method", "message"),
    [
        (W4A16_GROUP, "awq", "--quantization awq: .* has quant_method 'compressed-tensors'"),
        (None, "gptq", "--quantization gptq: .* has no quantization_config"),
        (AWQ, "bitsandbytes", "--quantization 'bitsandbytes' is not supported"),
    ],
)
def test_the_quantization_flag_must_name_the_checkpoints_format(tmp_path: Path, quantization, method, message):
    (tmp_path / "config.json").write_text(
        json.dumps({} if quantization is None else {"quantization_config": quantization})
    )
    with pytest.raises(ValueError, match=message):
        read_quantization_config(tmp_path, method)
    if quantization is not None and method != "bitsandbytes":
        assert read_quantization_config(tmp_path, quantization["quant_method"]) is not None


# -- the packings, read back ---------------------------------------------------------------------------------


def test_each_packing_reads_back_the_integers_packed(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    out, inp, groups = 16, 64, 2
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (out, inp), generator=g, dtype=torch.int32)
        zeros = torch.randint(1, 1 << bits, (out, groups), generator=g, dtype=torch.int32)
        # compressed-tensors: along `in`, the zero points along `out`
        assert torch.equal(ct_codes(_words(codes, bits), bits, inp).int(), codes)
        assert torch.equal(ct_zeros(_words(zeros.T, bits).T, bits, out).int(), zeros)
        # GPTQ: along `in`, the weight transposed; v1 stores z - 1
        assert torch.equal(gptq_codes(_words(codes, bits).T, bits).int(), codes)
        assert torch.equal(gptq_zeros(_words((zeros - 1).T, bits), bits, plus_one=True).int(), zeros)
        assert torch.equal(gptq_zeros(_words(zeros.T, bits), bits, plus_one=False).int(), zeros)
    codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.int32)
    assert torch.equal(awq_codes(_words(codes.T, 4, AWQ_ORDER)).int(), codes)  # AWQ: along `out`, in its order
    # (one word by hand: AWQ's nibble i holds column AWQ_ORDER[i] of its 8)
    word = _words(torch.arange(8).view(1, 8), 4, AWQ_ORDER)
    assert [(int(word) >> (4 * i)) & 0xF for i in range(8)] == AWQ_ORDER
    assert awq_codes(word).flatten().tolist() == list(range(8))


def test_tensor_parallelism_must_split_a_quantized_weight_between_groups():
    scheme = IntScheme(4, 32, True)
    pieces = Pieces("model.x.down_proj", scheme, "pack-quantized", (8, 128))
    codes = torch.randint(0, 16, (8, 128), dtype=torch.int32)
    pieces.add("weight_shape", torch.tensor([8, 128]))
    part = pieces.add("weight_scale", torch.rand(8, 4)) or pieces.add("weight_packed", _words(codes, 4))
    shard = IntWeight.empty(scheme, (), 8, 48, "cpu")
    with pytest.raises(ValueError, match=r"the shard's input columns 16 ... 63 cut groups of 32"):
        shard.store((), slice(0, 8), part, (16, 64), "model.x.down_proj")
    whole = IntWeight.empty(scheme, (), 8, 64, "cpu")
    whole.store((), slice(0, 8), part, (64, 128), "model.x.down_proj")
    assert torch.equal(whole.unpacked().int(), codes[:, 64:])


# -- bad tensors: refused before serving ------------------------------------------------------------------------


def _broken(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` whose tensors `change` (a function of the tensor dict) edits."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file({name: t.contiguous() for name, t in tensors.items()}, dst / "model.safetensors")
    return dst


Q_PROJ = "model.language_model.layers.0.self_attn.q_proj"
DOWN = "model.language_model.layers.1.mlp.down_proj"


def _set(name: str, value):
    return lambda tensors: tensors.__setitem__(name, value(tensors[name]) if callable(value) else value)


def _drop(name: str):
    return lambda tensors: tensors.pop(name)


def _unquantized(module: str):
    def change(tensors: dict) -> None:
        for piece in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
            tensors.pop(f"{module}.{piece}")
        tensors[f"{module}.weight"] = torch.zeros(128, 64, dtype=torch.float16)

    return change


@pytest.mark.server
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_drop(f"{Q_PROJ}.weight_scale"), rf"missing .*'{Q_PROJ}.weight_scale'"),
        (_drop(f"{DOWN}.weight_zero_point"), rf"missing .*'{DOWN}.weight_zero_point'"),
        (
            _set(f"{Q_PROJ}.weight_scale", lambda t: t[:, :1]),
            rf"{Q_PROJ}.weight_scale has shape \(128, 1\), expected \(128, 2\)",
        ),
        (
            _set(f"{Q_PROJ}.weight_packed", lambda t: t[:-8]),
            rf"{Q_PROJ}.weight_packed has shape \(120, 8\), expected \(128, 8\)",
        ),
        (
            _set(f"{DOWN}.weight_shape", torch.tensor([64, 96])),
            rf"{DOWN}.weight_shape \[64, 96\], the model's \[64, 128\]",
        ),
        (_set(f"{Q_PROJ}.weight_scale", lambda t: t.to(torch.int32)), "is torch.int32, not floating point"),
        (_set(f"{DOWN}.weight_g_idx", torch.zeros(128, dtype=torch.int32)), f"{DOWN}.weight_g_idx: no such tensor"),
        (
            _set("lm_head.weight_packed", torch.zeros(1408, 8, dtype=torch.int32)),
            "checkpoint tensor 'lm_head.weight_packed': a quantized lm_head is not supported",
        ),
        (
            _set("model.visual.blocks.0.mlp.linear_fc1.weight_packed", torch.zeros(64, 4, dtype=torch.int32)),
            "the checkpoint quantizes the vision tower, which is served as stored in float only",
        ),
        (
            _unquantized(Q_PROJ),
            f"{Q_PROJ}.weight is stored unquantized, but the quantization_config quantizes {Q_PROJ}",
        ),
    ],
    ids=[
        "no scale",
        "no zero point",
        "scale shape",
        "packed shape",
        "weight_shape",
        "integer scale",
        "stray g_idx",
        "quantized lm_head",
        "quantized vision tower",
        "unquantized but listed",
    ],  # fmt: skip
)
def test_a_bad_checkpoint_is_refused_naming_the_tensor(int_checkpoints, tmp_path: Path, change, message):
    path = _broken(int_checkpoints["dense-w4a16-asym"], tmp_path / "broken", change)
    with pytest.raises(ValueError, match=message):
        Engine(path, device="cpu", max_total_tokens=1024).shutdown()


@pytest.mark.server
def test_a_server_never_starts_serving_a_checkpoint_it_would_read_wrongly(int_checkpoints, tmp_path: Path):
    path = _broken(
        int_checkpoints["dense-w4a16"], tmp_path / "broken", _set(f"{Q_PROJ}.weight_scale", lambda t: t[:, :1])
    )
    done = run_process(
        ["vlm-serve", "serve", "--model", str(path), "--port", "0", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert f"{Q_PROJ}.weight_scale has shape (128, 1), expected (128, 2)" in done.stderr
