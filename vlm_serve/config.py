"""Settings: `ServerArgs` (what the user chose) and `ModelConfig` (what the checkpoint says).

`ServerArgs` is the one settings object that flows from the command line (or a YAML file) into every
process: flat, as the flags are, and made of one frozen dataclass per concern (`ModelSettings`,
`SchedulerSettings`, `EncoderSettings`, `SpeculativeSettings`, `ParallelSettings`, ...). A part of the
engine that needs one concern takes that type (a `ServerArgs` is each of them); values that depend on
others (the device, the chunk size, the encoder's processes, the built-in model's draft) are resolved
once, when the settings are made. `ModelConfig` reads the `config.json` of a Qwen vision-language checkpoint
(Qwen3-VL, Qwen2.5-VL) in the forms in the wild: the one the published checkpoints use (transformers 4.x:
`rope_theta` + `rope_scaling`, `num_experts`; Qwen2.5-VL's text settings at the top level) and the one
transformers 5 writes (`rope_parameters`, `num_local_experts`, a `text_config`). Which architectures are
served is the model registry's to say (`llm/models/registry.py`), when the model is built.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, TypeVar, get_type_hints

from vlm_serve.builtin import BUILTIN_DRAFT, BUILTIN_MODEL

if TYPE_CHECKING:
    import torch

    from vlm_serve.quantization import QuantConfig

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
BUILTIN_DRAFT_MAX_BATCH = 4  # the built-in model's default speculative_disable_by_batch_size
API_KEY_ENV = "VLM_SERVE_API_KEY"  # the API key when neither api_key nor api_key_file is set
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # Pillow's own threshold (`PIL.Image.MAX_IMAGE_PIXELS`)
DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
CHOICES: dict[str, tuple[str, ...]] = {  # the settings that take one of a few names
    "dtype": ("auto", *DTYPES),
    "load_format": ("auto", "dummy"),
    # (quantization.QUANT_METHODS, and vLLM's names of its kernels for the same checkpoints: int_config.ALIASES)
    "quantization": ("fp8", "compressed-tensors", "awq", "gptq", "awq_marlin", "gptq_marlin", "cpu_awq", "cpu_gptq"),
    "device": ("auto", "cpu", "cuda"),
    "attention_backend": ("auto", "cpu", "torch", "flashinfer"),
    "schedule_policy": SCHEDULE_POLICIES,
    "reasoning_parser": ("qwen3",),  # (server/reasoning_parser.py's REASONING_PARSERS)
    "log_level": ("debug", "info", "warning", "error"),
    "disaggregation_mode": ("null", "prefill", "decode"),
    "disaggregation_transfer_backend": ("mooncake", "fake"),
    "speculative_algorithm": ("ngram", "eagle3", "none"),
    "hicache_write_policy": ("write_through", "write_through_selective", "write_back"),
    "hicache_io_backend": ("direct",),
    "hicache_storage_backend": ("file", "mooncake"),
    "hicache_storage_prefetch_policy": ("best_effort", "wait_complete", "timeout"),
}
FLAG_ALIASES = {  # other names the peers give a setting's flag
    "lora_paths": ("--lora-modules",),  # (vLLM's)
    "max_loras": ("--max-loras-per-batch",),  # (SGLang's: every resident adapter may be in one batch)
}
OPTIONAL_CHOICES = {
    "quantization",
    "reasoning_parser",
    "speculative_algorithm",
    "hicache_storage_backend",
}  # of those, the ones that may also be None
POSITIVE = {  # the settings that count something: at least 1 (where set)
    "tp_size", "ep_size", "page_size", "max_running_requests", "max_prefill_tokens", "log_interval",
    "vit_max_patches_per_pass", "vit_threads", "max_media_mb", "max_image_pixels", "limit_mm_per_prompt",
    "mm_max_image_pixels", "mm_max_video_pixels", "mm_max_frames", "tokenizer_workers", "speculative_num_draft_tokens",
    "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
    "speculative_disable_by_batch_size", "cuda_graph_max_bs", "max_loras", "max_lora_rank",
}  # fmt: skip
ABOVE_ZERO = {  # seconds, rates and factors: above 0
    "media_fetch_timeout", "mm_max_fps", "grammar_compile_timeout", "disaggregation_timeout", "schedule_conservativeness",
    "hicache_storage_prefetch_timeout", "hicache_storage_size",
}  # fmt: skip
PORTS = {"port", "disaggregation_bootstrap_port"}
STORAGE_MIN_PAGE_SIZE = 16  # tokens per KV page with a storage tier (an object per page: not one per token)


class Settings:
    """One concern's settings (a frozen dataclass): each field checked as its kind says (`CHOICES`,
    `POSITIVE`, `ABOVE_ZERO`, `PORTS`), then the concern's own rules (`check`)."""

    title: ClassVar[str]  # its group in --help

    def __post_init__(self) -> None:
        for f in fields(self):
            check_setting(f.name, getattr(self, f.name))
        self.check()

    def check(self) -> None:
        """The concern's rules between its fields; a broken one is a ValueError naming them."""

    def _resolve(self, name: str, value: object) -> None:
        """Sets a value derived once, when the settings are made (they are frozen after that)."""
        object.__setattr__(self, name, value)


