"""Owns the language model, its KV pools and its attention backend: batch in, next tokens out."""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

from vlm_serve.checkpoint import checkpoint_fingerprint
from vlm_serve.config import (
    Concerns,
    EncoderSettings,
    GpuSettings,
    LoRASettings,
    ModelConfig,
    ModelSettings,
    ParallelSettings,
    SchedulerSettings,
    SpeculativeSettings,
)
from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.hicache_storage import namespace_key
from vlm_serve.kv_cache.memory_pool import KVPoolLayout, ReqToTokenPool, TokenToKVPool
from vlm_serve.llm.cuda_graph_runner import CudaGraphRunner
from vlm_serve.llm.distributed import get_parallel_state, init_parallel_state
from vlm_serve.llm.forward_batch import ForwardBatch, ForwardOutput
from vlm_serve.llm.layers.attention import create_attention_backend
from vlm_serve.llm.layers.sampler import SampleOutput, Sampler
from vlm_serve.llm.lora.adapter import LoRAManager, read_adapter, tower_modules
from vlm_serve.llm.lora.layer import lora_batch
from vlm_serve.llm.models.loader import load_model
from vlm_serve.llm.models.registry import EAGLE3, LORA, require
from vlm_serve.llm.overlap import FutureMap
from vlm_serve.llm.prompt_logprobs import compute_prompt_logprobs
from vlm_serve.llm.speculative.eagle3 import Eagle3Draft, load_eagle3_draft
from vlm_serve.messages.logprobs import PromptLogprobs
from vlm_serve.model_source import resolve_model
from vlm_serve.process import llm_threads

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_TOKENS = 65536  # default CPU pool: plenty for tests and small demos
GPU_KV_MEMORY_FRACTION = 0.85  # of the memory free after loading the weights
DEFAULT_MAX_RUNNING_REQUESTS = 256


@dataclass(frozen=True)
class RunnerConcerns(Concerns):
    """What the model runner reads: the checkpoint's loading, the KV pool's size, the ranks, the CPU threads
    the encoder ranks leave it, adapters, the draft model, the GPU's attention and graphs."""

    model: ModelSettings
    cache: SchedulerSettings
    parallel: ParallelSettings
    encoder: EncoderSettings
    lora: LoRASettings
    speculative: SpeculativeSettings
    gpu: GpuSettings


