"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_serve.checkpoint import linear_weight_dtype
from vlm_serve.llm.distributed import get_parallel_state, tp_all_gather, tp_all_reduce
from vlm_serve.llm.kernels import linear_cpu


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds a contiguous slice of the vocabulary; ids outside it contribute zeros."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)  # ceil: the last shard may be padded
        self.vocab_start = self.tp_rank * self.shard_size
        self.dtype = torch.get_default_dtype()  # of the embeddings it gives (its weight may be stored lower)
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, hidden_size, dtype=linear_weight_dtype()), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        rows = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight).to(self.dtype)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.dtype)
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the whole vocabulary (gathered from the TP ranks)."""

    panels: linear_cpu.Panels | None = None

    def prepack(self) -> None:
        """On CPU (float32, bfloat16, float16), a copy of the weight in the C kernel's panels (linear_cpu.c),
        which reads it at decode batch sizes 2-4x faster than `F.linear`; the plain weight stays (the
        embedding may share it)."""
        self.panels = linear_cpu.pack(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.panels is not None:
            local = linear_cpu.linear(hidden, self.panels, None)
        else:
            local = F.linear(hidden, self.weight.to(hidden.dtype))
        logits = tp_all_gather(local)
        return logits[..., : self.vocab_size]
