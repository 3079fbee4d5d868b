"""What the rest of the engine knows of a model, whatever its family: the vision tower's output and the
protocol a tower meets (the encoders run it), and the checkpoint names the families share (their fused
projections' pieces, a tensor loaded into its parameter). A family's own files (`qwen3_vl.py`, ...) are
reached through `registry.py` alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

Grid = tuple[int, int, int]
VISION_PREFIX = "model.visual."  # the tower's tensors, as the loader names them (`ModelFamily.checkpoint_name`)


@dataclass
class VisionOutput:
    """Vision embeddings of one or more items (their rows concatenated), with the deepstack features (none
    where the family has no deepstack)."""

    embeds: torch.Tensor  # (merged tokens, out_hidden)
    deepstack: list[torch.Tensor]  # one (merged tokens, out_hidden) per deepstack index

    @property
    def nbytes(self) -> int:
        return self.embeds.nbytes + sum(d.nbytes for d in self.deepstack)

    def rows(self, start: int, end: int) -> VisionOutput:
        return VisionOutput(self.embeds[start:end], [d[start:end] for d in self.deepstack])

    def split(self, sizes: list[int]) -> list[VisionOutput]:
        """One output per item of `sizes` rows, each with its own storage (so each can be freed alone)."""
        outputs, start = [], 0
        for size in sizes:
            piece = self.rows(start, start + size)
            outputs.append(VisionOutput(piece.embeds.clone(), [d.clone() for d in piece.deepstack]))
            start += size
        return outputs

    @staticmethod
    def cat(outputs: list[VisionOutput]) -> VisionOutput:
        if len(outputs) == 1:
            return outputs[0]
        return VisionOutput(
            torch.cat([o.embeds for o in outputs]), [torch.cat(layer) for layer in zip(*(o.deepstack for o in outputs))]
        )


class VisionTower(Protocol):
    """A family's vision tower as the encoders run it: one forward over the patches of several items
    (attention never crossing a temporal patch group, so a video can be cut between groups), merged
    `merge x merge` patches to an embedding."""

    merge: int
    adapters: object  # its LoRA adapters (`TowerLoRA`), or None

    @property
    def device(self) -> torch.device: ...

    def __call__(self, pixel_values: torch.Tensor, grids: list[Grid], slots: list[int] | None = None) -> VisionOutput:
        """pixel_values: the items' patches concatenated, (sum t*h*w, C*T*P*P); grids: their (t, h, w);
        slots: each item's LoRA adapter slot (-1: the base; None: every item the base)."""
        ...


# checkpoint name piece -> (our parameter's name piece, shard id)
_STACKED = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


def stacked_name(name: str) -> tuple[str, str | int | None]:
    """Our parameter's name for a checkpoint tensor's, and its shard in a fused projection (None: whole)."""
    for ckpt_piece, our_piece, shard_id in _STACKED:
        if ckpt_piece in name:
            return name.replace(ckpt_piece, our_piece), shard_id
    return name, None


def load_param(param: torch.nn.Parameter, name: str, tensor: torch.Tensor, shard_id: str | int | None) -> None:
    """A checkpoint tensor into its parameter: through the parameter's loader (which shards it for this
    rank and converts it to the parameter's dtype), or copied whole if the shapes agree."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id)
    elif param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    else:
        param.data.copy_(tensor)
