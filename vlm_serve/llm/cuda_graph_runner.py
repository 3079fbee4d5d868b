"""Decode forwards captured as CUDA graphs, one per batch-size bucket, and replayed (as SGLang and vLLM do).

A decode step of a large model is hundreds of small kernels, each launched from Python: at small batches
the launches, not the GPU, set the pace. A graph launches them all at once. A decode batch of `n` requests
replays the graph of the smallest bucket holding `n`: its inputs are copied into the graph's static
buffers, the rows past `n` padding (token 0 at position 0, writing and reading slot 0, the pool's dummy
slot), the attention backend is planned for the padded batch, and the first `n` rows of the graph's
hidden states are the batch's. Logits and sampling run after it, eagerly.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from vlm_serve.llm.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from vlm_serve.llm.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

# the captured batch sizes, as SGLang's: every size up to 8, then steps of 8 and 16
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256]


def capture_sizes(max_batch_size: int) -> list[int]:
    """The buckets up to `max_batch_size`, and `max_batch_size` itself where it is none."""
    sizes = [b for b in BATCH_SIZE_BUCKETS if b < max_batch_size]
    return [*sizes, max_batch_size]


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest of `sizes` (ascending) holding `batch_size`; None if it is larger than all."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    """Captures `model`'s decode forward at each of `capture_sizes(max_batch_size)` and replays it for
    decode batches that fit (`can_run`).

    It holds the model and the attention backend, not the ModelRunner: a reference back would make a cycle,
    which only the garbage collector frees, and so the device memory of an engine shut down would wait for it."""

    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, max_batch_size: int) -> None:
        self.model, self.attn_backend = model, attn_backend
        self.sizes = capture_sizes(max_batch_size)
        attn_backend.init_cuda_graphs(self.sizes)
        device, largest = next(model.parameters()).device, self.sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(3, largest, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches = {size: self._static_batch(size) for size in self.sizes}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
                pool = self._capture(size, pool)
        logger.info("captured CUDA graphs of decode batches of %s requests", self.sizes)

    def _static_batch(self, size: int) -> ForwardBatch:
        """The batch a graph of `size` rows is captured with: views of the static buffers the model reads
        (the attention reads its wrapper's own; the request rows and lengths are only placeholders)."""
        placeholder = torch.ones(size, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:size],
            positions=self.positions[:, :size],
            req_pool_indices=placeholder,
            seq_lens=placeholder,
            out_cache_loc=self.out_cache_loc[:size],
            seq_lens_cpu=[1] * size,
            prefix_lens_cpu=[0] * size,
            extend_lens_cpu=[1] * size,
            attn_backend=self.attn_backend,
            attn_metadata=self.attn_backend.cuda_graph_metadata(size),
            keep_aux=False,
        )

    def _capture(self, size: int, pool):
        batch = self.batches[size]
        self.attn_backend.plan_cuda_graph(size, batch.attn_metadata)  # every row padding
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (lazy initialisation, autotuning) outside the capture
            for _ in range(2):
                self.model(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = self.model(batch)[0]
        self.graphs[size] = graph
        return graph.pool()

    def can_run(self, batch: ForwardBatch) -> bool:
        """Plain decode batches that fit the largest graph (not those an EAGLE-3 draft reads states of,
        nor those with pictures' embeddings)."""
        keeps_aux = batch.keep_aux and bool(self.model.model.language_model.aux_layers)
        return (
            batch.forward_mode.is_decode()
            and batch.batch_size <= self.sizes[-1]
            and not keeps_aux
            and batch.mm_indices is None
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states of `batch` (a decode batch `can_run` accepts), from its graph."""
        n = batch.batch_size
        size = bucket_for(n, self.sizes)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:, :n].copy_(batch.positions)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        if size > n:  # padding rows: token 0 at position 0, in slot 0
            self.input_ids[n:size].zero_()
            self.out_cache_loc[n:size].zero_()
            self.positions[:, n:size].zero_()
        self.attn_backend.plan_cuda_graph(size, batch.attn_metadata)
        self.graphs[size].replay()
        return self.outputs[size][:n]
