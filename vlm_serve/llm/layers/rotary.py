"""Rotary embeddings: Qwen3-VL's multimodal RoPE (MRoPE) and the positions it rotates by.

Every token has three position ids (temporal, height, width). Text tokens use the same value on all
three; an image's tokens use its grid coordinates. Each rotary frequency is driven by one of the three
axes; with `mrope_interleaved` the axes take turns frequency by frequency (T H W T H W ...), the first
`3 * section[1]` frequencies sharing out H and W, the rest going to T.
"""

from __future__ import annotations

import torch
from torch import nn

from vlm_serve.multimodal.items import MultimodalItem


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, dim); cos/sin: (tokens, dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


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


def mrope_positions(
    num_tokens: int, mm_items: list[MultimodalItem], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """The (3, num_tokens) MRoPE positions of a prompt and its decode-time delta.

    Text advances all three axes by one per token. Each image (or video frame group, one span each)
    places its tokens on its (t, h, w) grid starting at the current position, then the position moves on
    by the larger of its height and width. A token generated at index i gets position i + delta.
    """
    spans: list[tuple[int, int, int, int]] = []  # start, end, grid_h, grid_w (in merged tokens)
    for item in mm_items:
        _, h, w = item.grid_thw
        for start, end in item.spans:
            spans.append((start, end, h // spatial_merge_size, w // spatial_merge_size))
    spans.sort()
    pieces: list[torch.Tensor] = []
    cursor = 0  # index into the prompt
    pos = 0  # next position value
    for start, end, h, w in spans:
        if end - start != h * w:
            raise ValueError(f"media span of {end - start} tokens does not match its {h}x{w} grid")
        if start > cursor:
            pieces.append(torch.arange(pos, pos + start - cursor).expand(3, -1))
            pos += start - cursor
        hh = torch.arange(h).repeat_interleave(w)
        ww = torch.arange(w).repeat(h)
        pieces.append(torch.stack([torch.zeros_like(hh), hh, ww]) + pos)
        pos += max(h, w)
        cursor = end
    if num_tokens > cursor:
        pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
        pos += num_tokens - cursor
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions, pos - num_tokens
