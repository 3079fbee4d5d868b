"""EAGLE-3 draft heads, in the layout SpecForge publishes them (`LlamaForCausalLMEagle3` checkpoints,
as for the Qwen3-VL drafts): one Llama decoder layer that reads the next token's embedding beside the
target's hidden states at the current position (its low, middle and high layers' outputs, fused by
`fc`), then a norm and an LM head over a smaller draft vocabulary, mapped back to the target's by
`d2t` (target id = draft id + d2t[draft id]).

A draft step's `hidden` is the target's fused features where the target computed the position, and the
draft's own pre-norm output of the step before where it did not (chained drafts); both are
`hidden_size` wide.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlm_serve.checkpoint import WeightFormat, build_module, checkpoint_files, iter_weights
from vlm_serve.config import TextConfig
from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_serve.llm.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear, prepack_weights
from vlm_serve.llm.layers.mlp import GatedMLP
from vlm_serve.llm.layers.norm import RMSNorm
from vlm_serve.llm.layers.rotary import MRotaryEmbedding, apply_rotary
from vlm_serve.llm.models.base import load_param, stacked_name


@dataclass(frozen=True)
class Eagle3Config:
    """The parts of an EAGLE-3 draft's `config.json` that serving uses."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    # the target's layers whose outputs feed the draft (`eagle_aux_hidden_state_layer_ids`); None: the
    # usual low, middle and high ones (`aux_layers`)
    aux_layer_ids: tuple[int, ...] | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Eagle3Config:
        """Reads `path`/config.json; a ValueError names what makes it no EAGLE-3 draft."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"speculative draft model {path}: no config.json")
        raw = json.loads(file.read_text())
        architectures = raw.get("architectures") or []
        if not any(a.endswith("Eagle3") for a in architectures):
            raise ValueError(
                f"speculative draft model {path}: architectures {architectures} name no EAGLE-3 draft "
                "(LlamaForCausalLMEagle3)"
            )
        heads = raw["num_attention_heads"]
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            aux_layer_ids=tuple(ids) if ids else None,
        )

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target's layers whose *input* (the residual stream before them) the draft reads."""
        if self.aux_layer_ids is not None:
            return tuple(i + 1 for i in self.aux_layer_ids)
        return (2, num_target_layers // 2, num_target_layers - 3)

    def check_target(self, target: TextConfig) -> None:
        """A ValueError naming the mismatch if this draft cannot serve `target`."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({self.vocab_size}) is not the target's ({target.vocab_size})")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"the draft reads hidden states of size {self.target_hidden_size}; the target's are {target.hidden_size}"
            )
        if (self.num_key_value_heads, self.head_dim) != (target.num_key_value_heads, target.head_dim):
            raise ValueError(
                f"the draft's KV heads ({self.num_key_value_heads} x {self.head_dim}) must match the target's "
                f"({target.num_key_value_heads} x {target.head_dim}): its KV shares the target's paged pool"
            )
        if max(self.aux_layers(target.num_hidden_layers)) >= target.num_hidden_layers:
            raise ValueError(
                f"the draft reads layers {self.aux_layer_ids} of a {target.num_hidden_layers}-layer target"
            )


class Eagle3DecoderLayer(nn.Module):
    """The draft's one layer: attention over [norm(embedding), norm(hidden)] (twice the hidden size
    wide), the residual stream starting from `hidden`; its KV is layer `kv_layer` of the paged pool."""

    def __init__(self, config: Eagle3Config, kv_layer: int) -> None:
        super().__init__()
        self.layer_id = kv_layer
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads, False
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.scaling = config.head_dim**-0.5

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual), as the target's layers return them."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        qkv = self.qkv_proj(x)
        tokens, d = x.shape[0], self.head_dim
        q = apply_rotary(qkv[:, : self.num_heads * d].view(tokens, self.num_heads, d), cos, sin)
        k = apply_rotary(
            qkv[:, self.num_heads * d : (self.num_heads + self.num_kv_heads) * d].view(tokens, -1, d), cos, sin
        )
        v = qkv[:, (self.num_heads + self.num_kv_heads) * d :].view(tokens, self.num_kv_heads, d)
        out = batch.attn_backend.forward(
            q.contiguous(), k.contiguous(), v.contiguous(), self.layer_id, self.scaling, batch
        )
        residual, h = self.post_attention_layernorm.add_and_norm(hidden, self.o_proj(out.reshape(tokens, -1)))
        return self.mlp(h), residual


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft head. Without embeddings of its own (most published drafts) it reads the
    target's: `share_embeddings` sets them."""

    def __init__(self, config: Eagle3Config, kv_layer: int, own_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        self.fc = ReplicatedLinear(3 * config.target_hidden_size, config.hidden_size, False)
        self.midlayer = Eagle3DecoderLayer(config, kv_layer)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64), persistent=False)
        # the draft's RoPE is one-dimensional: on the first (temporal) axis of the target's positions
        self.rotary_emb = MRotaryEmbedding(config.head_dim, config.rope_theta, [config.head_dim // 2, 0, 0], False)

    def share_embeddings(self, embed_tokens: VocabParallelEmbedding) -> None:
        if self.embed_tokens is None:
            self.embed_tokens = embed_tokens

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, pre-norm output) at each new token: the first gives the draft's logits, the
        second is the `hidden` of the chained step after it. `hidden` is the target's three layers'
        states side by side (fused here by `fc`) or the draft's own pre-norm output."""
        embeds = self.embed_tokens(input_ids)
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden.to(embeds.dtype))
        cos, sin = self.rotary_emb(positions, embeds.dtype)
        x, residual = self.midlayer(embeds, hidden, cos, sin, batch)
        prenorm, normed = self.norm.add_and_norm(residual, x)
        return normed, prenorm

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The target vocabulary's id of the draft's most likely token at each row."""
        ids = self.lm_head(normed).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the checkpoint's tensors by their published names (`midlayer.*`, `fc`, `norm`,
        `lm_head`, `d2t`, and `embed_tokens` where it has its own), sharding them for this rank."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise ValueError(f"d2t: checkpoint shape {tuple(tensor.shape)} != {tuple(self.d2t.shape)}")
                self.d2t.copy_(tensor)
                loaded.add(name)
                continue
            if name == "t2d":  # (the inverse map, as a mask over the target's vocabulary: not needed)
                continue
            target, shard_id = stacked_name(name)
            target = target.replace(".self_attn.", ".")
            if target not in params:
                raise ValueError(f"draft checkpoint tensor {name!r} has no place in the draft model")
            load_param(params[target], name, tensor, shard_id)
            loaded.add(target)
        missing = sorted({*params, "d2t"} - loaded)
        if self.config.draft_vocab_size == self.config.vocab_size and "d2t" in missing:
            missing.remove("d2t")  # (no map: the same vocabulary)
        if missing:
            raise ValueError(f"draft checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def load_eagle3_draft(
    path: str | Path,
    target: TextConfig,
    kv_layer: int,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
) -> Eagle3Draft:
    """The draft in the folder `path`, checked against the target it serves, computing in `dtype` (its
    linear weights stored in `weight_dtype`), its KV in layer `kv_layer` of the paged pool. Without
    embeddings of its own it still needs the target's (`share_embeddings`)."""
    config = Eagle3Config.from_pretrained(path)
    config.check_target(target)
    files = checkpoint_files(Path(path))
    own_embeddings = False
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            own_embeddings |= "embed_tokens.weight" in f.keys()
    draft = build_module(
        lambda: Eagle3Draft(config, kv_layer, own_embeddings), device, dtype, WeightFormat(weight_dtype)
    )
    draft.load_weights(iter_weights(files))
    prepack_weights(draft)
    return draft.eval()
