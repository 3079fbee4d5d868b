"""`Req` (one request's state) and `ScheduleBatch` (the requests of one forward, and how they become
the tensors of a `ForwardBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_serve.llm.forward_batch import ForwardBatch, ForwardMode
from vlm_serve.llm.layers.rotary import mrope_positions
from vlm_serve.llm.mem_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.llm.mem_cache.memory_pool import ReqToTokenPool
from vlm_serve.sampling_params import SamplingParams
from vlm_serve.vision.items import MultimodalItem


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MultimodalItem] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished_reason: str | None = None  # "stop" | "length" | "abort"
    # set when the request enters the engine
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens whose K/V are in the cache
    mrope_positions: torch.Tensor | None = None  # (3, prompt len)
    mrope_delta: int = 0  # decode position = token index + delta
    mm_rows: torch.Tensor | None = None  # (prompt len,) row in mm_embeds, -1 for text
    mm_embeds: torch.Tensor | None = None  # the items' vision embeddings, concatenated
    deepstack_embeds: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None

    def init_positions(self, spatial_merge_size: int) -> None:
        self.mrope_positions, self.mrope_delta = mrope_positions(
            len(self.origin_input_ids), self.mm_items, spatial_merge_size
        )
        rows = torch.full((len(self.origin_input_ids),), -1, dtype=torch.int64)
        next_row = 0
        for item in self.mm_items:
            for start, end in item.spans:
                rows[start:end] = torch.arange(next_row, next_row + end - start)
                next_row += end - start
        self.mm_rows = rows
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def needs_vision(self) -> bool:
        return bool(self.mm_items) and self.mm_embeds is None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


class ScheduleBatch:
    """The requests that run in one forward, with the pools they take KV memory from."""

    def __init__(self, reqs: list[Req], req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator):
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.device = req_to_token_pool.req_to_token.device

    def _last_locs(self, lens: list[int]) -> list[int]:
        table = self.req_to_token_pool.req_to_token
        return [int(table[r.req_pool_idx, n - 1]) if n > 0 else 0 for r, n in zip(self.reqs, lens)]

    def prepare_for_extend(self) -> ForwardBatch:
        """Every request's tokens from its cached length to its full length become new tokens."""
        for req in self.reqs:
            if req.req_pool_idx is None:
                rows = self.req_to_token_pool.alloc(1)
                if rows is None:
                    raise RuntimeError("no free request rows")
                req.req_pool_idx = rows[0]
        prefix_lens = [r.kv_len for r in self.reqs]
        seq_lens = [r.seq_len for r in self.reqs]
        out_cache_loc = self.allocator.alloc_extend(prefix_lens, seq_lens, self._last_locs(prefix_lens))
        if out_cache_loc is None:
            raise RuntimeError("KV cache is full")
        ids, positions, mm_indices, mm_embeds = [], [], [], []
        deepstack: list[list[torch.Tensor]] = []
        offset = 0
        for req, start, end in zip(self.reqs, prefix_lens, seq_lens):
            self.req_to_token_pool.write(req.req_pool_idx, start, out_cache_loc[offset : offset + end - start])
            ids.extend(req.fill_ids[start:end])
            positions.append(self._positions(req, start, end))
            if req.mm_embeds is not None:
                rows = req.mm_rows[start:end]
                in_chunk = (rows >= 0).nonzero().flatten()
                if in_chunk.numel():
                    mm_indices.append(in_chunk + offset)
                    mm_embeds.append(req.mm_embeds[rows[in_chunk]])
                    deepstack.append([d[rows[in_chunk]] for d in req.deepstack_embeds])
            req.kv_len = end
            offset += end - start
        batch = self._forward_batch(ForwardMode.EXTEND, ids, torch.cat(positions, dim=1), out_cache_loc, prefix_lens)
        if mm_indices:
            batch.mm_indices = torch.cat(mm_indices).to(self.device)
            batch.mm_embeds = torch.cat(mm_embeds)
            batch.deepstack_embeds = [torch.cat(layer) for layer in zip(*deepstack)]
        return batch

    def prepare_for_decode(self) -> ForwardBatch:
        """One new token per request: the last sampled one."""
        prefix_lens = [r.seq_len - 1 for r in self.reqs]
        seq_lens = [r.seq_len for r in self.reqs]
        out_cache_loc = self.allocator.alloc_decode(seq_lens, self._last_locs(prefix_lens))
        if out_cache_loc is None:
            raise RuntimeError("KV cache is full")
        for req, slot, pos in zip(self.reqs, out_cache_loc, prefix_lens):
            self.req_to_token_pool.req_to_token[req.req_pool_idx, pos] = slot
            req.kv_len = pos + 1
        ids = [r.output_ids[-1] for r in self.reqs]
        positions = torch.cat([self._positions(r, p, p + 1) for r, p in zip(self.reqs, prefix_lens)], dim=1)
        return self._forward_batch(ForwardMode.DECODE, ids, positions, out_cache_loc, prefix_lens)

    @staticmethod
    def _positions(req: Req, start: int, end: int) -> torch.Tensor:
        """MRoPE positions of tokens start..end-1: the prompt's own, then index + delta for outputs."""
        prompt_len = len(req.origin_input_ids)
        parts = []
        if start < prompt_len:
            parts.append(req.mrope_positions[:, start : min(end, prompt_len)])
        if end > prompt_len:
            gen = torch.arange(max(start, prompt_len), end) + req.mrope_delta
            parts.append(gen.expand(3, -1))
        return torch.cat(parts, dim=1)

    def _forward_batch(self, mode, ids, positions, out_cache_loc, prefix_lens) -> ForwardBatch:
        seq_lens = [r.seq_len for r in self.reqs]
        return ForwardBatch(
            forward_mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=positions.to(self.device),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], device=self.device),
            seq_lens=torch.tensor(seq_lens, device=self.device),
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=[s - p for s, p in zip(seq_lens, prefix_lens)],
        )

    def release(self, req: Req) -> None:
        """Frees a request's KV slots and its row."""
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].long()
        self.allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_len = None, 0
