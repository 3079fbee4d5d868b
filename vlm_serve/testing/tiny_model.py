"""Tiny, randomly initialised Qwen3-VL and Qwen2.5-VL checkpoints in the published Hugging Face layout.

`create_tiny_model` writes everything a real checkpoint directory holds (config, weights, tokenizer, chat
template, image/video processor configs). The layout is the one the published checkpoints have: for
Qwen3-VL (`arch` "moe" or "dense"; written by transformers 4.57) `rope_scaling` in the text config and MoE
experts fused as `gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]`; for Qwen2.5-VL (`arch` "qwen2.5", dense)
the text settings at the top of config.json with `rope_scaling: {type: mrope, mrope_section}`, tensors named
`model.layers.*` and `visual.*` (as transformers 5 still writes them), patches of 14 pixels, windowed vision
attention with full attention every fourth block, and Qwen2-VL's video processor (per-frame pixel limits,
no timestamps). The weights are float32 by default, or bfloat16 / float16 (`dtype`) as the published
checkpoints are.

`quantize="fp8"` writes the layout of Qwen's FP8 checkpoints (`Qwen/Qwen3-VL-235B-A22B-Instruct-FP8`, the
dense `Qwen/Qwen3-VL-8B-Instruct-FP8`, ...), quantized from the bfloat16 weights of the same seed (the
block format: `vlm_serve.quantization`). Qwen's files could not be read from here; this is what the code
that loads them (vLLM, SGLang, transformers) and public reports about them show:
- `quantization_config` `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`, the list naming modules one by one
  (Qwen3-30B-A3B-FP8's: `lm_head`, then each layer's `input_layernorm`, `mlp.gate`,
  `post_attention_layernorm`, quoted in vllm-project/llm-compressor#1758). Ours names each Linear kept in
  bfloat16, `lm_head` and the embeddings; norms are never quantized by any loader, listed or not.
- FP8: the language model's attention and MLP projections, and the MoE experts. Kept in bfloat16: the
  whole vision tower (every block's `attn.qkv`, `attn.proj`, `mlp.linear_fc1/2`, the merger and the
  deepstack mergers), the MoE routers `mlp.gate`, `lm_head`, embeddings and norms. A public conversion
  script quotes a Qwen3-VL-30B-A3B list of exactly these (27 vision blocks, 48 routers, `lm_head`,
  `model.language_model.embed_tokens`); llm-compressor's Qwen3-VL-MoE FP8 recipe ignores the same
  modules (`re:.*lm_head`, `re:model.visual.*`, `re:.*mlp.gate$`).
- MoE experts one Linear per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight` + `weight_scale_inv`,
  not the fused 3D tensors of the bf16 release: Qwen's FP8 releases of MoE models store experts so
  (Qwen3-MoE; Qwen3.5/3.6-MoE, whose bf16 releases are fused too: ml-explore/mlx-lm#1224,
  vllm-project/vllm-metal#312), and vLLM's and SGLang's Qwen3-VL-MoE loaders keep that per-expert path
  beside the fused one. transformers 5 reads the per-expert layout for `qwen3_moe` and `qwen3_5_moe` but
  not for `qwen3_vl_moe` (huggingface/transformers#44230: Qwen3-VL FP8 "dense works normally, but moe
  throws an error"); the tests add its per-expert converters for that architecture.
- Scales float32 (DeepSeek-V3's convention, the dtype transformers' `FP8Linear` allocates); the rest
  bfloat16 and `torch_dtype` "bfloat16". Dimensions that are not multiples of 128 (the tiny preset's) end
  in partial blocks.

Sizes come from presets (`SIZES`): "tiny" (the default, ~0.5M parameters) is for CPU tests; "small"
and "medium" (50-425M) are benchmark models whose shapes are scaled-down Qwen3-VL-235B-A22B: 128
experts routed top-8 with `norm_topk_prob` in every layer, head_dim 64, GQA, a vision tower with the
real patch/merge sizes, three deepstack layers and a 48x48 position grid.

The tokenizer is `tiny_tokenizer`'s real byte-level BPE (Qwen2 pre-tokenizer) trained on a small corpus, so
ids differ from Qwen's but every code path (special tokens, chat template, decoding) is the real one.
The embedding table is padded to a multiple of 64 like Qwen's; the padded rows are zero, so those ids
get logit 0 (well below the real tokens') and are not sampled in practice.

Pixel limits are smaller than Qwen's so that test images stay cheap: an image is resized to between
32x32 (one merged token) and 512x512 pixels (256 tokens); a video to at most 1024 merged tokens per
clip. `video_preprocessor_config.json` pins `cap_pixels_per_frame: false` (transformers' current
default behaviour) so that the oracle's video sizing is explicit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from vlm_serve.config import DTYPES
from vlm_serve.multimodal.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vlm_serve.quantization import Fp8Config, quantize_fp8_blocks
from vlm_serve.testing.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, tokenizer_config, train_tokenizer

ARCHS = {
    "moe": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
    "dense": ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
    "qwen2.5": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
}

# Scale of what each attention/MLP block (and the vision mergers) adds to the residual stream, relative to
# an input-preserving init. Large, so that in the tied variant the input token's own embedding does not
# dominate the final hidden state (which would make greedy decoding repeat the last token forever).
RESIDUAL_GAIN = 16.0


@dataclass(frozen=True)
class TextShape:
    """The language model's shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # of the dense MLP; MoE configs carry it too, unused (as in Qwen's)

    @property
    def mrope_section(self) -> list[int]:
        """Qwen's [24, 20, 20] for head_dim 128, scaled to sum to head_dim // 2 ([6, 5, 5] for 32)."""
        spatial = self.head_dim // 2 * 5 // 16
        return [self.head_dim // 2 - 2 * spatial, spatial, spatial]


@dataclass(frozen=True)
class ExpertShape:
    """The MoE routing shape: every layer sparse (`mlp_only_layers` empty), as in Qwen3-VL-235B-A22B."""

    num_experts: int
    per_token: int
    intermediate: int


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's shape; patch, temporal patch and merge sizes are Qwen's for every preset."""

    depth: int
    hidden: int
    heads: int
    intermediate: int
    positions: int  # learned position grid, side x side
    deepstack: tuple[int, ...]  # blocks whose output also feeds an early text layer


@dataclass(frozen=True)
class ModelSize:
    """One size preset: the dense checkpoint's text shape, the MoE checkpoint's, and the shared rest."""

    dense: TextShape
    moe: TextShape
    experts: ExpertShape
    vision: VisionShape
    # What attention adds to the residual stream, in place of RESIDUAL_GAIN. Attention averages over the
    # context; in deeper models, at full gain, that average outweighs the current token and greedy
    # decoding settles on one token repeated.
    attention_gain: float
    image_max_pixels: int = 512 * 512  # the processor's limits (see the module docstring)
    video_max_pixels: int = 1024 * 32 * 32 * 2  # a whole clip's
    image_min_pixels: int = 32 * 32  # (a smaller picture is scaled up to it)
    video_min_pixels: int = 32 * 32
    max_frames: int = 768
    vocab: int | None = None  # the embedding's rows, padded past the tokenizer's (a real model's vocabulary)
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        inter, hidden = self.experts.intermediate, self.moe.hidden
        # Not head_dim-related: transformers tells the 4.57 expert layout [E, H, 2I] from its own
        # [E, 2I, H] by the shapes, and loads the experts untransposed if they are ambiguous.
        if inter in (hidden, hidden // 2):
            raise ValueError(f"MoE intermediate size {inter} must differ from hidden {hidden} and hidden // 2")
        if math.isqrt(self.vision.positions) ** 2 != self.vision.positions:
            raise ValueError(f"vision positions {self.vision.positions} must be a square grid")
        if not all(0 <= i < self.vision.depth for i in self.vision.deepstack):
            raise ValueError(f"deepstack indexes {self.vision.deepstack} must be blocks of {self.vision.depth}")

    def text(self, arch: str) -> TextShape:
        """The language model's shape in the `arch` checkpoint (Qwen2.5-VL's heads are hidden / heads wide)."""
        if arch == "qwen2.5":
            return dataclasses.replace(self.dense, head_dim=self.dense.hidden // self.dense.heads)
        return self.moe if arch == "moe" else self.dense


_TINY_TEXT = TextShape(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, intermediate=128)
_SMALL_TEXT = TextShape(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, intermediate=1536)
_BUILTIN_TEXT = TextShape(hidden=192, layers=4, heads=6, kv_heads=2, head_dim=32, intermediate=512)
SIZES = {
    "tiny": ModelSize(
        dense=_TINY_TEXT,
        moe=_TINY_TEXT,
        experts=ExpertShape(num_experts=8, per_token=2, intermediate=48),
        vision=VisionShape(depth=3, hidden=32, heads=2, intermediate=64, positions=64, deepstack=(0, 1)),
        attention_gain=RESIDUAL_GAIN,
    ),
    "small": ModelSize(
        dense=_SMALL_TEXT,
        moe=_SMALL_TEXT,
        experts=ExpertShape(num_experts=128, per_token=8, intermediate=128),
        vision=VisionShape(depth=6, hidden=384, heads=6, intermediate=1536, positions=2304, deepstack=(1, 3, 5)),
        attention_gain=RESIDUAL_GAIN / 4,
    ),
    "medium": ModelSize(
        dense=TextShape(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=3072),
        moe=TextShape(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2304),
        experts=ExpertShape(num_experts=128, per_token=8, intermediate=96),
        vision=VisionShape(depth=12, hidden=512, heads=8, intermediate=2048, positions=2304, deepstack=(3, 7, 11)),
        attention_gain=RESIDUAL_GAIN / 4,
    ),
    # the built-in model's shape (trained on synthetic scenes, vlm_serve/builtin): every picture scaled to
    # about 256 x 256 pixels, 8 x 8 tokens, whatever its size. Its tower reads the kind of a shape under 16
    # pixels wide (in 16-pixel patches) wrong one time in five or more, and a shape a tenth of a picture's
    # shorter side is 26 pixels wide at 256 (at 192 it was 19: 67% of the wide set's captions were right, the
    # misses mostly one small shape's kind, colour or size among four). Clips come at 192-256 pixels a
    # frame: at 160 (5 x 5 tokens) the kind of a small moving shape was wrong in 5 of 62 held-out clips.
    "builtin": ModelSize(
        dense=_BUILTIN_TEXT,
        moe=_BUILTIN_TEXT,
        experts=ExpertShape(num_experts=8, per_token=2, intermediate=64),
        vision=VisionShape(depth=4, hidden=128, heads=4, intermediate=384, positions=64, deepstack=(2,)),
        attention_gain=RESIDUAL_GAIN,
        image_max_pixels=256 * 256,
        video_max_pixels=8 * 256 * 256,
        image_min_pixels=256 * 256,
        video_min_pixels=4 * 256 * 256,
        max_frames=16,
        # Interleaved MRoPE gives a picture's columns the 3rd, 6th, ... rotary frequencies and its rows the
        # 2nd, 5th, ...: with 16 of them (head_dim 32), at theta 10000, a column's step turns the fastest pair
        # 0.32 radians against a row's 0.56, and the model trained so put a third of the shapes in the wrong
        # column and 7% in the wrong row (so too with the pictures transposed: it is the axis, not the data).
        # At theta 100 columns turn as fast as rows did; its answers are a few hundred tokens at most.
        rope_theta=100.0,
    ),
    # Speed figures at real sizes (config only: served with load_format="dummy"). Dense: Qwen3-VL-8B's
    # shapes. MoE: Qwen3-VL-30B-A3B's (the 235B-A22B's routing: 128 experts, top 8) at 24 of its 48
    # layers, so that it fits an 80 GB GPU.
    "large": ModelSize(
        dense=TextShape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288),
        moe=TextShape(hidden=2048, layers=24, heads=32, kv_heads=4, head_dim=128, intermediate=6144),
        experts=ExpertShape(num_experts=128, per_token=8, intermediate=768),
        vision=VisionShape(depth=27, hidden=1152, heads=16, intermediate=4304, positions=2304, deepstack=(8, 16, 24)),
        attention_gain=RESIDUAL_GAIN / 4,
        image_max_pixels=16384 * 32 * 32,
        vocab=151936,
    ),
}
MAX_POSITIONS = 4096
PATCH_SIZE = 16
TEMPORAL_PATCH = 2
MERGE_SIZE = 2
# Qwen2.5-VL's tower: 14-pixel patches, attention windows of 112 pixels (4 x 4 merged patches), full
# attention every fourth block (Qwen's: every eighth of 32), video positions 2 a second
QWEN2_5_PATCH_SIZE = 14
QWEN2_5_WINDOW = 112
QWEN2_5_TOKENS_PER_SECOND = 2
QWEN2_5_FRAME_MAX_PIXELS = 224 * 224  # a video frame's, at most (64 merged patches)
QUANTIZE_METHODS = ("fp8",)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _model_config(
    arch: str,
    size: ModelSize,
    token_ids: dict[str, int],
    vocab_size: int,
    tie: bool,
    dtype: str,
    quantization: Fp8Config | None = None,
) -> dict:
    """The `config.json` of the model, as transformers 4.57 writes Qwen3-VL configs (`_qwen2_5_config`:
    Qwen2.5-VL's)."""
    if arch == "qwen2.5":
        return _qwen2_5_config(size, token_ids, vocab_size, tie, dtype)
    architecture, model_type = ARCHS[arch]
    text, experts, vision = size.text(arch), size.experts, size.vision
    text_config: dict = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["<|endoftext|>"],
        "dtype": dtype,
        "eos_token_id": token_ids["<|im_end|>"],
        "head_dim": text.head_dim,
        "hidden_act": "silu",
        "hidden_size": text.hidden,
        "initializer_range": 0.02,
        "intermediate_size": text.intermediate,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": f"{model_type}_text",
        "num_attention_heads": text.heads,
        "num_hidden_layers": text.layers,
        "num_key_value_heads": text.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": text.mrope_section, "rope_type": "default"},
        "rope_theta": size.rope_theta,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if arch == "moe":
        text_config |= {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": experts.intermediate,
            "norm_topk_prob": True,
            "num_experts": experts.num_experts,
            "num_experts_per_tok": experts.per_token,
        }
    vision_config = {
        "deepstack_visual_indexes": list(vision.deepstack),
        "depth": vision.depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": vision.hidden,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": vision.intermediate,
        "model_type": f"{model_type}_vision",
        "num_heads": vision.heads,
        "num_position_embeddings": vision.positions,
        "out_hidden_size": text.hidden,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }
    config = {
        "architectures": [architecture],
        "dtype": dtype,
        "image_token_id": token_ids["<|image_pad|>"],
        "model_type": model_type,
        **({"quantization_config": quantization.to_dict()} if quantization else {}),
        "text_config": text_config,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "transformers_version": "4.57.0",
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": vision_config,
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
    }
    return config


WeightSpecs = list[tuple[str, tuple[int, ...], float, float]]  # (name, shape, mean, std) of each tensor


class _Specs(list):
    """The (name, shape, mean, std) of tensors, in the order they are added (see `_weight_specs`)."""

    def linear(self, name: str, out_dim: int, in_dim: int, bias: bool = False, gain: float = 1.0) -> None:
        self.append((f"{name}.weight", (out_dim, in_dim), 0.0, gain * in_dim**-0.5))
        if bias:
            self.append((f"{name}.bias", (out_dim,), 0.0, 0.1))

    def norm(self, name: str, dim: int, bias: bool = False) -> None:
        self.append((f"{name}.weight", (dim,), 1.0, 0.1))
        if bias:
            self.append((f"{name}.bias", (dim,), 0.0, 0.1))


def _sectioned_mrope(head_dim: int) -> list[int]:
    """Qwen2.5-VL's [16, 24, 24] for head_dim 128, scaled to sum to head_dim // 2 ([2, 3, 3] for 16)."""
    half = head_dim // 2
    spatial = half - half // 4
    return [half // 4, spatial // 2, spatial - spatial // 2]


def _qwen2_5_config(size: ModelSize, token_ids: dict[str, int], vocab_size: int, tie: bool, dtype: str) -> dict:
    """The `config.json` of a Qwen2.5-VL model, in the published checkpoints' form (the text settings at the
    top level, `rope_scaling` of type mrope)."""
    text, vision = size.text("qwen2.5"), size.vision
    return {
        "architectures": [ARCHS["qwen2.5"][0]],
        "attention_dropout": 0.0,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "hidden_act": "silu",
        "hidden_size": text.hidden,
        "image_token_id": token_ids["<|image_pad|>"],
        "initializer_range": 0.02,
        "intermediate_size": text.intermediate,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": text.layers,
        "model_type": ARCHS["qwen2.5"][1],
        "num_attention_heads": text.heads,
        "num_hidden_layers": text.layers,
        "num_key_value_heads": text.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "mrope", "mrope_section": _sectioned_mrope(text.head_dim)},
        "rope_theta": size.rope_theta,
        "sliding_window": MAX_POSITIONS,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "transformers_version": "4.49.0",
        "use_cache": True,
        "use_sliding_window": False,
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_config": {
            "depth": vision.depth,
            "fullatt_block_indexes": list(range(vision.depth - 1, -1, -4))[::-1],
            "hidden_act": "silu",
            "hidden_size": vision.hidden,
            "in_chans": 3,
            "intermediate_size": vision.intermediate,
            "num_heads": vision.heads,
            "out_hidden_size": text.hidden,
            "patch_size": QWEN2_5_PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "spatial_patch_size": QWEN2_5_PATCH_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH,
            "tokens_per_second": QWEN2_5_TOKENS_PER_SECOND,
            "window_size": QWEN2_5_WINDOW,
        },
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_token_id": token_ids["<|vision_pad|>"],
        "vocab_size": vocab_size,
    }


