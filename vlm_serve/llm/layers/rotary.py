"""Rotary embeddings: the Qwen VL families' multimodal RoPE (MRoPE) and the positions it rotates by.

Every token has three position ids (temporal, height, width). Text tokens use the same value on all
three; an image's tokens use its grid coordinates. Each rotary frequency is driven by one of the three
axes: interleaved (Qwen3-VL), the axes take turns frequency by frequency (T H W T H W ...), the first
`3 * section[1]` frequencies sharing out H and W, the rest going to T; sectioned (Qwen2-VL, Qwen2.5-VL),
T drives the first `section[0]` frequencies, H the next `section[1]`, W the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_serve.config import VisionConfig
from vlm_serve.multimodal.items import MultimodalItem


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, dim); cos/sin: (tokens, dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def rotated_qkv_heads(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v of the qkv projection's output (tokens, (heads + 2 kv_heads) * head_dim) as (tokens,
    heads or kv_heads, head_dim), q and k rotated (the decoders without a QK norm)."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.view(tokens, heads, head_dim), cos, sin)
    k = apply_rotary(k.view(tokens, kv_heads, head_dim), cos, sin)
    return q, k, v.view(tokens, kv_heads, head_dim)


class MRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], interleaved: bool) -> None:
        super().__init__()
        half = head_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {half}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        axis = torch.zeros(half, dtype=torch.long)
        if interleaved:
            for a in (1, 2):
                axis[a : 3 * mrope_section[a] : 3] = a
        else:
            axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
            axis[mrope_section[0] + mrope_section[1] :] = 2
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (3, tokens) -> cos, sin of shape (tokens, head_dim)."""
        angles = positions[self.axis].T.float() * self.inv_freq  # (tokens, head_dim/2)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_positions(num_tokens: int, mm_items: list[MultimodalItem], vision: VisionConfig) -> tuple[torch.Tensor, int]:
    """The (3, num_tokens) MRoPE positions of a prompt and its decode-time delta.

    Text advances all three axes by one per token. Each media span (an image, a video, or one temporal
    patch group of a video whose groups the prompt sets apart: Qwen3-VL's) places its tokens on its
    (t, h, w) grid starting at the current position: a row and a column per merged patch, and on the
    temporal axis, group after group, `tokens_per_second` per second of video (the item's
    `second_per_grid` a group; Qwen2.5-VL's), one per group where the config has no rate. The position
    then moves on by the larger of the grid's height and width. A token generated at index i gets
    position i + delta, one past the largest position of the prompt (as transformers' `get_rope_index`).
    """
    merge = vision.spatial_merge_size
    spans: list[tuple[int, int, int, int, torch.Tensor]] = []  # start, end, grid h, grid w (merged), t step
    for item in mm_items:
        _, h, w = item.grid_thw
        step = torch.tensor(1.0)
        if item.modality == "video" and vision.tokens_per_second is not None:  # (in float32, as transformers)
            step = torch.tensor(item.second_per_grid or 1.0, dtype=torch.float32) * vision.tokens_per_second
        for start, end in item.spans:
            spans.append((start, end, h // merge, w // merge, step))
    spans.sort(key=lambda span: span[0])
    pieces: list[torch.Tensor] = []
    cursor = 0  # index into the prompt
    pos = 0  # next position value
    for start, end, h, w, step in spans:
        groups, rest = divmod(end - start, h * w)
        if rest or not groups:
            raise ValueError(f"media span of {end - start} tokens does not match its {h}x{w} grid")
        if start > cursor:
            pieces.append(torch.arange(pos, pos + start - cursor).expand(3, -1))
            pos += start - cursor
        tt = (torch.arange(groups) * step).long().repeat_interleave(h * w)
        hh = torch.arange(h).repeat_interleave(w).repeat(groups)
        ww = torch.arange(w).repeat(h * groups)
        pieces.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(h, w)
        cursor = end
    if num_tokens > cursor:
        pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
