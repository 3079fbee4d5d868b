"""Reading a Hugging Face safetensors checkpoint: its files, its tensors one at a time, and building a
module directly on its device in its dtype. Shared by the LLM's loader and the vision tower's."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open

from vlm_serve.quantization import Fp8Config, IntQuantConfig, QuantConfig

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


@dataclass(frozen=True)
class WeightFormat:
    """How the linear layers (and experts, embeddings) being built store their weights."""

    dtype: torch.dtype | None = None  # None: the default dtype
    # a quantized checkpoint's: each linear weight takes the format it is stored in as it loads
    quantization: QuantConfig | None = None

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.dtype or torch.get_default_dtype()

    @property
    def fp8(self) -> Fp8Config | None:
        return self.quantization if isinstance(self.quantization, Fp8Config) else None

    @property
    def int_weights(self) -> IntQuantConfig | None:
        return self.quantization if isinstance(self.quantization, IntQuantConfig) else None


_WEIGHT_FORMAT: ContextVar[WeightFormat] = ContextVar("weight_format", default=WeightFormat())


def weight_format() -> WeightFormat:
    """The weight format of the module `build_module` is building."""
    return _WEIGHT_FORMAT.get()


def linear_weight_dtype() -> torch.dtype:
    """The dtype the linear layers being built store their (unquantized) weights in."""
    return weight_format().weight_dtype


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Gives every parameter random values in place (`load_format="dummy"`): weights of a realistic scale
    (std 0.02) and norms' scales near 1, so that activations neither vanish nor blow up through the layers."""
    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=generator)


def check_dummy(config, dummy: bool) -> None:
    """Random weights are drawn in the model's plain format: a quantized checkpoint's scales are not made."""
    if dummy and config.quantization is not None:
        raise ValueError(
            "load_format dummy does not make quantized weights: serve the checkpoint's config without "
            "its quantization_config, or load its weights"
        )


def build_module(
    factory: Callable[[], M], device: torch.device, dtype: torch.dtype, weights: WeightFormat = WeightFormat()
) -> M:
    """`factory()` with its parameters created on `device` in `dtype` (no CPU copy first), the weights of
    its linear layers (and experts, embeddings) as `weights` says: on CPU a checkpoint's bfloat16 weights
    stay bfloat16 (and FP8 ones FP8) while activations, norms and biases are float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    token = _WEIGHT_FORMAT.set(weights)
    try:
        with torch.device(device):
            return factory()
    finally:
        _WEIGHT_FORMAT.reset(token)
        torch.set_default_dtype(previous)


FINGERPRINT_BLOCKS = 16  # blocks read from each weight file
FINGERPRINT_BLOCK_BYTES = 4096


def checkpoint_fingerprint(model_dir: Path, weights: bool = True) -> str:
    """A digest naming a checkpoint's weights without reading them whole: its config.json, and each weight
    file's name and size and 16 blocks of 4 KiB spread over it (the header, which names and places every
    tensor, among them). Two checkpoints of the same shapes with other weights differ in nearly every block.
    (Without `weights`, the config alone: a checkpoint served with random weights may have no weight files.)"""
    h = hashlib.blake2b(digest_size=32)
    h.update((model_dir / "config.json").read_bytes())
    for file in checkpoint_files(model_dir) if weights else []:
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(size * i // FINGERPRINT_BLOCKS)
                h.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return h.hexdigest()


def single_turn_only(model_dir: Path) -> bool:
    """Whether the checkpoint at `model_dir` was trained on single questions only (`"single_turn": true` in
    its training.json, as the built-in model's): shown a whole conversation, such a model answers about
    every picture in it, or its first question again."""
    record = Path(model_dir) / "training.json"
    return record.is_file() and json.loads(record.read_text()).get("single_turn") is True
