"""The Qwen2.5-VL vision tower, written for serving.

A packed batch of images and video frames goes through it at once. Its blocks are RMS-normed, with a
gated SiLU MLP; most attend within windows of `window_size` pixels of a frame (windows of merged patches:
the rows are reordered so that each window's patches are contiguous, and put back in order after the
merger), those at `fullatt_block_indexes` within the whole frame. Attention never crosses a frame, so a
video can be cut between its temporal patch groups. No learned position embedding (the 2D rotary alone
places a patch) and no deepstack: it returns the merged embeddings alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.config import VisionConfig
from vlm_serve.llm.layers.linear import ReplicatedLinear
from vlm_serve.llm.layers.norm import RMSNorm
from vlm_serve.llm.layers.vision import PatchEmbed, Segments, VisionAttention, VisionRotary, frame_segments
from vlm_serve.llm.models.base import Grid, VisionOutput


class VisionMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), every projection with its bias."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"the Qwen2.5-VL vision MLP is gated by silu, the config says {config.hidden_act!r}")
        self.gate_proj = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Merges each merge x merge block of patches into one LLM token (RMSNorm `ln_q` -> MLP)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            ReplicatedLinear(self.merged, self.merged, bias=True),
            nn.GELU(),
            ReplicatedLinear(self.merged, config.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VLVisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size  # in merged patches
        if self.window < 1:
            raise ValueError(f"window_size {config.window_size} holds no {self.merge}x{self.merge} patch block")
        self.full_attention = set(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config, bias=False)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)
        self.rotary = VisionRotary(config, self.merge)
        self.adapters = None  # (LoRA adapters are not served for this family: `registry.LORA`)

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid], slots: list[int] | None = None) -> VisionOutput:
        """`base.VisionTower`'s forward."""
        if slots is not None and any(slot >= 0 for slot in slots):
            raise ValueError("the Qwen2.5-VL vision tower is not served with LoRA adapters")
        unit = self.merge**2
        order, windows = self._windows(grids)
        x = self.patch_embed(pixel_values.to(self.device))
        x = x.view(-1, unit, x.shape[-1])[order].view(x.shape)
        angles = torch.cat([self.rotary.angles(g) for g in grids])
        angles = angles.view(-1, unit, angles.shape[-1])[order].view(angles.shape).to(x.device)
        cos, sin = angles.cos(), angles.sin()
        frames = frame_segments(grids)  # (the reordering keeps each frame's rows together, in place)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else windows)
        merged = self.merger(x)
        embeds = torch.empty_like(merged)
        embeds[order.to(merged.device)] = merged
        return VisionOutput(embeds, [])

    def _windows(self, grids: list[Grid]) -> tuple[torch.Tensor, Segments]:
        """The order of the merged patches (`merge x merge` blocks) that puts each attention window's
        together: item by item, frame by frame, the windows of a frame in raster order (those at its right
        and bottom edges smaller), the blocks of a window in raster order; and those windows as runs of
        rows in that order."""
        side, unit = self.window, self.merge**2
        order, lengths, offset = [], [], 0
        for t, h, w in grids:
            rows, cols = h // self.merge, w // self.merge
            down, across = -(-rows // side), -(-cols // side)
            index = torch.arange(t * rows * cols).view(t, rows, cols)
            padded = F.pad(index, (0, across * side - cols, 0, down * side - rows), value=-1)
            windows = padded.view(t, down, side, across, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
            kept = windows >= 0
            order.append(windows[kept] + offset)
            lengths += (kept.sum(dim=1) * unit).tolist()
            offset += t * rows * cols
        segments: Segments = []
        start = 0
        for length in lengths:
            if segments and segments[-1][1] == length:  # (another window of the run's length, right after it)
                segments[-1] = (segments[-1][0], length, segments[-1][2] + 1)
            else:
                segments.append((start, length, 1))
            start += length
        return torch.cat(order), segments
