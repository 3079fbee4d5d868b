"""Integer-quantized checkpoints, as llm-compressor makes them (compressed-tensors W4A16, W8A16, W8A8) and as
AutoAWQ's and GPTQ's layouts pack the same integers, served as stored on CPU: the codes stay packed (a
4-bit weight half a byte), read by the kernels in registers.

For W4A16 and W8A16 the oracle is transformers in float32 on the dequantized weights (compressed-tensors'
own decompression, in float32: `int_checkpoints.dequantized`): logits to float32 rounding and the same
greedy tokens, for text, pictures and video. Where the kernels have AVX-512-BF16's dot products a 4-bit
weight multiplies its input rounded to bfloat16, as a bfloat16 weight does, and the oracle rounds those
inputs alike (test_low_precision.py's `bfloat16_products`). Every packing of the same integers (AWQ; GPTQ v1, v2, with
desc_act's shuffled groups) gives those tokens. W8A8 rounds each activation row to int8 as it multiplies
(dynamic, per token), which the float oracle does not: its prefill logits are held to the tolerance of
the bfloat16 checks, and its first token and that token's log-probability to the oracle's.

The checkpoints are made by llm-compressor in a process of its own (conftest.py's `int_checkpoints`):
these tests are marked `server`.
"""

from __future__ import annotations

import pytest
import torch
from test_low_precision import HF_CLASSES, assert_computes_as_transformers_in_float32
from test_model_parity import _conversations

from helpers import hf_inputs
from int_checkpoints import dequantized, to_awq, to_gptq
from vlm_serve.engine import Engine
from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.testing.logits import prefill_logits
from vlm_serve.testing.media import make_video

pytestmark = pytest.mark.server

WEIGHT_ONLY = ["dense-w4a16", "dense-w4a16-asym", "dense-w8a16", "dense-w8a16-asym", "moe-w4a16", "moe-w4a16-asym"]
CASES = ["text", "one_image", "video"]


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=12, fps=6, size=(64, 96))


