"""Reading a Hugging Face safetensors checkpoint: its files, its tensors one at a time, and building a
module directly on its device in its dtype. Shared by the LLM's loader and the vision tower's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
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


def build_module(factory: Callable[[], M], device: torch.device, dtype: torch.dtype) -> M:
    """`factory()` with its parameters created on `device` in `dtype` (no CPU copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return factory()
    finally:
        torch.set_default_dtype(previous)
