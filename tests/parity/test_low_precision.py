"""Checkpoints served in their own precision on CPU (these tests pin the device: on CUDA `--dtype auto` computes
in the checkpoint's dtype, which the GPU kit checks, vlm_serve.tools.gpu_check). On CPU under `--dtype auto`, a bfloat16 checkpoint's linear
weights, experts and embeddings stay bfloat16 in memory (half of float32's bytes), and an FP8 checkpoint's
quantized weights stay FP8 with their block scales (a quarter), while activations, norms and the KV cache
are float32; `--dtype float32` upcasts the unquantized weights.

Since bfloat16 -> float32 is exact, the model computes what transformers computes on the same checkpoint
loaded in float32: logits to float32 rounding and the same greedy tokens. Where the kernels have
AVX-512-BF16's dot products (tiles.h's BF16_DOT: the default on CPUs that have them) a bfloat16 weight
multiplies its input rounded to bfloat16, and the oracle does the same (`bfloat16_products`): transformers in
float32, each linear whose weight the checkpoint stores in bfloat16 taking its input rounded to bfloat16.
Rounding is not continuous: a float32-rounding difference upstream (our attention's summation order) can
move an input across a bfloat16 rounding boundary, which a random model amplifies. So with the dot products
the vision tower is checked within bfloat16's rounding, and the language model computes what transformers
computes on our tower's embeddings: logits to float32 rounding, the same greedy tokens. Transformers in bfloat16 rounds
its activations to bfloat16 at every step, which these random models amplify, and in MoE layers a token
whose top-k experts are nearly tied can be routed differently (its logits then differ by up to ~11, for
a logit standard deviation of ~3.9): against it the mean logit difference stays under 0.1 of a standard
deviation (measured 0.01-0.055) and the most likely token agrees at 85% of the positions or more
(measured 90-100%).

An FP8 checkpoint computes what transformers computes in float32 on its dequantized weights (each FP8
value times its block's scale), to float32 rounding, with the same greedy tokens; against transformers'
own FP8 loading (which dequantizes to bfloat16 and computes in bfloat16) as against bfloat16 above.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from test_model_parity import _conversations
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from helpers import hf_inputs, openai_client, running_server
from vlm_serve.engine import Engine
from vlm_serve.llm.kernels import linear_cpu
from vlm_serve.quantization import FP8_DTYPE, dequantize_fp8_blocks
from vlm_serve.testing.logits import prefill_logits
from vlm_serve.testing.media import make_video

HF_CLASSES = {
    "moe": transformers.Qwen3VLMoeForConditionalGeneration,
    "dense": transformers.Qwen3VLForConditionalGeneration,
}
CASES = ["text", "one_image", "video"]


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return make_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=12, fps=6, size=(64, 96))


@pytest.fixture(scope="module", params=["moe", "dense"])
def bf16(request, tiny_bf16_dirs):
    path = tiny_bf16_dirs[request.param]
    engine = Engine(path, device="cpu", max_total_tokens=8192, max_running_requests=16)
    yield request.param, path, engine
    engine.shutdown()


def _weights(engine: Engine) -> list[torch.Tensor]:
    model = engine.scheduler.runner.model
    return [p for name, p in model.named_parameters() if "norm" not in name and p.dim() >= 2]


def test_weights_stay_bfloat16_and_activations_float32(bf16):
    _, _, engine = bf16
    runner = engine.scheduler.runner
    assert runner.dtype == torch.float32 and runner.token_to_kv_pool.dtype == torch.float32
    weights = _weights(engine)
    assert weights and {w.dtype for w in weights} == {torch.bfloat16}
    norms = [p for name, p in runner.model.named_parameters() if "norm" in name]
    assert {p.dtype for p in norms} == {torch.float32}


def bf16_dot() -> bool:
    """Whether bfloat16 weights multiply inputs rounded to bfloat16 here (AVX-512-BF16's dot products)."""
    kernel = linear_cpu.LIBRARY.get()
    return kernel is not None and kernel.bf16_dot


@contextlib.contextmanager
def bfloat16_products(model: torch.nn.Module, stored_bf16: Callable[[str], bool]) -> Iterator[None]:
    """transformers' `model` (float32) multiplying as our kernels do with AVX-512-BF16's dot products: each
    linear whose weight the checkpoint stores in bfloat16 (`stored_bf16(parameter name)`) takes its input
    rounded to bfloat16 (the experts' weights are views of one parameter: told apart by their storage)."""
    storages = {p.untyped_storage().data_ptr() for name, p in model.named_parameters() if stored_bf16(name)}
    linear = F.linear

    def as_the_kernels(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            x = x.to(torch.bfloat16).to(x.dtype)
        return linear(x, weight, bias)

    with mock.patch.object(F, "linear", as_the_kernels):
        yield


@contextlib.contextmanager
def our_vision_tower(model: torch.nn.Module, engine: Engine) -> Iterator[None]:
    """transformers' `model` reading its image and video embeddings from our engine's vision tower."""
    tower = engine.scheduler.encoding.encoder.visual
    visual = model.model.visual

    def ours(pixel_values, grid_thw, **_):
        out = tower(pixel_values.float(), [tuple(g) for g in grid_thw.tolist()])
        return BaseModelOutputWithDeepstackFeatures(pooler_output=out.embeds, deepstack_features=list(out.deepstack))

    with mock.patch.object(visual, "forward", ours):
        yield


def bf16_everywhere(name: str) -> bool:
    return True


def assert_computes_as_transformers_in_float32(
    engine: Engine,
    hf_class: type,
    reference: Path,
    conversation: list,
    stored_bf16: Callable[[str], bool] | None = bf16_everywhere,
) -> None:
    """Prefill logits to float32 rounding, and 16 greedy tokens, as transformers' model of `reference`
    (a checkpoint holding the same real weights) computes them in float32. Where bfloat16 weights
    (`stored_bf16`, None: none) meet AVX-512-BF16's dot products: as it computes them with
    `bfloat16_products` on our vision tower's embeddings, that tower within bfloat16's rounding of its own,
    the logits within 2^-6 of their largest and the greedy tokens the same up to a near-tie of the oracle."""
    dot = bf16_dot() and stored_bf16 is not None
    processed = engine.processor.process_messages(conversation, add_generation_prompt=True)
    inputs = hf_inputs(engine, processed)
    ours = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
    exact = hf_class.from_pretrained(reference, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad(), bfloat16_products(exact, stored_bf16) if dot else contextlib.nullcontext():
        if dot and processed.mm_items:
            assert_tower_within_bfloat16_rounding(engine, exact, inputs)
        with our_vision_tower(exact, engine) if dot else contextlib.nullcontext():
            ref = exact(**inputs).logits[0]
            generated = exact.generate(
                **inputs,
                max_new_tokens=16,
                do_sample=False,
                min_new_tokens=16,
                output_logits=True,
                return_dict_in_generate=True,
            )
    tolerance = (2**-6 if dot else 1e-4) * ref.abs().max()
    assert (ours - ref).abs().max() < tolerance
    out = engine.generate_processed([processed], max_tokens=16, temperature=0, ignore_eos=True)[0]
    theirs = generated.sequences[0, len(processed.input_ids) :].tolist()
    if dot and out.token_ids != theirs:  # where rounding flips decide: a token the oracle nearly ties
        i = next(i for i, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b)
        step = generated.logits[i][0]
        assert step.max() - step[out.token_ids[i]] < tolerance, (
            f"token {i}: {out.token_ids[i]} is no near-tie of {theirs[i]}"
        )
    else:
        assert out.token_ids == theirs


def assert_tower_within_bfloat16_rounding(engine: Engine, model: torch.nn.Module, inputs: dict) -> None:
    """Our vision tower's embeddings and deepstack features against `model`'s on the same pixels: within
    2^-6 of their largest (inputs of its linears rounded to bfloat16 on either side of a boundary: each
    such term moves by up to 2^-8; measured under 0.8%)."""
    tower = engine.scheduler.encoding.encoder.visual
    for pixels, grids in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if pixels in inputs:
            ours = tower(inputs[pixels], [tuple(g) for g in inputs[grids].tolist()])
            theirs = model.model.visual(inputs[pixels], grid_thw=inputs[grids])
            for a, b in zip([ours.embeds, *ours.deepstack], [theirs.pooler_output, *theirs.deepstack_features]):
                assert (a - b).abs().max() <= 2**-6 * b.abs().max()


def assert_within_rounding_of_transformers_in_bfloat16(
    engine: Engine, hf_class: type, path: Path, conversation: list
) -> None:
    """Prefill logits within bfloat16's rounding (amplified by the random model) of transformers' model of
    the checkpoint loaded in bfloat16 (an FP8 one through transformers' own FP8 loading)."""
    processed = engine.processor.process_messages(conversation, add_generation_prompt=True)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in hf_inputs(engine, processed).items()}
    ours = prefill_logits(engine.scheduler, processed.input_ids, processed.mm_items)
    rounded = hf_class.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = rounded(**inputs).logits[0].float()
    assert (ours - theirs).abs().mean() < 0.1 * theirs.std()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers_on_the_same_weights(bf16, video_path, case):
    arch, path, engine = bf16
    conversation = _conversations(video_path)[case]
    assert_computes_as_transformers_in_float32(engine, HF_CLASSES[arch], path, conversation)
    assert_within_rounding_of_transformers_in_bfloat16(engine, HF_CLASSES[arch], path, conversation)


def test_float32_upcasts_the_weights_and_computes_as_transformers_in_float32(bf16, video_path):
    arch, path, _ = bf16
    with Engine(path, device="cpu", dtype="float32", max_total_tokens=8192) as upcast:
        assert {w.dtype for w in _weights(upcast)} <= {torch.float32}
        conversation = _conversations(video_path)["one_image"]
        assert_computes_as_transformers_in_float32(upcast, HF_CLASSES[arch], path, conversation, stored_bf16=None)


@pytest.mark.server
def test_the_server_answers_as_the_engine(tiny_bf16_dirs, video_path):
    path = tiny_bf16_dirs["moe"]
    conversation = _conversations(video_path)["one_image"]
    with Engine(path, device="cpu", max_total_tokens=8192) as engine:
        expected = engine.chat(conversation, max_tokens=8, temperature=0, ignore_eos=True).text
    with running_server(path, "--device", "cpu") as server:
        image, text = conversation[0]["content"]
        buffer = io.BytesIO()
        image["image"].save(buffer, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, text]
        answer = openai_client(server).chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert answer.choices[0].message.content == expected


# ---- FP8 ----------------------------------------------------------------------------------------------


def dequantized_copy(fp8_dir: Path, bf16_dir: Path, out: Path) -> Path:
    """The bfloat16 checkpoint's folder with, as float32, the FP8 checkpoint's weights dequantized (its
    unquantized ones as they are): what the FP8 checkpoint means, in a layout transformers reads as is."""
    shutil.copytree(bf16_dir, out)
    quantized = load_file(fp8_dir / "model.safetensors")

    def real(name: str) -> torch.Tensor:
        tensor = quantized[name]
        if tensor.dtype != FP8_DTYPE:
            return tensor.float()
        return dequantize_fp8_blocks(tensor, quantized[name.removesuffix("weight") + "weight_scale_inv"])

    tensors = {}
    for name, tensor in load_file(bf16_dir / "model.safetensors").items():
        experts = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        if name.endswith(".mlp.experts.gate_up_proj"):  # (experts, hidden, 2 * intermediate)
            count = tensor.shape[0]
            gate_up = [
                torch.cat([real(f"{experts}.{e}.gate_proj.weight"), real(f"{experts}.{e}.up_proj.weight")])
                for e in range(count)
            ]
            tensors[name] = torch.stack(gate_up).transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.down_proj"):  # (experts, intermediate, hidden)
            down = [real(f"{experts}.{e}.down_proj.weight") for e in range(tensor.shape[0])]
            tensors[name] = torch.stack(down).transpose(1, 2).contiguous()
        else:
            tensors[name] = real(name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["text_config"]["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


def left_in_bf16(name: str) -> bool:
    """Whether an FP8 checkpoint stores a weight in bfloat16: all but the decoder layers' linears and
    experts (the vision tower, the routers, the embeddings and lm_head)."""
    return not name.startswith("model.language_model.layers.") or name.endswith(".mlp.gate.weight")


@pytest.fixture(scope="module", params=["moe", "dense"])
def fp8(request, tiny_fp8_dirs, tiny_bf16_dirs, tmp_path_factory):
    arch, path = request.param, tiny_fp8_dirs[request.param]
    reference = dequantized_copy(path, tiny_bf16_dirs[arch], tmp_path_factory.mktemp("dequantized") / arch)
    engine = Engine(path, device="cpu", max_total_tokens=8192, max_running_requests=16)
    yield arch, path, reference, engine
    engine.shutdown()


def test_fp8_weights_stay_fp8_with_their_scales(fp8):
    arch, _, _, engine = fp8
    language = engine.scheduler.runner.model.model.language_model
    layer = language.layers[0]
    fp8_layers = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    if arch == "dense":
        fp8_layers += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    # (a packed layer's plain weight is emptied, keeping its dtype)
    for linear in fp8_layers:
        assert linear.weight.dtype == FP8_DTYPE, linear
        assert linear.weight_scale_inv is not None and linear.weight_scale_inv.dtype == torch.float32
    if arch == "moe":  # experts FP8, the router as stored (bfloat16)
        assert layer.mlp.w13.dtype == layer.mlp.w2.dtype == FP8_DTYPE and layer.mlp.w13_scale is not None
        assert layer.mlp.gate.weight.dtype == torch.bfloat16 and layer.mlp.gate.weight_scale_inv is None
    assert language.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("case", CASES)
def test_fp8_logits_and_greedy_tokens_match_transformers_on_the_dequantized_weights(fp8, video_path, case):
    arch, _, reference, engine = fp8
    conversation = _conversations(video_path)[case]
    assert_computes_as_transformers_in_float32(engine, HF_CLASSES[arch], reference, conversation, left_in_bf16)


def test_fp8_logits_are_within_rounding_of_transformers_own_fp8_loading(
    fp8, video_path, transformers_reads_fp8_experts
):
    pytest.importorskip("accelerate", reason="transformers' FP8 loading needs accelerate (the test extra has it)")
    arch, path, _, engine = fp8
    assert_within_rounding_of_transformers_in_bfloat16(
        engine, HF_CLASSES[arch], path, _conversations(video_path)["one_image"]
    )


@pytest.mark.server
def test_the_server_serves_an_fp8_checkpoint_as_the_engine(tiny_fp8_dirs, video_path):
    path = tiny_fp8_dirs["dense"]
    conversation = [{"role": "user", "content": "Tell me a story about a cat."}]
    with Engine(path, device="cpu", max_total_tokens=8192) as engine:
        expected = engine.chat(conversation, max_tokens=8, temperature=0, ignore_eos=True).text
    with running_server(path, "--device", "cpu") as server:
        answer = openai_client(server).chat.completions.create(
            model="default", messages=conversation, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
    assert answer.choices[0].message.content == expected