def check_setting(name: str, value: object) -> None:
    if name in CHOICES and value not in CHOICES[name] and not (value is None and name in OPTIONAL_CHOICES):
        raise ValueError(f"{name} must be one of {', '.join(CHOICES[name])}, not {value!r}")
    if name in POSITIVE and value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, not {value}")
    if name in ABOVE_ZERO and not value > 0:
        raise ValueError(f"{name} must be > 0, not {value}")
    if name in PORTS and not 0 <= value < 65536:
        raise ValueError(f"{name} must be in [0, 65535], not {value}")


@dataclass(frozen=True)
class ModelSettings(Settings):
    """The checkpoint and how it is loaded: its weights' dtype, the device, the sampler's seed."""

    title: ClassVar[str] = "model"
    # a checkpoint folder, or a Hugging Face model id such as Qwen/Qwen3-VL-8B-Instruct
    model: str | None = None  # none = the built-in model
    revision: str | None = None  # branch, tag or commit of a Hugging Face model id; none = main
    download_dir: str | None = None  # Hugging Face cache folder for model ids; none = huggingface_hub's ($HF_HOME)
    served_model_name: str | None = None  # name in the API; none = the model id given, else its folder
    # weights' dtype (and the activations' and KV cache's, except on CPU under auto); auto = the checkpoint's
    # weights as stored (bfloat16 for the published ones), with float32 activations on CPU
    dtype: str = "auto"
    load_format: str = "auto"  # dummy: random weights, no weight file read (speed figures of a config's shapes)
    # the checkpoint's quantized format (fp8, compressed-tensors, awq, gptq), read from its config.json;
    # given, a checkpoint of another format (or of none) is refused
    quantization: str | None = None
    device: str = "auto"  # auto = cuda if available, else cpu
    seed: int = 0  # seed of the sampler's random numbers where a request gives none

    def check(self) -> None:
        if self.device == "auto":
            import torch  # (here: processes that never compute, the detokenizer, need not import it otherwise)

            self._resolve("device", "cuda" if torch.cuda.is_available() else "cpu")

    def resolved_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def resolved_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The dtype of activations, norms and the KV cache: `auto` is float32 on CPU and the checkpoint's
        own dtype on GPU."""
        import torch

        if self.dtype == "auto" and self.device == "cpu":
            return torch.float32
        return self.resolved_weight_dtype(model_config)

    def resolved_weight_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The dtype linear layers, experts and embeddings keep their weights in: `auto` is the checkpoint's
        own (on CPU too: its kernels read bfloat16 weights as stored)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        return getattr(torch, model_config.torch_dtype if model_config.torch_dtype in DTYPES else "bfloat16")


@dataclass(frozen=True)
class SchedulerSettings(Settings):
    """The KV pool, the prefix and multimodal caches, and how the scheduler fills batches."""

    title: ClassVar[str] = "cache and scheduling"
    page_size: int = 1  # tokens per KV cache page
    max_total_tokens: int | None = None  # KV pool size in tokens; none = derived from memory
    max_running_requests: int | None = None  # requests decoded at once; none = derived from the KV pool size
    max_prefill_tokens: int = 16384  # new tokens per prefill batch (clipped to the KV pool)
    chunked_prefill_size: int | None = None  # longest prefill chunk; -1 = no chunking; none = 2048 on CPU, 8192 on GPU
    enable_mixed_chunk: bool = False  # run running requests' decode inside prefill chunks
    disable_overlap_schedule: bool = False  # process each batch's result before launching the next
    schedule_policy: str = "fcfs"  # order of the waiting queue (lpm: longest cached prefix first)
    schedule_conservativeness: float = 1.0  # > 1 reserves more KV for running requests' outputs
    disable_radix_cache: bool = False  # no prefix sharing between requests
    mm_cache_mb: int = 512  # budget of each multimodal cache (processed inputs, vision embeddings); 0 = off
    enable_priority_scheduling: bool = False  # requests' `priority` (higher first) orders the queue
    priority_scheduling_preemption_threshold: int = 10  # priority gap that lets a request preempt
    # longest prompt + answer in tokens
    context_length: int | None = None  # none = the model's max_position_embeddings, at most the KV pool's size
    grammar_compile_timeout: float = 30.0  # seconds a structured-output request may wait for its grammar

    def check(self) -> None:
        if self.chunked_prefill_size not in (None, -1) and self.chunked_prefill_size < self.page_size:
            raise ValueError(f"chunked_prefill_size must be -1 (off) or >= page_size, not {self.chunked_prefill_size}")
        if self.mm_cache_mb < 0:
            raise ValueError(f"mm_cache_mb must be >= 0 (0 disables the cache), not {self.mm_cache_mb}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must hold at least one page, not {self.max_total_tokens}")

    @property
    def prefill_chunk(self) -> int | None:
        """The longest prefill chunk in tokens; None for no chunking (-1, or unset outside `ServerArgs`,
        which sets the device's default)."""
        return None if self.chunked_prefill_size in (None, -1) else self.chunked_prefill_size


@dataclass(frozen=True)
class HiCacheSettings(Settings):
    """The prefix cache's tiers below the KV pool (SGLang's HiCache)."""

    title: ClassVar[str] = "hierarchical cache"
    # keep prefixes evicted from the KV pool in a host-memory pool and load them back on a hit
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # the host pool's size as a multiple of the KV pool's (at least 1)
    hicache_size: float = 0  # the host pool's size in GB (overrides hicache_ratio); 0 = by the ratio
    # when a prefix gets its host copy: write_through when it is cached, write_through_selective when a second
    # request uses it, write_back when it leaves the KV pool
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "direct"  # how pages are copied between the pools (direct: torch gathers/scatters)
    # a storage tier under the host pool, kept across restarts and shared by replicas: file (a directory) or
    # mooncake (Mooncake's distributed store); pages by a key naming their whole prefix, media included
    hicache_storage_backend: str | None = None
    # when a request whose prefix storage holds goes on: best_effort at once, with the pages read by the time it
    # runs; wait_complete when they are all read (its pictures in them then need no vision tower); timeout: the
    # same, after hicache_storage_prefetch_timeout seconds at most
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_storage_prefetch_timeout: float = 1.0  # seconds (the timeout policy)
    hicache_storage_dir: str = "~/.cache/vlm_serve/hicache"  # the file backend's directory
    hicache_storage_size: float = 16.0  # GB the file backend's directory may hold (least recently used pages go)
    # the mooncake backend's settings, as JSON: master_server_address, metadata_server, global_segment_size,
    # local_buffer_size, protocol, device_name
    hicache_storage_backend_extra_config: str | None = None

    def check(self) -> None:
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError(
                "hicache_storage_backend is a tier under the host pool: it needs enable_hierarchical_cache"
            )
        if self.hicache_ratio < 1:
            raise ValueError(
                f"hicache_ratio must be >= 1 (the host pool holds the KV pool's prefixes too), not {self.hicache_ratio}"
            )
        if self.hicache_size < 0:
            raise ValueError(f"hicache_size must be >= 0 GB (0: sized by hicache_ratio), not {self.hicache_size}")


@dataclass(frozen=True)
class EncoderSettings(Settings):
    """Where and how the vision tower runs."""

    title: ClassVar[str] = "encoder"
    # encoder pool processes (GPU i each, or CPU threads); 0 = run the ViT in the scheduler loop; none = 1 on a GPU,
    # 0 on CPU (the tower then takes every core while pictures are encoded, and leaves them all to the LLM after)
    vit_dp: int | None = None
    # CPU threads per encoder rank (--vit-dp 0: of the tower beside running requests); none = an equal share with the LLM
    vit_threads: int | None = None
    vit_max_patches_per_pass: int = 32768  # vision tower passes stay under this; long videos are cut

    def check(self) -> None:
        if self.vit_dp is not None and self.vit_dp < 0:
            raise ValueError(f"vit_dp must be >= 0 (0 runs the vision tower in the scheduler), not {self.vit_dp}")


@dataclass(frozen=True)
class MediaSettings(Settings):
    """How pictures are decoded, by every front end."""

    title: ClassVar[str] = "media"
    # largest picture (width x height as stored) an image or a video frame may be: refused from its header, undecoded
    # default Pillow's own threshold, about 9459 x 9459: above ordinary photos (48 megapixels), yet 268 MB as RGB
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # (--mm-max-image-pixels instead caps what images are resized to)


@dataclass(frozen=True)
class MediaLimitSettings(Settings):
    """What media the HTTP server takes from a request, and from where."""

    title: ClassVar[str] = "media in requests"
    allowed_local_media_path: str | None = None  # requests may name local media files under this folder only
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts http(s) media may come from; none = off
    media_fetch_timeout: float = 10.0  # seconds for a whole remote download
    max_media_mb: int = 64  # largest image or video file a request may send, fetch or name
    limit_mm_per_prompt: int = 16  # images + videos in one request
    mm_max_image_pixels: int = 16_777_216  # the most a request's per-image min/max_pixels may ask
    mm_max_video_pixels: int = 33_554_432  # the same for a whole video clip
    mm_max_fps: float = 8.0  # the highest video sampling rate a request may ask
    mm_max_frames: int = 768  # the most frames a request may ask to sample


@dataclass(frozen=True)
class LoRASettings(Settings):
    """LoRA adapters served beside the base weights, chosen per request."""

    title: ClassVar[str] = "LoRA adapters"
    enable_lora: bool = False  # serve LoRA adapters (peft's format), each request through the one it names
    # adapters loaded at start: NAME=FOLDER, FOLDER (named after it) or vLLM's JSON {"name": ..., "path": ...}
    lora_paths: list[str] = field(default_factory=list)
    max_loras: int = 4  # adapters resident at once (each a slot in the layers it adapts)
    max_lora_rank: int = 16  # the highest rank an adapter may have

    def check(self) -> None:
        if self.lora_paths and not self.enable_lora:
            raise ValueError("lora_paths needs enable_lora")
        if len(self.lora_adapters()) > self.max_loras:
            raise ValueError(f"{len(self.lora_paths)} lora_paths do not fit in max_loras {self.max_loras}")

    def lora_adapters(self) -> dict[str, str]:
        """The adapters to load at start, by name."""
        adapters = {}
        for entry in self.lora_paths:
            if entry.lstrip().startswith("{"):
                try:
                    spec = json.loads(entry)
                    name, path = spec["name"], spec["path"]
                except (json.JSONDecodeError, TypeError, KeyError) as exc:
                    raise ValueError(
                        f"lora_paths entry {entry!r}: not a JSON object with name and path ({exc})"
                    ) from None
            else:
                name, path = entry.split("=", 1) if "=" in entry else (Path(entry).name, entry)
            if name in adapters:
                raise ValueError(f"lora_paths names two adapters {name!r}")
            adapters[name] = path
        return adapters


@dataclass(frozen=True)
class SpeculativeSettings(Settings):
    """Draft tokens verified in one forward."""

    title: ClassVar[str] = "speculative decoding"
    # speculative decoding: draft tokens verified in one forward, answers the same token for token (greedy, seeded)
    # ngram: drafts from the request's own prompt and output
    # eagle3: drafts from an EAGLE-3 draft head (speculative_draft_model_path); either runs in both loops
    # (under PD both servers load the draft: the prefill server computes the draft's KV of the prompt too)
    # none: off; unset: the built-in model drafts with its own head in decode steps of at most 4 requests
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None  # eagle3: the draft's folder or id (the built-in model has its own)
    speculative_num_draft_tokens: int = 4  # draft tokens per request and step
    speculative_ngram_min_match_window_size: int = 1  # shortest suffix of a request's tokens matched (ngram)
    speculative_ngram_max_match_window_size: int = 3  # longest suffix matched (ngram)
    # decode steps of more requests than this run without drafts; none = draft at every size
    # (a verify step's wider forward pays off at small batches, where reading the weights bounds a step)
    speculative_disable_by_batch_size: int | None = None

    def check(self) -> None:
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ValueError(
                f"speculative_ngram_min_match_window_size ({self.speculative_ngram_min_match_window_size}) must not "
                f"exceed speculative_ngram_max_match_window_size ({self.speculative_ngram_max_match_window_size})"
            )

    @property
    def speculating(self) -> bool:
        """Whether decode steps verify draft tokens (`speculative_algorithm` ngram or eagle3)."""
        return self.speculative_algorithm in ("ngram", "eagle3")


@dataclass(frozen=True)
class ParallelSettings(Settings):
    """Tensor and expert parallelism, over one machine or several."""

    title: ClassVar[str] = "parallelism"
    tp_size: int = 1  # tensor-parallel ranks (GPUs), one scheduler process each
    ep_size: int = 1  # expert-parallel ranks among the TP ranks (MoE models; must divide tp_size)
    nnodes: int = 1  # machines the TP ranks span (tp_size / nnodes ranks each)
    node_rank: int = 0  # this machine's place; node 0 also runs the HTTP server and the encoder pool
    dist_init_addr: str | None = None  # HOST:PORT where the ranks meet (node 0's); needed with nnodes > 1

    def check(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), not {self.node_rank}")
        if self.tp_size % self.nnodes != 0:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr HOST:PORT (node 0's address, the same on every node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be HOST:PORT, not {self.dist_init_addr!r}")

    @property
    def node_tp_ranks(self) -> range:
        """The TP ranks this node runs."""
        per_node = self.tp_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


@dataclass(frozen=True)
class DisaggregationSettings(Settings):
    """This server's side of PD and how its KV moves."""

    title: ClassVar[str] = "prefill/decode disaggregation"
    # prefill/decode disaggregation (PD), behind sglang-router --pd-disaggregation
    disaggregation_mode: str = "null"  # null: prefill and decode here; prefill / decode: this server's side of PD
    disaggregation_bootstrap_port: int = 8998  # prefill side: where decode servers find its ranks
    disaggregation_transfer_backend: str = "mooncake"  # how KV moves (fake: it does not; for tests)
    disaggregation_ib_device: str | None = None  # RDMA device(s) for Mooncake, e.g. mlx5_0; none = TCP
    disaggregation_timeout: float = 300.0  # seconds a PD request waits for its other side in each queue


@dataclass(frozen=True)
class HttpSettings(Settings):
    """Where the HTTP server listens, who may call it, and its front end's work."""

    title: ClassVar[str] = "HTTP server"
    host: str = "127.0.0.1"  # address the HTTP server listens on (0.0.0.0: every interface)
    port: int = 30000  # port the HTTP server listens on
    # every endpoint but /health then needs "Authorization: Bearer <key>" (never logged)
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None  # a file holding the API key on one line (keeps it off the command line)
    tokenizer_workers: int = 4  # threads rendering, loading and preprocessing requests in the HTTP process
    reasoning_parser: str | None = None  # qwen3: split <think>...</think> into reasoning_content
    responses_store_size: int = 1000  # /v1/responses kept in memory (store: true) for previous_response_id; 0 = none

    def check(self) -> None:
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, not {self.responses_store_size}")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give the API key by api_key (--api-key) or by api_key_file (--api-key-file), not both")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")


@dataclass(frozen=True)
class GpuSettings(Settings):
    """The attention backend and CUDA graphs."""

    title: ClassVar[str] = "GPU only"
    attention_backend: str = "auto"  # auto = flashinfer on CUDA, the C kernel (cpu) on CPU where it runs, else torch
    disable_cuda_graph: bool = False  # on CUDA, run decode batches eagerly instead of replaying captured graphs
    cuda_graph_max_bs: int = 160  # the largest decode batch replayed as a CUDA graph (larger ones run eagerly)


@dataclass(frozen=True)
class LogSettings(Settings):
    """What the processes log."""

    title: ClassVar[str] = "logging"
    log_level: str = "warning"  # info shows the scheduler's log lines
    log_interval: int = 40  # scheduler steps between log lines


# the concerns, in the order --help shows them
CONCERNS: tuple[type[Settings], ...] = (
    ModelSettings, SchedulerSettings, HiCacheSettings, EncoderSettings, MediaSettings, MediaLimitSettings,
    LoRASettings, SpeculativeSettings, ParallelSettings, DisaggregationSettings, HttpSettings, GpuSettings,
    LogSettings,
)  # fmt: skip
# What an in-process `Engine` reads (the `generate`, `caption` and `demo` commands); the others are the HTTP
# server's, its requests' limits, and ranks in processes of their own (TP/EP, nodes, PD).
ENGINE_CONCERNS: tuple[type[Settings], ...] = (
    ModelSettings, SchedulerSettings, HiCacheSettings, EncoderSettings, MediaSettings, LoRASettings,
    SpeculativeSettings, GpuSettings, LogSettings,
)  # fmt: skip
SETTING_GROUPS: dict[str, tuple[str, ...]] = {c.title: tuple(f.name for f in fields(c)) for c in CONCERNS}
ENGINE_SETTINGS = tuple(f.name for c in ENGINE_CONCERNS for f in fields(c))


@dataclass(frozen=True)
class ServerArgs(
    LogSettings,
    GpuSettings,
    HttpSettings,
    DisaggregationSettings,
    ParallelSettings,
    SpeculativeSettings,
    LoRASettings,
    MediaLimitSettings,
    MediaSettings,
    EncoderSettings,
    HiCacheSettings,
    SchedulerSettings,
    ModelSettings,
):  # (CONCERNS, last first: a dataclass's fields are its last base's first)
    """Everything a deployment can set: every concern's settings, flat. Field names are the command-line
    flags (`--page-size` ...)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_setting(f.name, getattr(self, f.name))
        for concern in CONCERNS:
            concern.check(self)
        # the rules across concerns, and what they resolve
        builtin = self.model is None or Path(self.model).expanduser().resolve() == BUILTIN_MODEL
        if self.speculative_algorithm is None and builtin:
            # its trained draft makes its answers faster where decode steps are small (bench_speculative.py)
            self._resolve("speculative_algorithm", "eagle3")
            if self.speculative_disable_by_batch_size is None:
                self._resolve("speculative_disable_by_batch_size", BUILTIN_DRAFT_MAX_BATCH)
        if self.speculative_algorithm == "eagle3" and self.speculative_draft_model_path is None and builtin:
            self._resolve("speculative_draft_model_path", str(BUILTIN_DRAFT))  # the built-in model's own draft head
        if (self.speculative_algorithm == "eagle3") != (self.speculative_draft_model_path is not None):
            raise ValueError(
                "speculative_algorithm eagle3 needs speculative_draft_model_path (the draft head's folder or id)"
                if self.speculative_algorithm == "eagle3"
                else "speculative_draft_model_path is for speculative_algorithm eagle3"
            )
        if self.hicache_storage_backend is not None and self.page_size < STORAGE_MIN_PAGE_SIZE:
            raise ValueError(
                f"hicache_storage_backend stores one object per KV page: it needs page_size >= {STORAGE_MIN_PAGE_SIZE}"
                f" (64 is a good size), not {self.page_size}"
            )
        if self.disaggregation_mode == "decode":
            self._resolve("vit_dp", 0)  # a decode server never encodes media (its KV comes from the prefill server)
        if self.vit_dp is None:
            self._resolve("vit_dp", 0 if self.device == "cpu" else 1)
        if self.chunked_prefill_size is None:
            # 2048 on CPU, as vLLM's CPU build: a burst of prompts then reaches its first tokens one chunk after
            # another instead of all at the end of one long prefill (mean TTFT of a 16-prompt burst 1.9 -> 1.5 s
            # on the small MoE)
            self._resolve("chunked_prefill_size", 2048 if self.device == "cpu" else 8192)

    def concern(self, kind: type[S]) -> S:
        """The values of one concern as that concern's own frozen settings (checked already, as part of
        these): what a part that reads the concern is handed."""
        part = object.__new__(kind)
        for f in fields(kind):
            object.__setattr__(part, f.name, getattr(self, f.name))
        return part

    def with_api_key(self, environ: Mapping[str, str]) -> ServerArgs:
        """These settings with the API key in `api_key`: as given, else read from `api_key_file`, else
        `$VLM_SERVE_API_KEY` from `environ` (none of them: no key). An empty or unreadable key is a
        ValueError, which never shows the key."""
        if self.api_key_file is not None:
            path = self.api_key_file
            try:
                key = Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise ValueError(f"the API key file {path} is not UTF-8 text") from None
            if not key or "\n" in key:
                raise ValueError(f"the API key file {path} must hold the key, on one line")
        elif self.api_key is None and API_KEY_ENV in environ:
            key = environ[API_KEY_ENV]
            if not key.strip():
                raise ValueError(f"{API_KEY_ENV} is set but empty")
        else:
            return self
        return replace(self, api_key=key, api_key_file=None)


S = TypeVar("S", bound=Settings)
C = TypeVar("C", bound="Concerns")


class Concerns:
    """A part's settings: a frozen dataclass with one field per concern it reads, typed as that concern's
    settings (or as the concerns of a part it makes), so that the part reads only those (`RunnerConcerns`,
    `SchedulerConcerns`, ...)."""

    @classmethod
    def of(cls: type[C], args: ServerArgs) -> C:
        kinds = get_type_hints(cls)
        return cls(**{f.name: _part_of(args, kinds[f.name]) for f in fields(cls)})


def _part_of(args: ServerArgs, kind: type) -> Settings | Concerns:
    return kind.of(args) if issubclass(kind, Concerns) else args.concern(kind)


@functools.cache
def setting_docs() -> Mapping[str, str]:
    """Each `ServerArgs` field's meaning, read from its comments in this file (the lines just above it and
    the end of its own): the command line's help comes from here, so that it cannot drift from the code."""
    source = Path(__file__).read_text()
    lines = source.splitlines()
    comments = {  # line number (0-based) -> comment text
        token.start[0] - 1: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    concerns = {concern.__name__: concern for concern in CONCERNS}
    docs = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name in concerns):
            continue
        names = {f.name for f in fields(concerns[node.name])}
        for setting in node.body:
            if not (isinstance(setting, ast.AnnAssign) and isinstance(setting.target, ast.Name)):
                continue
            if setting.target.id not in names:
                continue
            parts, line = [comments.get(setting.end_lineno - 1, "")], setting.lineno - 2
            while line in comments and lines[line].lstrip().startswith("#"):
                parts.insert(0, comments[line])
                line -= 1
            docs[setting.target.id] = "; ".join(p for p in parts if p)
    return MappingProxyType(docs)


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int = 0  # Qwen3-VL's learned position grid (side x side); 0: none
    deepstack_visual_indexes: list[int] = field(default_factory=list)  # Qwen3-VL: blocks feeding early LM layers
    in_channels: int = 3
    rope_theta: float = 10000.0
    # Qwen2.5-VL: attention in windows of `window_size` pixels, but at the blocks `fullatt_block_indexes`
    window_size: int = 0
    fullatt_block_indexes: list[int] = field(default_factory=list)
    # Qwen2.5-VL: a video's temporal MRoPE positions advance this many per second (None: one per patch group)
    tokens_per_second: float | None = None


