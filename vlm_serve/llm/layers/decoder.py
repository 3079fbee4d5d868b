"""The text decoder the Qwen VL families share, written for serving; where they differ (projection
biases, Qwen3's QK norm, how the MRoPE axes share the rotary frequencies) is a family's `DecoderStyle`.

The decoder runs on a flattened batch of new tokens from many requests (`ForwardBatch`), reading and
writing the paged KV cache through the batch's attention backend. Vision embeddings replace the token
embeddings at image/video positions and deepstack features (Qwen3-VL's; a family without them has none)
are added after the first decoder layers, whichever prefill chunk those positions fall into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_serve.config import ModelConfig, TextConfig
from vlm_serve.llm.distributed import get_parallel_state
from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.kernels import decoder_cpu
from vlm_serve.llm.kernels.attention_cpu import PagedBatch
from vlm_serve.llm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_serve.llm.layers.linear import QKVParallelLinear, RowParallelLinear
from vlm_serve.llm.layers.mlp import GatedMLP
from vlm_serve.llm.layers.moe import SparseMoeBlock
from vlm_serve.llm.layers.norm import RMSNorm, qkv_heads
from vlm_serve.llm.layers.rotary import MRotaryEmbedding, rotated_qkv_heads
from vlm_serve.llm.lora.layer import LORA_BATCH


@dataclass(frozen=True)
class DecoderStyle:
    """What tells a family's decoder apart: biases of the q/k/v and output projections, whether q and k are
    RMS-normed per head before the rotary (Qwen3's QK norm), and whether the MRoPE axes take turns frequency
    by frequency (interleaved, Qwen3-VL) or each takes its section of them in turn (Qwen2-VL, Qwen2.5-VL)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mrope_interleaved: bool


class DecoderAttention(nn.Module):
    def __init__(self, config: TextConfig, layer_id: int, style: DecoderStyle) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads, style.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, style.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if style.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if style.qk_norm else None
        self.scaling = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is None:
            q, k, v = rotated_qkv_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin)
        else:
            q, k, v = qkv_heads(qkv, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm, cos, sin)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, self.scaling, batch)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_id: int, style: DecoderStyle) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, style)
        if config.is_moe_layer(layer_id):
            self.mlp: nn.Module = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the layer as two decoder_cpu.c calls, where every part of it runs on the C kernels (`prepack`)
        self.fused: decoder_cpu.DecoderLayerCalls | None = None

    def prepack(self) -> None:
        """Once its parts are packed: the layer's attention and MLP halves as decoder_cpu.c runs them, where
        every part is on the C kernels (float32 activations on CPU, its linears and experts in panels, one
        rank: the halves leave out TP's all-reduces) and the layer is Qwen3's (the C layer norms q and k)."""
        attn, mlp = self.self_attn, self.mlp
        if attn.q_norm is None:
            return
        norms = [self.input_layernorm, attn.q_norm, attn.k_norm, self.post_attention_layernorm]
        moe = isinstance(mlp, SparseMoeBlock)
        linears = [attn.qkv_proj, attn.o_proj, *([mlp.gate] if moe else [mlp.gate_up_proj, mlp.down_proj])]
        kernel = decoder_cpu.LIBRARY.get()
        if (
            kernel is None
            or get_parallel_state().tp_size > 1
            or any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms)
            or len({n.eps for n in norms}) > 1
            or any(linear.panels is None or not linear.fusable() for linear in linears)
            or (moe and (mlp.packed is None or not mlp.fusable()))
        ):
            return
        args = [decoder_cpu.linear_args(linear.panels, linear.bias) for linear in linears]
        hidden = self.input_layernorm.weight.shape[0]
        shape = decoder_cpu.AttentionShape(hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if moe:
            moe_args = (args[2], mlp.num_experts, mlp.top_k, mlp.norm_topk_prob, mlp.expert_start, mlp.packed)
        self.fused = decoder_cpu.DecoderLayerCalls(
            kernel,
            [n.weight for n in norms],
            norms[0].eps,
            args[0],
            args[1],
            shape,
            attn.scaling,
            mlp=None if moe else (args[2], args[3]),
            moe=moe_args if moe else None,
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream `residual + x` (x alone where residual is None); returns the
        stream after it the same way, (MLP output, residual): the next norm adds them as it reads them."""
        residual, h = self.input_layernorm.add_and_norm(residual, x)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, self.self_attn(h, cos, sin, batch))
        return self.mlp(h), residual


class TextModel(nn.Module):
    def __init__(self, config: TextConfig, style: DecoderStyle) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i, style) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(
            config.head_dim, config.rope_theta, config.mrope_section, style.mrope_interleaved
        )
        self.aux_layers: tuple[int, ...] = ()  # layers whose input an EAGLE-3 draft reads

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states, and the residual stream before each of `aux_layers`, side by side
        (None without them)."""
        ids = batch.input_ids
        if batch.mm_indices is not None:
            # image/video positions hold pad values above the vocabulary; their embeddings are replaced
            ids = ids.masked_fill(ids >= self.vocab_size, 0)
        x = self.embed_tokens(ids)
        if batch.mm_indices is not None:
            x[batch.mm_indices] = batch.mm_embeds.to(x.dtype)
        cos, sin = self.rotary_emb(batch.positions, x.dtype)
        step = self.fused_step(x, cos, sin, batch)
        residual = None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers and batch.keep_aux:
                aux[i] = x if residual is None else residual + x
            if step is None:
                x, residual = layer(x, residual, cos, sin, batch)
            else:
                x, residual = step.layer(layer.fused, x, residual, *batch.attn_backend.token_to_kv_pool.get_kv(i))
            if i < len(batch.deepstack_embeds):
                x, residual = residual + x, None
                x[batch.mm_indices] += batch.deepstack_embeds[i].to(x.dtype)
        # (low to high, as SGLang and SpecForge order them; a layer named twice, twice)
        states = torch.cat([aux[i] for i in sorted(self.aux_layers)], dim=-1) if aux else None
        return self.norm.add_and_norm(residual, x)[1], states

    def fused_step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> decoder_cpu.DecoderStep | None:
        """The forward's layers as decoder_cpu.c calls, where every layer has them (`prepack`) and the batch
        is the C attention kernel's; else None: the layers run module by module."""
        if not isinstance(batch.attn_metadata, PagedBatch) or any(layer.fused is None for layer in self.layers):
            return None
        if LORA_BATCH.get() is not None:  # (adapters are added to the linears' outputs module by module)
            return None
        return decoder_cpu.DecoderStep(self.layers[0].fused.kernel, x.shape[0], cos, sin, batch.attn_metadata)


class VLModel(nn.Module):
    """The checkpoint's `model.` part that the LLM runs; `model.visual` (the vision tower) is loaded by the
    encoders (`loader.load_vision_model`), which hand the LLM its embeddings."""

    def __init__(self, config: ModelConfig, style: DecoderStyle) -> None:
        super().__init__()
        self.language_model = TextModel(config.text, style)


class ForConditionalGeneration(nn.Module):
    """The language model with its vision embedding slots; `forward` returns final hidden states,
    `compute_logits` the vocabulary logits. A family's subclass loads its checkpoint (`load_weights`)."""

    def __init__(self, config: ModelConfig, style: DecoderStyle) -> None:
        super().__init__()
        self.config = config
        self.model = VLModel(config, style)
        self.lm_head = ParallelLMHead(config.text.vocab_size, config.text.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.language_model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def check_loaded(self, loaded: set[str]) -> None:
        """Raises unless every parameter got its tensors (`loaded`: the parameters that did; a tied
        `lm_head` is the embedding's)."""
        if self.config.tie_word_embeddings:
            loaded = loaded | {"lm_head.weight"}
        modules = self.modules()
        parts = [name for m in modules if hasattr(m, "missing_pieces") for name in m.missing_pieces()]
        if parts:
            raise ValueError(f"checkpoint is missing {len(parts)} tensors of quantized weights, e.g. {parts[:5]}")
        missing = sorted(set(dict(self.named_parameters(remove_duplicate=False))) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
