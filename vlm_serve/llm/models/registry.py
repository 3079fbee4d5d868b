"""The model families served, by the `architectures` a checkpoint's config.json names: each family's language
model and vision tower classes. Adding a family is its own files and a line here."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vlm_serve.config import ModelConfig
from vlm_serve.llm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlm_serve.llm.models.qwen3_vl_vision import Qwen3VLVisionModel


@dataclass(frozen=True)
class ModelFamily:
    """A family's classes: `language(config)` the decoder the scheduler runs (forward on a ForwardBatch,
    `compute_logits`, `load_weights`), `vision(config.vision)` its tower (`base.VisionTower`)."""

    language: type[nn.Module]
    vision: type[nn.Module]


QWEN3_VL = ModelFamily(Qwen3VLForConditionalGeneration, Qwen3VLVisionModel)
ARCHITECTURES: dict[str, ModelFamily] = {
    "Qwen3VLForConditionalGeneration": QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": QWEN3_VL,
}


def model_family(config: ModelConfig) -> ModelFamily:
    """The family of the checkpoint `config` was read from."""
    family = ARCHITECTURES.get(config.architecture)
    if family is None:
        raise ValueError(
            f"{config.path}: unsupported architecture {config.architecture!r} (served: {', '.join(ARCHITECTURES)})"
        )
    return family
