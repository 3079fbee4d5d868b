"""How every TP rank's scheduler takes the same inputs as rank 0, which alone reads requests and runs the
vision encoder: the messages it read (pixel values left out: only rank 0 encodes) and, when media are
encoded, which requests are ready or failed, with their embeddings as one tensor."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from vlm_serve.llm.distributed import ParallelState
from vlm_serve.llm.model_runner import ModelRunner
from vlm_serve.llm.models.base import VisionOutput
from vlm_serve.messages.backend import TokenizedGenerateReq
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.schedule_batch import FinishReason, Req


class TPBroadcast:
    """Rank 0's inputs on every rank of a TP group (`tp_size` > 1)."""

    def __init__(self, parallel: ParallelState, runner: ModelRunner) -> None:
        self.tp_rank, self.cpu_group = parallel.tp_rank, parallel.tp_cpu_group
        self.tensor_group = parallel.tp_broadcast_group
        vision = runner.model_config.vision
        self.embeds_shape = (1 + len(vision.deepstack_visual_indexes), vision.out_hidden_size)  # a row of embeddings
        self.dtype, self.device = runner.dtype, runner.device

    def messages(self, messages: list[Any]) -> list[Any]:
        """Rank 0's messages (on rank 0 itself, as they are)."""
        box = [[without_pixels(m) for m in messages]]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return messages if self.tp_rank == 0 else box[0]

    def encoding_results(
        self, ready: list[Req], failed: list[tuple[Req, FinishReason]], reqs: dict[str, Req], stage: EncodingStage
    ) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Rank 0's encoding results on every rank, the other ranks' `stage` handed the embeddings. The
        request ids and row counts go as a small object, the embeddings as one tensor (1 + deepstack
        layers, rows, hidden)."""
        items = [
            (req.rid, [(i, e.embeds.shape[0]) for i, e in enumerate(req.mm_embeds) if e is not None]) for req in ready
        ]
        box = [(items, [(req.rid, failure) for req, failure in failed])]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        items, failures = box[0]
        rows = sum(n for _, held in items for _, n in held)
        if rows:
            if self.tp_rank == 0:
                flat = torch.cat(
                    [torch.stack([e.embeds, *e.deepstack]) for req in ready for e in req.mm_embeds if e is not None],
                    dim=1,
                )
            else:
                layers, hidden = self.embeds_shape
                flat = torch.empty((layers, rows, hidden), dtype=self.dtype, device=self.device)
            dist.broadcast(flat, src=0, group=self.tensor_group)
        if self.tp_rank == 0:
            return ready, failed
        start = 0
        for rid, held in items:
            embeds = {}
            for i, n in held:
                layers = flat[:, start : start + n]
                embeds[i] = VisionOutput(layers[0], list(layers[1:]))
                start += n
            stage.receive(reqs[rid], embeds)
        failed = [(reqs[rid], failure) for rid, failure in failures]
        for req, _ in failed:
            stage.remove(req)
        return [reqs[rid] for rid, _ in items], failed


def without_pixels(message: Any) -> Any:
    """A generate request as TP ranks other than 0 get it: pixels become shape-only (meta) tensors, so the
    message stays small and its checks give every rank the same answer."""
    if not isinstance(message, TokenizedGenerateReq) or not message.mm_items:
        return message
    items = [dataclasses.replace(it, pixels=it.pixels.without_data()) for it in message.mm_items]
    return dataclasses.replace(message, mm_items=items)