def _weight_specs(arch: str, size: ModelSize, vocab_size: int, tie: bool) -> WeightSpecs:
    """(name, shape, mean, std) of every tensor, in a fixed order.

    Linear weights use std 1/sqrt(fan_in) so activations keep their scale, times RESIDUAL_GAIN where a
    block writes to the residual stream (the preset's `attention_gain` for attention); embeddings have
    std 1 and the LM head std 0.5 (logits spread by 0.5 * sqrt(hidden), 4 in the tiny preset, so greedy
    decoding has clear winners); norm weights are 1 + noise and biases are noise, so a weight that is not
    loaded, or loaded wrongly, shows up in the outputs.
    """
    if arch == "qwen2.5":
        return _qwen2_5_weight_specs(size, vocab_size, tie)
    specs = _Specs()
    v, vision = "model.visual", size.vision
    patch_shape = (vision.hidden, 3, TEMPORAL_PATCH, PATCH_SIZE, PATCH_SIZE)  # Conv3d
    specs.append((f"{v}.patch_embed.proj.weight", patch_shape, 0.0, (3 * TEMPORAL_PATCH * PATCH_SIZE**2) ** -0.5))
    specs.append((f"{v}.patch_embed.proj.bias", (vision.hidden,), 0.0, 0.1))
    specs.append((f"{v}.pos_embed.weight", (vision.positions, vision.hidden), 0.0, 0.5))
    for i in range(vision.depth):
        block = f"{v}.blocks.{i}"
        specs.norm(f"{block}.norm1", vision.hidden, bias=True)
        specs.norm(f"{block}.norm2", vision.hidden, bias=True)
        specs.linear(f"{block}.attn.qkv", 3 * vision.hidden, vision.hidden, bias=True)
        specs.linear(f"{block}.attn.proj", vision.hidden, vision.hidden, bias=True)
        specs.linear(f"{block}.mlp.linear_fc1", vision.intermediate, vision.hidden, bias=True)
        specs.linear(f"{block}.mlp.linear_fc2", vision.hidden, vision.intermediate, bias=True)
    text, experts = size.text(arch), size.experts
    merged = vision.hidden * MERGE_SIZE**2
    mergers = [(f"{v}.merger", vision.hidden)]
    mergers += [(f"{v}.deepstack_merger_list.{k}", merged) for k in range(len(vision.deepstack))]
    for name, norm_dim in mergers:
        specs.norm(f"{name}.norm", norm_dim, bias=True)
        specs.linear(f"{name}.linear_fc1", merged, merged, bias=True)
        specs.linear(f"{name}.linear_fc2", text.hidden, merged, bias=True, gain=RESIDUAL_GAIN)

    t = "model.language_model"
    specs.append((f"{t}.embed_tokens.weight", (vocab_size, text.hidden), 0.0, 1.0))
    for i in range(text.layers):
        layer = f"{t}.layers.{i}"
        specs.norm(f"{layer}.input_layernorm", text.hidden)
        specs.linear(f"{layer}.self_attn.q_proj", text.heads * text.head_dim, text.hidden)
        specs.linear(f"{layer}.self_attn.k_proj", text.kv_heads * text.head_dim, text.hidden)
        specs.linear(f"{layer}.self_attn.v_proj", text.kv_heads * text.head_dim, text.hidden)
        specs.linear(f"{layer}.self_attn.o_proj", text.hidden, text.heads * text.head_dim, gain=size.attention_gain)
        specs.norm(f"{layer}.self_attn.q_norm", text.head_dim)
        specs.norm(f"{layer}.self_attn.k_norm", text.head_dim)
        specs.norm(f"{layer}.post_attention_layernorm", text.hidden)
        if arch == "moe":
            specs.linear(f"{layer}.mlp.gate", experts.num_experts, text.hidden)
            gate_up = (experts.num_experts, text.hidden, 2 * experts.intermediate)
            specs.append((f"{layer}.mlp.experts.gate_up_proj", gate_up, 0.0, text.hidden**-0.5))
            down = (experts.num_experts, experts.intermediate, text.hidden)
            specs.append((f"{layer}.mlp.experts.down_proj", down, 0.0, RESIDUAL_GAIN * experts.intermediate**-0.5))
        else:
            specs.linear(f"{layer}.mlp.gate_proj", text.intermediate, text.hidden)
            specs.linear(f"{layer}.mlp.up_proj", text.intermediate, text.hidden)
            specs.linear(f"{layer}.mlp.down_proj", text.hidden, text.intermediate, gain=RESIDUAL_GAIN)
    specs.norm(f"{t}.norm", text.hidden)
    if not tie:
        specs.append(("lm_head.weight", (vocab_size, text.hidden), 0.0, 0.5))
    return specs