@pytest.fixture(scope="module")
def oracles(int_checkpoints, tmp_path_factory) -> dict:
    """Each checkpoint's dequantized float32 copy, made when first asked for."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = dequantized(int_checkpoints[name], tmp_path_factory.mktemp("dequantized") / name)
        return made[name]

    return get


@pytest.fixture(scope="module", params=WEIGHT_ONLY)
def served(request, int_checkpoints, oracles):
    name = request.param
    engine = Engine(int_checkpoints[name], device="cpu", max_total_tokens=8192, max_running_requests=16)
    yield name, oracles(name), engine
    engine.shutdown()


def quantized_linear(name: str) -> bool:
    """Whether the dequantized checkpoint's parameter `name` is one the recipes quantized (the decoder layers'
    projections and experts, not their routers)."""
    return (
        name.startswith("model.language_model.layers.") and "norm" not in name and not name.endswith("mlp.gate.weight")
    )


def rounded_inputs(name: str):
    """The parameters whose inputs the kernels round to bfloat16 here: a 4-bit checkpoint's quantized ones
    (None: none, for 8 bits)."""
    return quantized_linear if "w4" in name else None


def _int_layers(engine: Engine) -> list:
    model = engine.scheduler.runner.model
    return [m for m in model.modules() if isinstance(m, LinearBase) and m.int_weight is not None]


def test_weights_stay_packed_in_the_kernels_panels(served):
    name, _, engine = served
    layers = _int_layers(engine)
    language = engine.scheduler.runner.model.model.language_model
    assert len(layers) == len(language.layers) * (2 if name.startswith("moe") else 4)  # (qkv, o[, gate_up, down])
    bits = 4 if "w4" in name else 8
    for layer in layers:
        assert (
            layer.int_weight.scheme.bits == bits
            and layer.panels is not None
            and layer.panels.format == {4: 4, 8: 5}[bits]
        )
        assert layer.weight.numel() == 0 and layer.int_weight.codes.numel() == 0  # (the panels hold the codes)
        assert (
            layer.panels.weight.dtype == torch.int32
            and layer.panels.weight.numel() * 32 // bits >= layer.in_features * layer.out_features
        )
    if name.startswith("moe"):
        for moe in (m for m in engine.scheduler.runner.model.modules() if isinstance(m, SparseMoeBlock)):
            assert moe.packed is not None and moe.w13_int.scheme.bits == bits
            assert moe.gate.int_weight is None  # (the router as stored: ignored by the recipe)
    assert language.embed_tokens.weight.dtype == torch.float16


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers_on_the_dequantized_weights(served, video_path, case):
    name, reference, engine = served
    conversation = _conversations(video_path)[case]
    assert_computes_as_transformers_in_float32(
        engine, HF_CLASSES[name.split("-")[0]], reference, conversation, rounded_inputs(name)
    )


def _greedy(path, conversation, **options) -> list[int]:
    with Engine(path, device="cpu", max_total_tokens=8192, **options) as engine:
        processed = engine.processor.process_messages(conversation, add_generation_prompt=True)
        return engine.generate_processed([processed], max_tokens=16, temperature=0, ignore_eos=True)[0].token_ids


@pytest.mark.parametrize(
    ("source", "packing"),
    [
        ("dense-w4a16-asym", "awq"),
        ("moe-w4a16-asym", "awq"),
        ("dense-w4a16", "gptq"),
        ("dense-w4a16-asym", "gptq_v2"),
        ("dense-w4a16", "gptq-desc_act"),
        ("moe-w4a16", "gptq-desc_act"),
        ("dense-w8a16", "gptq"),
        ("dense-w8a16-asym", "gptq_v2-desc_act"),
    ],
)
def test_every_packing_of_the_same_integers_gives_the_same_tokens(
    int_checkpoints, oracles, tmp_path, video_path, source, packing
):
    path = int_checkpoints[source]
    if packing == "awq":
        repacked = to_awq(path, tmp_path / packing)
    else:
        layout, _, act_order = packing.partition("-")
        repacked = to_gptq(path, tmp_path / packing, layout, act_order=bool(act_order))
    conversation = _conversations(video_path)["one_image"]
    with Engine(repacked, device="cpu", max_total_tokens=8192) as engine:
        assert engine.model_config.quantization.method == packing.split("_")[0].split("-")[0]
        rounded = rounded_inputs(source)
        if rounded is not None and packing.endswith("desc_act"):  # (experts in act order: module by module, float32)
            rounded = lambda name: quantized_linear(name) and ".experts." not in name  # noqa: E731
        assert_computes_as_transformers_in_float32(
            engine, HF_CLASSES[source.split("-")[0]], oracles(source), conversation, rounded
        )


@pytest.mark.parametrize("name", ["dense-w8a8", "moe-w8a8"])
def test_w8a8_first_token_and_its_logprob_match_the_float_oracle(int_checkpoints, oracles, video_path, name):
    arch = name.split("-")[0]
    conversation = _conversations(video_path)["one_image"]
    with Engine(int_checkpoints[name], device="cpu", max_total_tokens=8192) as engine:
        layers = _int_layers(engine)
        assert layers and all(layer.int_weight.scheme.int8_activations for layer in layers)
        processed = engine.processor.process_messages(conversation, add_generation_prompt=True)
        ours = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
        inputs = hf_inputs(engine, processed)
        first = engine.generate_processed([processed], max_tokens=1, temperature=0, logprobs=True)[0]
    oracle = HF_CLASSES[arch].from_pretrained(oracles(name), dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        theirs = oracle.eval()(**inputs).logits[0]
    # the bfloat16 checks' tolerance (test_low_precision.py): int8 activations round as coarsely
    assert (ours - theirs).abs().mean() < 0.1 * theirs.std()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.85
    logprobs = theirs[-1].log_softmax(-1)
    assert first.token_ids[0] == logprobs.argmax().item()
    assert abs(first.choices[0].logprobs[0] - logprobs.max().item()) < 0.1 * theirs.std()
