"""Qwen2.5-VL for serving: the Qwen2 text decoder (`llm/layers/decoder.py`: biased q/k/v projections, no QK
norm, MRoPE whose axes each take a section of the rotary frequencies, no deepstack) and its checkpoint's
tensors, which transformers names as the published checkpoints do (`model.layers.*`, `visual.*`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.decoder import DecoderStyle, ForConditionalGeneration
from vlm_serve.llm.models.base import load_param, stacked_name

_OURS = ("model.language_model.", "model.visual.")


def checkpoint_name(name: str) -> str:
    """A Qwen2.5-VL checkpoint tensor's name (`model.layers.0.mlp.up_proj.weight`, `visual.merger.ln_q.weight`)
    in the layout of the served classes (`model.language_model.layers.0...`, `model.visual.merger...`); a
    name already in it is kept."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(_OURS):
        return "model.language_model." + name.removeprefix("model.")
    return name


class Qwen2_5_VLForConditionalGeneration(ForConditionalGeneration):
    """Qwen2.5-VL's language model (`decoder.ForConditionalGeneration`), from a float checkpoint."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DecoderStyle(qkv_bias=True, o_bias=False, qk_norm=False, mrope_interleaved=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], experts_transposed: bool) -> None:
        """Loads checkpoint tensors (named as `checkpoint_name` gives them), sharding them for this rank.
        (`experts_transposed`: the loader's word on MoE experts, which this dense family has none of.)"""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard_id = stacked_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            load_param(params[target], name, tensor, shard_id)
            loaded.add(target)
        self.check_loaded(loaded)
