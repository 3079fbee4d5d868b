"""Qwen3-VL for serving: the Qwen3 text decoder (dense or MoE; QK norm, interleaved MRoPE, deepstack
features from the vision tower, `llm/layers/decoder.py`) and its checkpoint's tensors, quantized or not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from vlm_serve.config import ModelConfig
from vlm_serve.llm.layers.decoder import DecoderStyle, ForConditionalGeneration
from vlm_serve.llm.layers.linear import LinearBase
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.layers.quantized import is_int_piece
from vlm_serve.llm.models.base import load_param, stacked_name
from vlm_serve.quantization import IntQuantConfig

# one expert's projection, as quantized checkpoints store them
_EXPERT = re.compile(r"(.+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")


class Qwen3VLForConditionalGeneration(ForConditionalGeneration):
    """Qwen3-VL's language model (`decoder.ForConditionalGeneration`)."""

    def __init__(self, config: ModelConfig) -> None:
        bias = config.text.attention_bias
        super().__init__(config, DecoderStyle(qkv_bias=bias, o_bias=bias, qk_norm=True, mrope_interleaved=True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], experts_transposed: bool) -> None:
        """Loads checkpoint tensors by their Hugging Face names, sharding them for this rank.

        `experts_transposed` says fused expert tensors are stored (experts, in, out) as the published
        checkpoints store them, rather than transformers 5's (experts, out, in).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        quantization = self.config.quantization
        for name, tensor in weights:
            module, piece = name.rsplit(".", 1)
            if isinstance(quantization, IntQuantConfig) and piece == "weight" and tensor.is_floating_point():
                linear = _EXPERT.fullmatch(name) or isinstance(
                    modules.get(stacked_name(name)[0].removesuffix(".weight")), LinearBase
                )
                if linear and quantization.stored_quantized(module):
                    raise ValueError(f"{name} is stored unquantized, but the quantization_config quantizes {module}")
            expert = _EXPERT.fullmatch(name)
            if expert is not None:  # one expert's projection (quantized checkpoints store them so)
                block, index, proj, kind = expert.groups()
                moe = modules[f"{block}.mlp"]
                if is_int_piece(kind, tensor):
                    moe.load_expert_int(int(index), proj, module, kind, tensor)
                    loaded.add(f"{block}.mlp.{'w2' if proj == 'down_proj' else 'w13'}")
                elif kind == "weight_scale_inv":
                    moe.load_expert_scale(int(index), proj, tensor)
                elif kind == "weight":
                    moe.load_expert(int(index), proj, tensor)
                    loaded.add(f"{block}.mlp.{'w2' if proj == 'down_proj' else 'w13'}")
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                continue
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                moe: SparseMoeBlock = modules[name.rsplit(".experts.", 1)[0]]
                tensor = tensor.transpose(1, 2) if experts_transposed else tensor
                if name.endswith("gate_up_proj"):
                    moe.load_gate_up(tensor)
                    loaded.add(name.replace("experts.gate_up_proj", "w13"))
                else:
                    moe.load_down(tensor)
                    loaded.add(name.replace("experts.down_proj", "w2"))
                continue
            target, shard_id = stacked_name(name)
            if is_int_piece(piece, tensor):  # a piece of an integer-quantized weight
                layer = modules.get(target.rsplit(".", 1)[0])
                if not isinstance(layer, LinearBase):
                    raise ValueError(f"checkpoint tensor {name!r}: a quantized {module} is not supported")
                layer.load_int(module, piece, tensor, shard_id)
                loaded.add(f"{target.rsplit('.', 1)[0]}.weight")
                continue
            if target.endswith(".weight_scale_inv"):  # an FP8 weight's block scales
                layer = modules.get(target.removesuffix(".weight_scale_inv"))
                if not isinstance(layer, LinearBase):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                layer.load_scale(tensor, shard_id)
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            load_param(params[target], name, tensor, shard_id)
            loaded.add(target)
        self.check_loaded(loaded)
