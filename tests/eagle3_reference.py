"""The published EAGLE-3 draft step written out from a checkpoint's own tensors, for one sequence with
causal attention and no cache: what the tests hold the serving code to."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CausalAttention:
    """A one-request prefill with no cache: what the paged backends compute for it."""

    def forward(self, q, k, v, layer_id, scaling, batch):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scaling
        )
        return out.transpose(0, 1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    angles = positions[:, None].float() * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def fuse(w: dict, aux: torch.Tensor) -> torch.Tensor:
    """The target's three layers' states, side by side, fused to the draft's width by `fc`."""
    return aux @ w["fc.weight"].T


def draft_reference(w: dict, cfg: dict, embeds, hidden, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, pre-norm, target-vocabulary draft token) at every row of one sequence; `hidden` is
    already the draft's width (fused target states, or the draft's own pre-norm outputs)."""
    eps, heads, kv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    x = torch.cat(
        [rms(embeds, w["midlayer.input_layernorm.weight"], eps), rms(hidden, w["midlayer.hidden_norm.weight"], eps)], -1
    )
    n = x.shape[0]
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), positions, cfg["rope_theta"])
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), positions, cfg["rope_theta"])
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
    attn = CausalAttention().forward(q, k, v, 0, d**-0.5, None).reshape(n, -1)
    residual = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
    h = rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
    prenorm = residual + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    normed = rms(prenorm, w["norm.weight"], eps)
    ids = (normed @ w["lm_head.weight"].T).argmax(-1)
    return normed, prenorm, ids + w["d2t"][ids]
