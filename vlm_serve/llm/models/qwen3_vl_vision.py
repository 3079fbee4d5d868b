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
from vlm_serve.llm.kernels import rowwise_cpu
from vlm_serve.llm.layers.linear import ReplicatedLinear
from vlm_serve.llm.layers.sdpa import sdpa
from vlm_serve.llm.lora.layer import LoRABatch, lora_batch
from vlm_serve.llm.models.base import Grid, VisionOutput


def _block_order(x: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w, ...) raster order -> (h*w, ...) in merge-block order (each merge x merge block contiguous)."""
    h, w = x.shape[:2]
    x = x.reshape(h // merge, merge, w // merge, merge, *x.shape[2:])
    return x.transpose(1, 2).reshape(h * w, *x.shape[4:])


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


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = ReplicatedLinear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[tuple[int, int, int]]):
        n, heads = x.shape[0], self.num_heads
        qkv = self.qkv(x)
        kernel = rowwise_cpu.kernel_for(qkv)
        if kernel is not None:  # q and k (side by side in each row) turned in one pass
            qk = rowwise_cpu.rotate_halves(kernel, qkv, 2 * heads, self.head_dim, cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], qkv.view(n, 3, heads, self.head_dim)[:, 2]
        else:
            q, k, v = qkv.view(n, 3, heads, self.head_dim).unbind(1)
            q, k = _rotate(q, cos.unsqueeze(1), sin.unsqueeze(1)), _rotate(k, cos.unsqueeze(1), sin.unsqueeze(1))
        out = torch.empty_like(q)
        # segments: (start, length, count) runs of `count` equal-length frames stored back to back
        for start, length, count in segments:
            end = start + length * count

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t[start:end].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)

            o = sdpa(heads(q), heads(k), heads(v))
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.num_heads, self.head_dim)
        return self.proj(out.view(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (tokens, heads, dim) by angles whose cos/sin are (tokens, 1, dim / 2):
    dimension i turns with dimension i + dim / 2. Computed in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


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


class PatchEmbed(nn.Module):
    """The 3D patch convolution, applied as the matmul it is (stride == kernel)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.proj.weight.shape[0], -1)
        return F.linear(pixels.to(weight.dtype), weight, self.proj.bias)


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle_norm=True) for _ in self.deepstack_visual_indexes]
        )
        # 2D rotary: half of each head's dimensions rotate with the row, half with the column
        spatial_dim = config.hidden_size // config.num_heads // 2
        self.rope_inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float, device="cpu") / spatial_dim)
        )
        self._rope_cache: dict[tuple[int, int], torch.Tensor] = {}
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
        angles = torch.cat([self._rope_angles(g) for g in grids]).to(x.device)
        cos, sin = angles.cos(), angles.sin()
        segments = self._segments(grids)
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
        return _block_order(emb, self.merge).repeat(t, 1)

    def _rope_angles(self, grid: Grid) -> torch.Tensor:
        """Rotary angles of one grid: the row's frequencies, then the column's (cached per frame size)."""
        t, h, w = grid
        angles = self._rope_cache.get((h, w))
        if angles is None:
            rows = torch.arange(h)[:, None].expand(h, w)
            cols = torch.arange(w)[None, :].expand(h, w)
            pos = _block_order(torch.stack([rows, cols], dim=-1), self.merge).float()
            angles = torch.cat([pos[:, :1] * self.rope_inv_freq, pos[:, 1:] * self.rope_inv_freq], dim=-1)
            self._rope_cache[(h, w)] = angles
        return angles.repeat(t, 1)

    @staticmethod
    def _segments(grids: list[Grid]) -> list[tuple[int, int, int]]:
        segments, start = [], 0
        for t, h, w in grids:
            segments.append((start, h * w, t))
            start += t * h * w
        return segments
