"""What the scheduler tells of itself: the gauges and counters of /metrics, a log line every
`--log-interval` forwards, the idle self-check that finds leaked KV, and the cache flush."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict

from vlm_serve.kv_cache.allocator import TokenToKVPoolAllocator
from vlm_serve.kv_cache.hiradix_cache import HiRadixCache
from vlm_serve.kv_cache.memory_pool import ReqToTokenPool
from vlm_serve.kv_cache.radix_cache import RadixCache
from vlm_serve.llm.forward_batch import ForwardMode
from vlm_serve.messages.backend import FlushCacheOut, StatsOut
from vlm_serve.scheduler.encoding_stage import EncodingStage
from vlm_serve.scheduler.metrics import SchedulerMetrics
from vlm_serve.scheduler.pd_decode import DecodeDisaggregation
from vlm_serve.scheduler.pd_prefill import PrefillDisaggregation
from vlm_serve.scheduler.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


class SchedulerMetricsMixin:
    """The scheduler's reports and health checks: a part of `Scheduler`, which holds the state named here."""

    tp_rank: int
    reqs: dict[str, Req]
    waiting_queue: list[Req]
    running_batch: ScheduleBatch
    tree_cache: RadixCache
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    max_total_tokens: int
    encoding: EncodingStage
    disagg: PrefillDisaggregation | DecodeDisaggregation | None
    metrics: SchedulerMetrics
    _idle_checked: bool

    def flush_cache(self) -> FlushCacheOut:
        """Empties the prefix cache and the embedding cache; refused while requests are in flight."""
        if not self.is_idle():
            return FlushCacheOut(False, f"{len(self.reqs)} request(s) in flight; flush when idle")
        self.tree_cache.evict_all()
        self.encoding.cache.clear()
        return FlushCacheOut(True)

    @property
    def num_used_tokens(self) -> int:
        """KV slots held by requests (free and evictable cache slots are not counted)."""
        return self.max_total_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    def get_stats(self) -> StatsOut | None:
        """Gauges and counters for /metrics (rank 0, which sends them; None elsewhere)."""
        if self.tp_rank != 0:
            return None
        m, cache, encoder = self.metrics, self.encoding.cache, self.encoding.encoder
        if encoder is not None and not len(self.encoding):  # (else it is polled every iteration) the encoder's news
            self.encoding.poll()
        stats = StatsOut(
            num_running=len(self.running_batch.reqs),
            num_waiting=len(self.waiting_queue),
            num_encoding=len(self.encoding),
            kv_usage=self.num_used_tokens / self.max_total_tokens,
            max_total_tokens=self.max_total_tokens,
            prefix_cache_hit_rate=m.cache_hit_rate,
            cached_prompt_tokens=m.cached_prompt_tokens,
            computed_prompt_tokens=m.computed_prompt_tokens,
            generated_tokens=m.generated_tokens,
            num_retractions=m.num_retractions,
            spec=dataclasses.replace(m.spec),
            embedding_cache={
                "hits": cache.hits,
                "misses": cache.misses,
                "evictions": cache.evictions,
                "usage_bytes": cache.usage_bytes,
                "inflight_hits": self.encoding.inflight_hits,
            },
            encoder_load=encoder.load if encoder else [],
            encoder_restarts=encoder.num_restarts if encoder else 0,
            media_items=m.media_items,
            media_seconds={k: asdict(h) for k, h in m.media_seconds.items()},
            vit_items=encoder.num_items if encoder else 0,
        )
        if isinstance(self.tree_cache, HiRadixCache):
            stats.hicache = self.tree_cache.stats(m.cached_prompt_tokens)
        if self.disagg is not None:
            stats.disaggregation_queues = self.disagg.queue_sizes()
            stats.kv_transfer_bytes = m.kv_transfer_bytes
            stats.kv_transfer_request_bytes = asdict(m.kv_transfer_request_bytes)
            stats.kv_transfer_seconds = asdict(m.kv_transfer_seconds)
            stats.kv_transfer_failures = dict(m.kv_transfer_failures)
        return stats

    def self_check_when_idle(self) -> None:
        if self.is_idle() and not self._idle_checked:
            self.check_memory()
            self._idle_checked = True

    def check_memory(self) -> None:
        """Idle self-check: every KV slot is free or held by the tree, no lock is held and every
        request row is free. A failure is a leak, i.e. a bug."""
        problems = []
        leaked = self.num_used_tokens - (
            self.disagg.held_tokens if isinstance(self.disagg, DecodeDisaggregation) else 0
        )
        if leaked != 0:
            problems.append(f"{leaked} KV slots leaked")
        problems += self.tree_cache.idle_problems()
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append(
                f"{self.req_to_token_pool.size - self.req_to_token_pool.available_size()} request rows leaked"
            )
        if problems:
            raise RuntimeError("scheduler idle self-check failed: " + "; ".join(problems))

    def log_stats(self, mode: ForwardMode, num_reqs: int, new_tokens: int) -> None:
        embeddings = self.encoding.cache
        logger.info(
            "%s batch: %d reqs, %d new tokens, KV usage %.2f, cache hit rate %.2f, running %d, queued %d, "
            "encoding %d, embedding cache hit rate %.2f (%.1f MiB)",
            mode.name.lower(),
            num_reqs,
            new_tokens,
            self.num_used_tokens / self.max_total_tokens,
            self.metrics.cache_hit_rate,
            len(self.running_batch.reqs),
            len(self.waiting_queue),
            len(self.encoding),
            embeddings.hit_rate,
            embeddings.usage_bytes / 2**20,
        )
