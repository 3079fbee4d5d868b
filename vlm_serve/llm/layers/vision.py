"""The pieces the Qwen VL vision towers share: the 3D patch embedding, the 2D rotary angles of a grid's
patches, attention within runs of equal-length segments, and the merge-block order the patches come in.

A tower's patches come merge block by merge block (each `merge x merge` block of patches contiguous, the
blocks in raster order), frame after frame: the processor's patchify lays them out so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.config import VisionConfig
from vlm_serve.llm.kernels import rowwise_cpu
from vlm_serve.llm.layers.linear import ReplicatedLinear
from vlm_serve.llm.layers.sdpa import sdpa

Segments = list[tuple[int, int, int]]  # (start, length, count): `count` segments of `length` rows back to back


def block_order(x: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w, ...) raster order -> (h*w, ...) in merge-block order (each merge x merge block contiguous)."""
    h, w = x.shape[:2]
    x = x.reshape(h // merge, merge, w // merge, merge, *x.shape[2:])
    return x.transpose(1, 2).reshape(h * w, *x.shape[4:])


def frame_segments(grids: list[tuple[int, int, int]]) -> Segments:
    """Each item's frames (`h * w` patches each) as the segments attention stays within."""
    segments, start = [], 0
    for t, h, w in grids:
        segments.append((start, h * w, t))
        start += t * h * w
    return segments


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (tokens, heads, dim) by angles whose cos/sin are (tokens, 1, dim / 2):
    dimension i turns with dimension i + dim / 2. Computed in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    """The 3D patch convolution, applied as the matmul it is (stride == kernel)."""

    def __init__(self, config: VisionConfig, bias: bool) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.proj.weight.shape[0], -1)
        return F.linear(pixels.to(weight.dtype), weight, self.proj.bias)


class VisionRotary:
    """2D rotary angles of a grid's patches: half of each head's dimensions turn with the patch's row, half
    with its column (cached per frame size)."""

    def __init__(self, config: VisionConfig, merge: int) -> None:
        spatial_dim = config.hidden_size // config.num_heads // 2
        self.inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float, device="cpu") / spatial_dim)
        )
        self.merge = merge
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def angles(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """(t*h*w, head_dim / 2) angles in the patches' (merge-block) order: the row's, then the column's."""
        t, h, w = grid
        angles = self._cache.get((h, w))
        if angles is None:
            rows = torch.arange(h)[:, None].expand(h, w)
            cols = torch.arange(w)[None, :].expand(h, w)
            pos = block_order(torch.stack([rows, cols], dim=-1), self.merge).float()
            angles = torch.cat([pos[:, :1] * self.inv_freq, pos[:, 1:] * self.inv_freq], dim=-1)
            self._cache[(h, w)] = angles
        return angles.repeat(t, 1)


class VisionAttention(nn.Module):
    """Bidirectional attention of a tower's block within segments of its rows, q and k turned by the
    rows' 2D rotary angles."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = ReplicatedLinear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        qkv = self.qkv(x)
        kernel = rowwise_cpu.kernel_for(qkv)
        if kernel is not None:  # q and k (side by side in each row) turned in one pass
            qk = rowwise_cpu.rotate_halves(kernel, qkv, 2 * heads, self.head_dim, cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv.view(n, 3, heads, self.head_dim)[:, 2]
        else:
            q, k, v = qkv.view(n, 3, heads, self.head_dim).unbind(1)
            q, k = rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
        out = torch.empty_like(q)
        for start, length, count in segments:
            end = start + length * count

            def heads_of(t: torch.Tensor) -> torch.Tensor:
                return t[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)

            o = sdpa(heads_of(q), heads_of(k), heads_of(v))
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.num_heads, self.head_dim)
        return self.proj(out.view(n, -1))