def _qwen2_5_weight_specs(size: ModelSize, vocab_size: int, tie: bool) -> WeightSpecs:
    """`_weight_specs` of a Qwen2.5-VL checkpoint, under the published names (`visual.*`, `model.layers.*`)."""
    specs = _Specs()
    v, vision, text = "visual", size.vision, size.text("qwen2.5")
    patch = QWEN2_5_PATCH_SIZE
    patch_shape = (vision.hidden, 3, TEMPORAL_PATCH, patch, patch)  # Conv3d, no bias
    specs.append((f"{v}.patch_embed.proj.weight", patch_shape, 0.0, (3 * TEMPORAL_PATCH * patch**2) ** -0.5))
    for i in range(vision.depth):
        block = f"{v}.blocks.{i}"
        specs.norm(f"{block}.norm1", vision.hidden)
        specs.norm(f"{block}.norm2", vision.hidden)
        specs.linear(f"{block}.attn.qkv", 3 * vision.hidden, vision.hidden, bias=True)
        specs.linear(f"{block}.attn.proj", vision.hidden, vision.hidden, bias=True)
        specs.linear(f"{block}.mlp.gate_proj", vision.intermediate, vision.hidden, bias=True)
        specs.linear(f"{block}.mlp.up_proj", vision.intermediate, vision.hidden, bias=True)
        specs.linear(f"{block}.mlp.down_proj", vision.hidden, vision.intermediate, bias=True)
    merged = vision.hidden * MERGE_SIZE**2
    specs.norm(f"{v}.merger.ln_q", vision.hidden)
    specs.linear(f"{v}.merger.mlp.0", merged, merged, bias=True)
    specs.linear(f"{v}.merger.mlp.2", text.hidden, merged, bias=True, gain=RESIDUAL_GAIN)

    specs.append(("model.embed_tokens.weight", (vocab_size, text.hidden), 0.0, 1.0))
    for i in range(text.layers):
        layer = f"model.layers.{i}"
        specs.norm(f"{layer}.input_layernorm", text.hidden)
        specs.linear(f"{layer}.self_attn.q_proj", text.heads * text.head_dim, text.hidden, bias=True)
        specs.linear(f"{layer}.self_attn.k_proj", text.kv_heads * text.head_dim, text.hidden, bias=True)
        specs.linear(f"{layer}.self_attn.v_proj", text.kv_heads * text.head_dim, text.hidden, bias=True)
        specs.linear(f"{layer}.self_attn.o_proj", text.hidden, text.heads * text.head_dim, gain=size.attention_gain)
        specs.norm(f"{layer}.post_attention_layernorm", text.hidden)
        specs.linear(f"{layer}.mlp.gate_proj", text.intermediate, text.hidden)
        specs.linear(f"{layer}.mlp.up_proj", text.intermediate, text.hidden)
        specs.linear(f"{layer}.mlp.down_proj", text.hidden, text.intermediate, gain=RESIDUAL_GAIN)
    specs.norm("model.norm", text.hidden)
    if not tie:
        specs.append(("lm_head.weight", (vocab_size, text.hidden), 0.0, 0.5))
    return specs


