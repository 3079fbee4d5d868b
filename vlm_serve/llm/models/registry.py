"""The model families served, by the `architectures` a checkpoint's config.json names: each family's language
model and vision tower classes, how its checkpoints name their tensors, and what it is not served with.
Adding a family is its own files and a line here; `ARCHITECTURES` is the one list of what is served."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from vlm_serve.config import ModelConfig
from vlm_serve.llm.models import qwen2_5_vl
from vlm_serve.llm.models.qwen2_5_vl_vision import Qwen2_5_VLVisionModel
from vlm_serve.llm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlm_serve.llm.models.qwen3_vl_vision import Qwen3VLVisionModel

# what a family may not be served with (`ModelFamily.unsupported`)
QUANTIZED = "quantized checkpoints"
LORA = "LoRA adapters"
EAGLE3 = "EAGLE-3 speculative decoding"


def _as_stored(name: str) -> str:
    return name


@dataclass(frozen=True)
class ModelFamily:
    """A family's classes: `language(config)` the decoder the scheduler runs (forward on a ForwardBatch,
    `compute_logits`, `load_weights`), `vision(config.vision)` its tower (`base.VisionTower`).
    `checkpoint_name` turns a checkpoint tensor's name into the layout the classes are named in
    (`model.language_model.*`, `model.visual.*`, `lm_head.*`); `unsupported` names the features (`QUANTIZED`,
    `LORA`, `EAGLE3`) the family is not served with."""

    language: type[nn.Module]
    vision: type[nn.Module]
    checkpoint_name: Callable[[str], str] = _as_stored
    unsupported: frozenset[str] = frozenset()


QWEN3_VL = ModelFamily(Qwen3VLForConditionalGeneration, Qwen3VLVisionModel)
ARCHITECTURES: dict[str, ModelFamily] = {
    "Qwen3VLForConditionalGeneration": QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": QWEN3_VL,
    "Qwen2_5_VLForConditionalGeneration": ModelFamily(
        qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLVisionModel,
        qwen2_5_vl.checkpoint_name,
        frozenset({QUANTIZED, LORA, EAGLE3}),
    ),
}


def model_family(config: ModelConfig) -> ModelFamily:
    """The family of the checkpoint `config` was read from."""
    family = ARCHITECTURES.get(config.architecture)
    if family is None:
        raise ValueError(
            f"{config.path}: unsupported architecture {config.architecture!r} (served: {', '.join(ARCHITECTURES)})"
        )
    return family


def require(config: ModelConfig, feature: str) -> None:
    """Raises a ValueError saying so where the checkpoint's family is not served with `feature`."""
    if feature in model_family(config).unsupported:
        raise ValueError(f"{config.path}: {config.architecture} is not served with {feature}")
