"""Random EAGLE-3 draft heads for a target checkpoint, in the published layout (SpecForge's
`LlamaForCausalLMEagle3`: `config.json` with `draft_vocab_size` and `target_hidden_size`, tensors
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, and `embed_tokens` only where the draft has its
own), so that tests exercise the real loading code. A random draft's tokens are almost never the
target's: answers must stay exact all the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def create_eagle3_draft(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    own_embeddings: bool = False,
    aux_layer_ids: list[int] | None = None,
) -> Path:
    """Writes a draft for the checkpoint in `target_dir` into `out_dir` (returned): the target's hidden
    size, heads and KV geometry; a draft vocabulary of the target's first `draft_vocab_size` ids
    (default: all of them)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())["text_config"]
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads, head_dim = target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]
    inter = target["intermediate_size"]
    draft_vocab = draft_vocab_size or vocab
    g = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) / in_features**0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=g)

    tensors = {
        "fc.weight": linear(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": linear(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": linear(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": linear(inter, hidden),
        "midlayer.mlp.up_proj.weight": linear(inter, hidden),
        "midlayer.mlp.down_proj.weight": linear(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": linear(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),  # draft id i is target id i + d2t[i]
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    if own_embeddings:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g) * 0.02
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target["rope_theta"],
        "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