def _processor_configs(arch: str, size: ModelSize) -> tuple[dict, dict]:
    """`preprocessor_config.json` and `video_preprocessor_config.json` (tiny pixel limits, see module doc)."""
    if arch == "qwen2.5":
        return _qwen2_5_processor_configs(size)
    common = {
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE_SIZE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        "size": {"shortest_edge": size.image_min_pixels, "longest_edge": size.image_max_pixels},
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    video = {
        "size": {"shortest_edge": size.video_min_pixels, "longest_edge": size.video_max_pixels},
        **common,
        "fps": 2,
        "min_frames": 4,
        "max_frames": size.max_frames,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    return image, video


def _qwen2_5_processor_configs(size: ModelSize) -> tuple[dict, dict]:
    """`_processor_configs` of Qwen2.5-VL: its processor, 14-pixel patches, CLIP's mean and std, the pixel
    limits of the preset's images at that patch size, and per-frame limits for Qwen2-VL's video processor."""
    common = {
        "patch_size": QWEN2_5_PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE_SIZE,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
        "processor_class": "Qwen2_5_VLProcessor",
    }
    scale = (QWEN2_5_PATCH_SIZE / PATCH_SIZE) ** 2
    min_pixels, max_pixels = round(size.image_min_pixels * scale), round(size.image_max_pixels * scale)
    image = {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    video = {
        "size": {"shortest_edge": min_pixels, "longest_edge": min(max_pixels, QWEN2_5_FRAME_MAX_PIXELS)},
        **common,
        "fps": 2,
        "min_frames": 4,
        "max_frames": size.max_frames,
        "do_sample_frames": True,
        "cap_pixels_per_frame": False,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    return image, video


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _checked_args(arch: str, size: str, dtype: str | None = None, quantize: str | None = None) -> tuple[ModelSize, str]:
    """The preset named `size` and the weights' dtype, once the arguments are known to be valid.

    `dtype` None means float32, or bfloat16 for a quantized checkpoint (the published FP8 checkpoints keep
    their unquantized weights in bfloat16, and so must these).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quantize is not None and quantize not in QUANTIZE_METHODS:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_METHODS)}, got {quantize!r}")
    if quantize is not None and arch == "qwen2.5":
        raise ValueError(f"quantize={quantize!r} writes Qwen3-VL checkpoints only, not arch {arch!r}")
    if quantize is not None and dtype not in (None, "bfloat16"):
        raise ValueError(f"{quantize.upper()} checkpoints keep their unquantized weights in bfloat16, not {dtype}")
    return SIZES[size], dtype or ("bfloat16" if quantize else "float32")


def _vocabulary(tokenizer: Tokenizer, size: ModelSize) -> tuple[dict[str, int], int]:
    """The special tokens' ids, and the vocabulary size padded to a multiple of 64 (or to the size's)."""
    token_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    return token_ids, size.vocab or _round_up(tokenizer.get_vocab_size(with_added_tokens=True), 64)


def _is_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Whether tensor `name` is an `nn.Linear`'s weight (2D, and not an embedding table)."""
    embedding = name.endswith(("embed_tokens.weight", "pos_embed.weight"))
    return len(shape) == 2 and name.endswith(".weight") and not embedding


def _fp8_config(specs: WeightSpecs) -> Fp8Config:
    """The FP8 checkpoint's quantization: the vision tower's Linears, the routers and lm_head stay bf16."""
    linears = [name.removesuffix(".weight") for name, shape, _, _ in specs if _is_linear(name, shape)]
    kept = [m for m in linears if m.startswith("model.visual.") or m.endswith(".mlp.gate")]
    # lm_head is listed even where tied (no lm_head tensor): naming a module that is absent is harmless
    return Fp8Config(modules_to_not_convert=(*kept, "lm_head", "model.language_model.embed_tokens"))


def _fp8_tensors(tensors: dict[str, torch.Tensor], config: Fp8Config) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's tensors, quantized from the bfloat16 ones; MoE experts split one per expert."""
    out: dict[str, torch.Tensor] = {}

    def add(modules: list[str], weights: torch.Tensor) -> None:
        """Linear `modules[i]`'s weight is `weights[i]`; a stack is quantized at once (fast), stored apart."""
        quantized, scales = quantize_fp8_blocks(weights, config.weight_block_size)
        for module, weight, fp8, scale in zip(modules, weights, quantized, scales):
            if config.is_quantized(module):
                out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = fp8, scale
            else:
                out[f"{module}.weight"] = weight.contiguous()

    for name, tensor in tensors.items():
        weight = tensor.to(torch.bfloat16)
        experts = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        count = weight.shape[0]
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I]: per expert gate [I, H] and up [I, H]
            gate, up = weight.transpose(1, 2).contiguous().chunk(2, dim=1)
            add([f"{experts}.{e}.gate_proj" for e in range(count)], gate)
            add([f"{experts}.{e}.up_proj" for e in range(count)], up)
        elif name.endswith(".mlp.experts.down_proj"):  # [E, I, H]: per expert [H, I]
            add([f"{experts}.{e}.down_proj" for e in range(count)], weight.transpose(1, 2).contiguous())
        elif _is_linear(name, tuple(tensor.shape)):
            add([name.removesuffix(".weight")], weight[None])
        else:
            out[name] = weight.contiguous()
    return out


def model_config(
    arch: str = "moe",
    size: str = "tiny",
    tie_word_embeddings: bool = False,
    dtype: str | None = None,
    quantize: str | None = None,
) -> dict:
    """The `config.json` that `create_tiny_model` writes for these arguments."""
    model_size, dtype = _checked_args(arch, size, dtype, quantize)
    token_ids, vocab_size = _vocabulary(train_tokenizer(), model_size)
    specs = _weight_specs(arch, model_size, vocab_size, tie_word_embeddings)
    quantization = _fp8_config(specs) if quantize else None
    return _model_config(arch, model_size, token_ids, vocab_size, tie_word_embeddings, dtype, quantization)


def weight_shapes(
    arch: str = "moe", size: str = "tiny", tie_word_embeddings: bool = False
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor that `create_tiny_model` writes for these arguments (none is made).

    These are the unquantized checkpoints' tensors; an FP8 checkpoint holds them as its config says.
    """
    model_size, _ = _checked_args(arch, size)
    _, vocab_size = _vocabulary(train_tokenizer(), model_size)
    return {name: shape for name, shape, _, _ in _weight_specs(arch, model_size, vocab_size, tie_word_embeddings)}


def _write_weights(
    path: Path, specs: list, seed: int, dtype: str, quantization: Fp8Config | None, num_tokens: int
) -> None:
    """The checkpoint's random tensors (`_weight_specs`: name, shape, mean, std), in `dtype` or FP8."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {  # in place: out-of-place arithmetic would double the time for the larger presets
        name: torch.randn(shape, generator=generator).mul_(std).add_(mean) for name, shape, mean, std in specs
    }
    # Rows of the padded vocabulary tail belong to no token: zero logits, far below the real tokens'.
    for name in tensors:
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            tensors[name][num_tokens:] = 0.0
    if quantization:
        tensors = _fp8_tensors(tensors, quantization)
    else:
        tensors = {name: tensor.to(getattr(torch, dtype)).contiguous() for name, tensor in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def create_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "moe",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str | None = None,
    size: str = "tiny",
    quantize: str | None = None,
    weights: bool = True,
) -> Path:
    """Write a random checkpoint (`arch` "moe" or "dense": Qwen3-VL's; "qwen2.5": Qwen2.5-VL's; `size` one of
    `SIZES`) into `out_dir`; without `weights`, all of it but the weights (to serve with `load_format="dummy"`).

    `dtype` is the weights' (default float32; bfloat16 when quantized); `quantize="fp8"` writes the
    layout of Qwen's FP8 checkpoints (see the module docstring). Returns `out_dir`. The same arguments
    always give byte-identical files; the FP8 checkpoint is the bfloat16 one of the same seed, quantized.
    """
    model_size, dtype = _checked_args(arch, size, dtype, quantize)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer()
    token_ids, vocab_size = _vocabulary(tokenizer, model_size)

    specs = _weight_specs(arch, model_size, vocab_size, tie_word_embeddings)
    quantization = _fp8_config(specs) if quantize else None
    if weights:
        num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
        _write_weights(out / "model.safetensors", specs, seed, dtype, quantization, num_tokens)

    _write_json(
        out / "config.json",
        _model_config(arch, model_size, token_ids, vocab_size, tie_word_embeddings, dtype, quantization),
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": token_ids["<|endoftext|>"],
            "do_sample": True,
            "eos_token_id": [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
            "pad_token_id": token_ids["<|endoftext|>"],
            "repetition_penalty": 1.0,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "transformers_version": "4.57.0",
        },
    )
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, MAX_POSITIONS))
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    image_config, video_config = _processor_configs(arch, model_size)
    _write_json(out / "preprocessor_config.json", image_config)
    _write_json(out / "video_preprocessor_config.json", video_config)
    return out