@dataclass
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]  # rotary frequencies per MRoPE axis (t, h, w); how they share out is the family's
    max_position_embeddings: int
    attention_bias: bool = False
    # mixture of experts (num_experts == 0 for dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class ModelConfig:
    """The parts of a Qwen VL `config.json` that the engine uses, in one normalised form."""

    path: Path
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool
    torch_dtype: str
    eos_token_ids: list[int]
    quantization: QuantConfig | None = None  # a quantized checkpoint's `quantization_config`

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
        """The checkpoint's config; `quantization` (`--quantization`) the format it must be quantized in."""
        from vlm_serve.quantization import read_quantization_config  # (torch: only where a model is read)

        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} is not a model directory: no config.json")
        raw = json.loads(config_file.read_text())
        architecture = (raw.get("architectures") or [""])[0]
        if not isinstance(raw.get("vision_config"), dict):
            raise ValueError(
                f"{path}: unsupported architecture {architecture!r}: its config.json has no vision_config "
                "(not a vision-language checkpoint)"
            )
        text_raw = raw.get("text_config") or raw  # (Qwen2.5-VL's published configs keep it at the top level)
        vision_raw = raw["vision_config"]
        tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or text_raw.get("dtype") or text_raw.get("torch_dtype")
        return cls(
            path=path,
            architecture=architecture,
            text=_text_config(text_raw),
            vision=_vision_config(vision_raw),
            image_token_id=raw.get("image_token_id", 151655),
            video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            vision_end_token_id=raw.get("vision_end_token_id", 151653),
            tie_word_embeddings=bool(tie),
            torch_dtype=dtype or "bfloat16",
            eos_token_ids=_eos_token_ids(path, raw),
            quantization=read_quantization_config(path, quantization),
        )


