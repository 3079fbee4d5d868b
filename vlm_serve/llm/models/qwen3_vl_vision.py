"""The Qwen3-VL vision tower, written for serving.

A packed batch of images and video frame groups goes through it at once: patches of all items are
concatenated, and attention stays within each frame (`h * w` patches); frames of equal size are attended
together in one batched call. It returns the merged embeddings (one per `merge x merge` patch block, in
the LLM's hidden size) and the deepstack features taken after the configured blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.config import VisionConfig
from vlm_serve.llm.layers.linear import ReplicatedLinear
from vlm_serve.llm.layers.vision import PatchEmbed, VisionAttention, VisionRotary, block_order, frame_segments
from vlm_serve.llm.lora.layer import LoRABatch, lora_batch
from vlm_serve.llm.models.base import Grid, VisionOutput


def _bilinear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `size` target points on an axis, the two source indices and the weight of the second
    (align_corners=True resampling of a `side`-long table)."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor().long()
    hi = (lo + 1).clamp(max=side - 1)
    return lo, hi, src - lo


class PatchMerger(nn.Module):
    """Merges each merge x merge block of patches into one LLM token (LayerNorm -> MLP)."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = ReplicatedLinear(self.merged, self.merged, bias=True)
        self.linear_fc2 = ReplicatedLinear(self.merged, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle_norm=True) for _ in self.deepstack_visual_indexes]
        )
        self.rotary = VisionRotary(config, self.merge)
        self.adapters = None  # its LoRA adapters (`TowerLoRA`), where the server serves them

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid], slots: list[int] | None = None) -> VisionOutput:
        """`base.VisionTower`'s forward."""
        x = self.patch_embed(pixel_values.to(self.device))
        x = x + torch.cat([self._pos_embed(g) for g in grids]).to(x.dtype)
        angles = torch.cat([self.rotary.angles(g) for g in grids]).to(x.device)
        cos, sin = angles.cos(), angles.sin()
        segments = frame_segments(grids)
        patches = merged = None  # (the blocks' rows are patches, the mergers' merge x merge blocks of them)
        if slots is not None:
            sizes = [t * h * w for t, h, w in grids]
            patches = LoRABatch.of_runs(sizes, slots)
            merged = LoRABatch.of_runs([n // self.merge**2 for n in sizes], slots)
        deepstack = []
        for i, block in enumerate(self.blocks):
            with lora_batch(patches):
                x = block(x, cos, sin, segments)
            if i in self.deepstack_visual_indexes:
                with lora_batch(merged):
                    deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        with lora_batch(merged):
            return VisionOutput(self.merger(x), deepstack)

    def _pos_embed(self, grid: Grid) -> torch.Tensor:
        """The learned square position table resampled bilinearly to the grid, in merge-block order."""
        t, h, w = grid
        side = self.num_grid_per_side
        h_lo, h_hi, h_frac = _bilinear_taps(h, side)
        w_lo, w_hi, w_frac = _bilinear_taps(w, side)
        table = self.pos_embed.weight
        device = table.device

        def tap(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            return table[(rows[:, None] * side + cols[None, :]).to(device)]

        hf, wf = h_frac[:, None, None].to(device), w_frac[None, :, None].to(device)
        emb = (
            tap(h_lo, w_lo) * ((1 - hf) * (1 - wf))
            + tap(h_lo, w_hi) * ((1 - hf) * wf)
            + tap(h_hi, w_lo) * (hf * (1 - wf))
            + tap(h_hi, w_hi) * (hf * wf)
        )
        return block_order(emb, self.merge).repeat(t, 1)
