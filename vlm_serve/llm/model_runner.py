"""Owns the model, its KV pools and its attention backend: batch in, next tokens out."""

from __future__ import annotations

import logging

import torch

from vlm_serve.config import ModelConfig, ServerArgs
from vlm_serve.llm.distributed import get_parallel_state, init_parallel_state
from vlm_serve.llm.forward_batch import ForwardBatch
from vlm_serve.llm.layers.attention import create_attention_backend
from vlm_serve.llm.layers.sampler import SampleOutput, Sampler
from vlm_serve.llm.mem_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.llm.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.models.loader import load_model
from vlm_serve.llm.scheduler.schedule_batch import Req
from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.vision.items import MultimodalItem

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_TOKENS = 65536  # default CPU pool: plenty for tests and small demos
GPU_KV_MEMORY_FRACTION = 0.85  # of the memory free after loading the weights
DEFAULT_MAX_RUNNING_REQUESTS = 256


class ModelRunner:
    """Owns the model, its KV pools and its attention backend: batch in, next tokens out."""

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.device = server_args.resolved_device()
        self.dtype = server_args.resolved_dtype(model_config)
        init_parallel_state(server_args.tp_size, server_args.ep_size)
        torch.manual_seed(server_args.seed)
        self.model = load_model(model_config, self.device, self.dtype)
        self._init_memory_pools()
        attn = self.model.model.language_model.layers[0].self_attn
        self.attn_backend = create_attention_backend(
            server_args.attention_backend, self.req_to_token_pool, self.token_to_kv_pool,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling,
        )
        self.sampler = Sampler(model_config.eos_token_ids)
        # hash -> (embeddings, deepstack features); counters feed the metrics
        self.embedding_cache: MultimodalCache[tuple[torch.Tensor, list[torch.Tensor]]] = MultimodalCache(
            server_args.mm_cache_mb << 20
        )
        self.num_vision_forwards = 0

    def _init_memory_pools(self) -> None:
        text = self.model_config.text
        page_size = self.server_args.page_size
        num_kv_heads = max(1, text.num_key_value_heads // get_parallel_state().tp_size)
        per_token = TokenToKVPool.bytes_per_token(text.num_hidden_layers, num_kv_heads, text.head_dim, self.dtype)
        size = self.server_args.max_total_tokens
        if size is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                size = int(free * GPU_KV_MEMORY_FRACTION) // per_token
            else:
                size = CPU_KV_BUDGET_TOKENS
        size -= size % page_size
        self.max_total_tokens = size
        self.context_len = self.server_args.context_length or min(text.max_position_embeddings, size)
        max_running = self.server_args.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, max(size // 2, 1))
        self.req_to_token_pool = ReqToTokenPool(max_running, self.context_len, self.device)
        self.token_to_kv_pool = TokenToKVPool(
            size, page_size, text.num_hidden_layers, num_kv_heads, text.head_dim, self.dtype, self.device
        )
        self.allocator = TokenToKVPoolAllocator(size, page_size, self.device)
        logger.info("KV pool: %d tokens (%.1f MiB), context %d", size, size * per_token / 2**20, self.context_len)

    @torch.inference_mode()
    def encode_vision(self, reqs: list[Req]) -> None:
        """Stores each request's vision embeddings. Items found in the embedding cache (by content
        hash) are not encoded again; the others go through the vision tower together, once per hash."""
        entries: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        missing: dict[int, MultimodalItem] = {}
        for item in (item for req in reqs for item in req.mm_items):
            if item.hash in entries or item.hash in missing:
                continue
            cached = self.embedding_cache.get(item.hash)
            if cached is not None:
                entries[item.hash] = cached
            else:
                missing[item.hash] = item
        if missing:
            items = list(missing.values())
            pixels = torch.cat([item.pixel_values for item in items])
            grids = [item.grid_thw for item in items]
            out = self.model.visual.encode(pixels, grids, self.server_args.vit_max_patches_per_pass)
            self.num_vision_forwards += 1
            merge = self.model_config.vision.spatial_merge_size
            sizes = [item.num_tokens(merge) for item in items]
            for item, embeds, *deepstack in zip(items, out.embeds.split(sizes), *(d.split(sizes) for d in out.deepstack)):
                entries[item.hash] = (embeds, list(deepstack))
                self.embedding_cache.put(item.hash, entries[item.hash], embeds.nbytes * (1 + len(deepstack)))
        for req in reqs:
            mine = [entries[item.hash] for item in req.mm_items]
            req.mm_embeds = torch.cat([e[0] for e in mine])
            req.deepstack_embeds = [torch.cat(layer) for layer in zip(*(e[1] for e in mine))]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every new token."""
        batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        return self.sampler(logits, reqs)
