"""Builds the model on its device and loads a (sharded) safetensors checkpoint into it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from vlm_serve.checkpoint import WeightFormat, build_module, check_dummy, checkpoint_files, iter_weights, randomize
from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.linear import prepack_weights
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlm_serve.llm.models.qwen3_vl_vision import VISION_PREFIX


def experts_transposed(files: list[Path], config: ModelConfig) -> bool:
    """Whether fused experts are stored (experts, in, out), as the published checkpoints do.

    Read from the tensor shapes: one of gate_up (H vs 2I) and down (H vs I) is always unambiguous.
    """
    hidden, inter = config.text.hidden_size, config.text.moe_intermediate_size
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("mlp.experts.down_proj") and hidden != inter:
                    return tuple(f.get_slice(name).get_shape()[1:]) == (inter, hidden)
                if name.endswith("mlp.experts.gate_up_proj") and hidden != 2 * inter:
                    return tuple(f.get_slice(name).get_shape()[1:]) == (hidden, 2 * inter)
    return False


def load_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    dummy: bool = False,
    lora: bool = False,
) -> Qwen3VLForConditionalGeneration:
    """The language model (the vision tower's tensors are left to `load_vision_model`), computing in
    `dtype`, its linear weights stored in `weight_dtype` (default: `dtype`); `dummy`: random weights; `lora`:
    it will serve LoRA adapters (its experts keep their weights as loaded beside the CPU kernel's copy)."""
    check_dummy(config, dummy)
    weights = WeightFormat(weight_dtype, config.quantization)
    model = build_module(lambda: Qwen3VLForConditionalGeneration(config), device, dtype, weights)
    if dummy:
        randomize(model)
    else:
        files = checkpoint_files(config.path)
        weights = ((name, t) for name, t in iter_weights(files) if not name.startswith(VISION_PREFIX))
        model.load_weights(weights, experts_transposed(files, config))
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.keep_dense = lora
    prepack_weights(model)
    return model.eval()
