"""Builds a checkpoint's language model and its vision tower (the classes of its family, `registry.py`) on their
device and loads the (sharded) safetensors checkpoint into them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlm_serve.checkpoint import WeightFormat, build_module, check_dummy, checkpoint_files, iter_weights, randomize
from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.linear import ReplicatedLinear, prepack_weights
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.layers.quantized import is_int_piece
from vlm_serve.llm.models.base import VISION_PREFIX, VisionTower
from vlm_serve.llm.models.registry import QUANTIZED, model_family, require
from vlm_serve.quantization import IntQuantConfig


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


def checkpoint_weights(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, named as its family's classes name their parameters (`model.language_model.*`,
    `model.visual.*`, `lm_head.*`)."""
    name_of = model_family(config).checkpoint_name
    return ((name_of(name), tensor) for name, tensor in iter_weights(checkpoint_files(config.path)))


def load_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    dummy: bool = False,
    lora: bool = False,
) -> nn.Module:
    """The language model (the vision tower's tensors are left to `load_vision_model`), computing in
    `dtype`, its linear weights stored in `weight_dtype` (default: `dtype`); `dummy`: random weights; `lora`:
    it will serve LoRA adapters (its experts keep their weights as loaded beside the CPU kernel's copy)."""
    check_dummy(config, dummy)
    if config.quantization is not None:
        require(config, QUANTIZED)
    weights = WeightFormat(weight_dtype, config.quantization)
    model = build_module(lambda: model_family(config).language(config), device, dtype, weights)
    if dummy:
        randomize(model)
    else:
        files = checkpoint_files(config.path)
        weights = ((name, t) for name, t in checkpoint_weights(config) if not name.startswith(VISION_PREFIX))
        model.load_weights(weights, experts_transposed(files, config))
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.keep_dense = lora
    prepack_weights(model)
    return model.eval()


def load_vision_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    dummy: bool = False,
) -> VisionTower:
    """The vision tower alone (for an encoder rank, or rank 0's inline encoder), computing in `dtype`, its
    linear weights stored in `weight_dtype` (default: `dtype`) and prepacked where the device and dtype
    allow (`prepack_weights`); `dummy`: random weights."""
    if config.quantization is not None:
        require(config, QUANTIZED)
    model = build_module(lambda: model_family(config).vision(config.vision), device, dtype, WeightFormat(weight_dtype))
    if dummy:
        randomize(model)
    else:
        _load_vision_weights(model, config)
    prepack_weights(model)
    return model.eval()


def _load_vision_weights(model: nn.Module, config: ModelConfig) -> None:
    """The checkpoint's vision tensors into `model`; every parameter must get one."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    loaded = set()
    for name, tensor in checkpoint_weights(config):
        if not name.startswith(VISION_PREFIX):
            continue
        target = name[len(VISION_PREFIX) :]
        module, piece = name.rsplit(".", 1)
        linear = isinstance(modules.get(target.rsplit(".", 1)[0]), ReplicatedLinear)
        quantized = isinstance(config.quantization, IntQuantConfig) and config.quantization.stored_quantized(module)
        if is_int_piece(piece, tensor) or (linear and quantized and piece == "weight"):
            raise ValueError(
                f"{name}: the checkpoint quantizes the vision tower, which is served as stored in float only "
                "(quantize with the tower in the ignore list, as the published checkpoints do)"
            )
        if target not in params or params[target].shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the vision tower")
        params[target].data.copy_(tensor)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {missing[:5]}")
