"""Reading a Hugging Face safetensors checkpoint: its files, its tensors one at a time, and building a
module directly on its device in its dtype. Shared by the LLM's loader and the vision tower's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open

M = TypeVar("M", bound=torch.nn.Module)


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


_WEIGHT_DTYPE: ContextVar[torch.dtype | None] = ContextVar("weight_dtype", default=None)


def linear_weight_dtype() -> torch.dtype:
    """The dtype the linear layers being built store their weights in (`build_module`'s `weight_dtype`),
    else the default dtype."""
    return _WEIGHT_DTYPE.get() or torch.get_default_dtype()


def build_module(
    factory: Callable[[], M], device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None = None
) -> M:
    """`factory()` with its parameters created on `device` in `dtype` (no CPU copy first), the weights of
    its linear layers (and experts, embeddings) in `weight_dtype` if given: on CPU the checkpoint's
    bfloat16 weights stay bfloat16 while activations, norms and biases are float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    token = _WEIGHT_DTYPE.set(weight_dtype)
    try:
        with torch.device(device):
            return factory()
    finally:
        _WEIGHT_DTYPE.reset(token)
        torch.set_default_dtype(previous)