class ModelRunner:
    """Owns the language model, its KV pools and its attention backend: batch in, next tokens out.

    The vision tower is not here: the encoders (`vision/`) run it and hand the scheduler embeddings."""

    def __init__(self, settings: RunnerConcerns, model_config: ModelConfig) -> None:
        self.settings = settings
        model, lora, speculative = settings.model, settings.lora, settings.speculative
        self.model_config = model_config
        self.device = model.resolved_device()
        self.dtype = model.resolved_dtype(model_config)
        if lora.enable_lora:
            require(model_config, LORA)
        if speculative.speculative_algorithm == "eagle3":
            require(model_config, EAGLE3)
        init_parallel_state(settings.parallel.tp_size, settings.parallel.ep_size)
        torch.manual_seed(model.seed)
        if self.device.type == "cpu" and settings.encoder.vit_dp > 0:
            torch.set_num_threads(llm_threads(settings.encoder))  # the encoder ranks take the other cores
        weight_dtype = model.resolved_weight_dtype(model_config)
        dummy = model.load_format == "dummy"
        self.model = load_model(model_config, self.device, self.dtype, weight_dtype, dummy, lora.enable_lora)
        self.draft: Eagle3Draft | None = None  # an EAGLE-3 draft head, its KV the pool's last layer
        self.draft_path: Path | None = None  # its checkpoint
        if speculative.speculative_algorithm == "eagle3":
            text = self.model.model.language_model
            path = self.draft_path = resolve_model(speculative.speculative_draft_model_path, None, model.download_dir)
            self.draft = load_eagle3_draft(
                path, model_config.text, len(text.layers), self.device, self.dtype, weight_dtype
            )
            self.draft.share_embeddings(text.embed_tokens)
            text.aux_layers = self.draft.config.aux_layers(len(text.layers))
        self._init_memory_pools()
        attn = self.model.model.language_model.layers[0].self_attn
        self.attn_backend = create_attention_backend(
            settings.gpu.attention_backend,
            self.req_to_token_pool,
            self.token_to_kv_pool,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scaling,
        )
        self.cuda_graphs = self._capture_cuda_graphs() if self._uses_cuda_graphs() else None
        self.sampler = Sampler(model_config.eos_token_ids)
        self.lora: LoRAManager | None = None  # LoRA adapters' slots (--enable-lora)
        if lora.enable_lora:
            tower = tower_modules(model_config)
            self.lora = LoRAManager(self.model, lora.max_loras, lora.max_lora_rank, also=tower)
            for name, folder in lora.lora_adapters().items():
                self.lora.load(read_adapter(name, folder, lora.max_lora_rank))
        # a batch has at most one row per request, and the chunked request's on top in a mixed batch
        self.future_map = FutureMap(self.req_to_token_pool.size + 1, self.device)

    def _init_memory_pools(self) -> None:
        text, cache = self.model_config.text, self.settings.cache
        layout = KVPoolLayout(
            num_layers=text.num_hidden_layers + (self.draft is not None),
            num_kv_heads=max(1, text.num_key_value_heads // get_parallel_state().tp_size),
            head_dim=text.head_dim,
            page_size=cache.page_size,
            dtype=self.dtype,
        )
        page_size, per_token = layout.page_size, layout.bytes_per_token
        size = cache.max_total_tokens
        if size is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # at most what the running requests' whole contexts fill: a small model leaves the rest of
                # the GPU to other processes (its encoder ranks started next, other engines)
                running = cache.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
                contexts = running * (cache.context_length or text.max_position_embeddings)
                size = min(int(free * GPU_KV_MEMORY_FRACTION) // per_token, contexts)
            else:
                size = CPU_KV_BUDGET_TOKENS
        size -= size % page_size
        self.max_total_tokens = size
        self.context_len = cache.context_length or min(text.max_position_embeddings, size)
        max_running = cache.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, max(size // 2, 1))
        self.req_to_token_pool = ReqToTokenPool(max_running, self.context_len, self.device)
        self.token_to_kv_pool = TokenToKVPool(size, layout, self.device)
        self.allocator = TokenToKVPoolAllocator(size, page_size, self.device)
        logger.info("KV pool: %d tokens (%.1f MiB), context %d", size, size * per_token / 2**20, self.context_len)

    def kv_namespace(self) -> str:
        """Everything the KV of a prefix depends on besides its tokens (the storage tier's root key): the
        weights, the dtypes, the device, the attention backend, the pool's layout and this rank's place."""
        model, parallel = self.settings.model, get_parallel_state()
        dummy = model.load_format == "dummy"
        weights = [checkpoint_fingerprint(self.model_config.path, weights=not dummy)]
        if dummy:
            weights.append(f"random weights, seed {model.seed}")
        if self.draft_path is not None:  # (its KV is the pool's last layer)
            weights.append(checkpoint_fingerprint(self.draft_path))
        return namespace_key(
            weights,
            str(self.dtype),
            str(model.resolved_weight_dtype(self.model_config)),
            self.device.type,
            self.attn_backend.__class__.__name__,
            astuple(self.token_to_kv_pool.layout)[:4],
            (parallel.tp_size, parallel.ep_size, parallel.tp_rank),
        )

    def _uses_cuda_graphs(self) -> bool:
        """Decode runs as CUDA graphs on a GPU unless disabled, where the attention backend can be captured
        (FlashInfer) and on one rank (collectives inside graphs are not captured here yet)."""
        return (
            self.device.type == "cuda"
            and not self.settings.gpu.disable_cuda_graph
            and self.attn_backend.supports_cuda_graph
            and get_parallel_state().tp_size == 1
        )

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        """The decode graphs; if capturing fails, a warning naming why, and decode runs eagerly (a server
        that serves slower beats one that does not start)."""
        try:
            max_batch_size = min(self.settings.gpu.cuda_graph_max_bs, self.req_to_token_pool.size)
            return CudaGraphRunner(self.model, self.attn_backend, max_batch_size)
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the eager path, which works
            logger.warning(
                "CUDA graphs could not be captured (%s: %s); decode runs eagerly (--disable-cuda-graph silences this)",
                type(exc).__name__,
                exc,
            )
            return None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """On the scheduler's side, when the batch is built: the attention backend's index tensors."""
        batch.attn_backend = self.attn_backend
        batch.attn_metadata = self.attn_backend.init_forward_metadata(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every new token."""
        return self.forward_with_aux(batch)[0]

    @torch.inference_mode()
    def forward_with_aux(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states of every new token, and the states an EAGLE-3 draft reads (or None)."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch) and batch.lora is None:
            return self.cuda_graphs.replay(batch), None
        self.attn_backend.begin_forward(batch)
        with lora_batch(batch.lora):
            return self.model(batch)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ForwardBatch) -> ForwardOutput:
        """Forward, logits and sampling of one launched batch (and the prompt log-probs it was asked
        for), in launch order: its future ids are resolved first, and its sampled tokens stored in the
        FutureMap for the batch after it."""
        self.future_map.resolve(batch)
        hidden, aux = self.forward_with_aux(batch)
        if batch.draft_ids is None:  # (a decode batch's rows are its requests' last tokens already)
            out = self.sample(hidden if batch.forward_mode.is_decode() else hidden[batch.last_token_indices()], batch)
            self.future_map.store(batch.future_start, out.next_token_ids)
        else:  # every position is sampled (a row each): the loop runs no batch ahead of this one's tokens
            out = self.sample(hidden, batch)
        return ForwardOutput(out, self.prompt_logprobs(hidden, batch), aux)

    def sample(self, hidden: torch.Tensor, batch: ForwardBatch) -> SampleOutput:
        """The tokens after `hidden` (a row per sampled position). If sampling the batch raises, each
        request is sampled alone, so that a request's own failure (its settings, its grammar) fails it
        only (`SampleOutput.failures`)."""
        try:
            return self.sampler(self.compute_logits(hidden), batch.sampling)
        except Exception:  # noqa: BLE001 - sampled again request by request, which says whose it is
            logger.exception("sampling a batch of %d requests failed; sampling each alone", batch.batch_size)
            return self.sampler.sample_apart(
                lambda start, stop: self.compute_logits(hidden[start:stop]), batch.sampling, batch.sample_groups()
            )

    @torch.inference_mode()
    def prompt_logprobs(self, hidden: torch.Tensor, batch: ForwardBatch) -> list[PromptLogprobs | None]:
        """Per request, the log-probs of the prompt positions this forward computed, where asked."""
        return compute_prompt_logprobs(self.compute_logits, hidden, batch.prompt_logprob_spans, batch.batch_size)