def _rope(raw: dict) -> tuple[float, list[int]]:
    """Reads MRoPE settings from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 5_000_000.0))
    section = params.get("mrope_section", [24, 20, 20])
    return float(theta), list(section)


def _text_config(raw: dict) -> TextConfig:
    theta, section = _rope(raw)
    heads = raw["num_attention_heads"]
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0)) or 0
    return TextConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size", 0),
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        hidden_act=raw.get("hidden_act", "silu"),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        mrope_section=section,
        max_position_embeddings=raw.get("max_position_embeddings", 128000),
        attention_bias=raw.get("attention_bias", False),
        num_experts=num_experts,
        num_experts_per_tok=raw.get("num_experts_per_tok", 0),
        moe_intermediate_size=raw.get("moe_intermediate_size", 0),
        norm_topk_prob=raw.get("norm_topk_prob", True),
        decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=list(raw.get("mlp_only_layers") or []),
    )


def _vision_config(raw: dict) -> VisionConfig:
    rope = raw.get("rope_parameters") or {}
    return VisionConfig(
        depth=raw["depth"],
        hidden_size=raw["hidden_size"],
        num_heads=raw["num_heads"],
        intermediate_size=raw["intermediate_size"],
        hidden_act=raw.get("hidden_act", "gelu_pytorch_tanh"),
        patch_size=raw.get("patch_size", 16),
        temporal_patch_size=raw.get("temporal_patch_size", 2),
        spatial_merge_size=raw.get("spatial_merge_size", 2),
        out_hidden_size=raw["out_hidden_size"],
        num_position_embeddings=raw.get("num_position_embeddings", 0),
        deepstack_visual_indexes=list(raw.get("deepstack_visual_indexes") or []),
        in_channels=raw.get("in_channels", raw.get("in_chans", 3)),  # (in_chans: Qwen2.5-VL's published name)
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=raw.get("window_size", 0),
        fullatt_block_indexes=list(raw.get("fullatt_block_indexes") or []),
        tokens_per_second=raw.get("tokens_per_second"),
    )


def _eos_token_ids(path: Path, raw: dict) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    eos = None
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id", raw.get("text_config", {}).get("eos_token_id"))
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
