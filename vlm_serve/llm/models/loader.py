"""Builds the model on its device and loads a (sharded) safetensors checkpoint into it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from vlm_serve.config import ModelConfig
from vlm_serve.llm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlm_serve.vision.vision_tower import Qwen3VLVisionModel

VISION_PREFIX = "model.visual."


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one at a time, so a shard never needs to be in memory whole."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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


def _build(factory, device: torch.device, dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return factory()
    finally:
        torch.set_default_dtype(previous)


def load_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, with_vision: bool = True
) -> Qwen3VLForConditionalGeneration:
    """The whole model; without its vision tower (`model.visual` is None) when an encoder pool runs it."""
    files = checkpoint_files(config.path)
    model = _build(lambda: Qwen3VLForConditionalGeneration(config, with_vision), device, dtype)
    weights = iter_weights(files)
    if not with_vision:
        weights = ((name, t) for name, t in weights if not name.startswith(VISION_PREFIX))
    model.load_weights(weights, experts_transposed(files, config))
    return model.eval()


def load_vision_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Qwen3VLVisionModel:
    """The vision tower alone, for an encoder rank."""
    model = _build(lambda: Qwen3VLVisionModel(config.vision), device, dtype)
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in iter_weights(checkpoint_files(config.path)):
        if not name.startswith(VISION_PREFIX):
            continue
        target = name[len(VISION_PREFIX) :]
        if target not in params or params[target].shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the vision tower")
        params[target].data.copy_(tensor)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {missing[:5]}")
    return model.eval()
