"""`/metrics` in Prometheus' text format: the HTTP process's latencies plus the scheduler's gauges."""

from __future__ import annotations

from vlm_serve.messages.backend import StatsOut
from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.multimodal.items import MEDIA_STAGES
from vlm_serve.scheduler.metrics import Histogram
from vlm_serve.server.tokenizer_manager import ServerMetrics

PREFIX = "vlm_serve:"


class _Exposition:
    """Collects metric families as text lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _family(self, name: str, kind: str, help_text: str) -> str:
        name = PREFIX + name
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        return name

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self.lines.append(f"{self._family(name, 'gauge', help_text)} {value}")

    def counter(self, name: str, value: float, help_text: str) -> None:
        self.lines.append(f"{self._family(name + '_total', 'counter', help_text)} {value}")

    def labelled(self, name: str, kind: str, values: dict[str, float], label: str, help_text: str) -> None:
        name = self._family(name, kind, help_text)
        self.lines += [f'{name}{{{label}="{key}"}} {value}' for key, value in values.items()]

    def histograms(self, name: str, histograms: dict[str, Histogram], label: str, help_text: str) -> None:
        name = self._family(name, "histogram", help_text)
        for key, h in histograms.items():
            labels = f'{label}="{key}",' if label else ""
            cumulative = 0
            for bound, count in zip((*h.buckets, "+Inf"), h.counts):
                cumulative += count
                self.lines.append(f'{name}_bucket{{{labels}le="{bound}"}} {cumulative}')
            braces = f"{{{labels.rstrip(',')}}}" if labels else ""
            self.lines += [f"{name}_sum{braces} {h.sum}", f"{name}_count{braces} {h.count}"]


def render_metrics(server: ServerMetrics, stats: StatsOut, processor_cache: MultimodalCache) -> str:
    out = _Exposition()
    out.gauge("num_requests_running", stats.num_running, "Requests in the running batch.")
    out.gauge("num_requests_waiting", stats.num_waiting, "Requests in the waiting queue.")
    out.gauge("num_requests_encoding", stats.num_encoding, "Requests waiting for their images/videos to be encoded.")
    out.gauge("kv_cache_usage", stats.kv_usage, "Share of KV cache slots held by requests.")
    out.gauge("max_total_tokens", stats.max_total_tokens, "KV cache size in tokens.")
    out.gauge(
        "prefix_cache_hit_rate", stats.prefix_cache_hit_rate, "Share of prompt tokens served from the prefix cache."
    )
    out.counter("prompt_tokens_cached", stats.cached_prompt_tokens, "Prompt tokens served from the prefix cache.")
    out.counter("prompt_tokens_computed", stats.computed_prompt_tokens, "Prompt tokens run through the model.")
    out.counter("generation_tokens", stats.generated_tokens, "Tokens generated.")
    out.counter("retractions", stats.num_retractions, "Requests retracted when the KV cache ran out.")
    out.counter(
        "spec_decode_num_drafts", stats.spec.verify_steps, "Speculative verify steps of a request that had drafts."
    )
    out.counter("spec_decode_num_draft_tokens", stats.spec.draft_tokens, "Speculative draft tokens verified.")
    out.counter("spec_decode_num_accepted_tokens", stats.spec.accepted_tokens, "Speculative draft tokens kept.")
    out.gauge(
        "spec_decode_mean_accepted_length",
        stats.spec.mean_accepted_length,
        "Tokens per speculative verify step, the step's own included (0 before the first).",
    )
    embeddings = stats.embedding_cache
    for cache_name, counters in (
        ("embedding_cache", embeddings),
        (
            "processor_cache",
            {
                "hits": processor_cache.hits,
                "misses": processor_cache.misses,
                "evictions": processor_cache.evictions,
                "usage_bytes": processor_cache.usage_bytes,
                "inflight_hits": processor_cache.inflight_hits,
            },
        ),
    ):
        what = "vision embeddings" if cache_name == "embedding_cache" else "preprocessed images/videos"
        lookups = counters["hits"] + counters["misses"]
        out.counter(f"{cache_name}_hits", counters["hits"], f"Lookups of {what} that hit.")
        out.counter(f"{cache_name}_misses", counters["misses"], f"Lookups of {what} that missed.")
        out.counter(
            f"{cache_name}_inflight_hits",
            counters["inflight_hits"],
            f"Lookups of {what} that waited for the same item, already being computed (neither hit nor miss).",
        )
        out.counter(f"{cache_name}_evictions", counters["evictions"], f"Cached {what} evicted.")
        out.gauge(f"{cache_name}_usage_bytes", counters["usage_bytes"], f"Bytes of cached {what}.")
        out.gauge(
            f"{cache_name}_hit_rate", counters["hits"] / lookups if lookups else 0.0, f"Hit rate of cached {what}."
        )
    out.labelled(
        "encoder_load_patches",
        "gauge",
        {str(i): load for i, load in enumerate(stats.encoder_load)},
        "rank",
        "Patches in flight per encoder pool rank.",
    )
    out.counter("encoder_restarts", stats.encoder_restarts, "Encoder pool ranks restarted after dying.")
    out.counter("media_items", stats.media_items, "Images and videos that passed the encoding stage.")
    out.counter("vit_items", stats.vit_items, "Images and videos run through a vision tower (once per item in flight).")
    out.histograms(
        "media_stage_seconds",
        {k: Histogram(**v) for k, v in stats.media_seconds.items()},
        "stage",
        f"Time per image/video in each stage: {', '.join(MEDIA_STAGES)}.",
    )
    if stats.hicache is not None:
        tiers = stats.hicache
        out.labelled(
            "hicache_hit_tokens_total",
            "counter",
            tiers.hit_tokens,
            "tier",
            "Prompt tokens served from each cache tier.",
        )
        out.labelled(
            "hicache_copied_bytes_total", "counter", tiers.copied_bytes, "copy", "KV bytes copied between cache tiers."
        )
        out.labelled(
            "hicache_copy_seconds_total",
            "counter",
            tiers.copy_seconds,
            "copy",
            "Time spent copying between cache tiers.",
        )
        out.labelled("hicache_usage_tokens", "gauge", tiers.usage_tokens, "tier", "Tokens held by each lower tier.")
        out.labelled("hicache_capacity_tokens", "gauge", tiers.capacity_tokens, "tier", "Tokens each lower tier holds.")
    if stats.kv_transfer_seconds is not None:  # a PD server
        out.labelled(
            "disaggregation_queue_size",
            "gauge",
            stats.disaggregation_queues,
            "queue",
            "Requests in each prefill/decode queue (bootstrap, inflight; prealloc, transfer).",
        )
        out.counter("kv_transfer_bytes", stats.kv_transfer_bytes, "KV bytes of finished transfers (sent or received).")
        out.histograms(
            "kv_transfer_request_bytes",
            {"": Histogram(**stats.kv_transfer_request_bytes)},
            "",
            "KV bytes per request's transfer.",
        )
        out.histograms(
            "kv_transfer_seconds",
            {"": Histogram(**stats.kv_transfer_seconds)},
            "",
            "Time from a request's first KV sent (prefill) or destination given (decode) to the end of its transfer.",
        )
        out.labelled(
            "kv_transfer_failures_total",
            "counter",
            stats.kv_transfer_failures,
            "stage",
            "KV transfers that failed, by the stage they failed at (bootstrap, transfer, mismatch).",
        )
    out.counter("requests", server.num_requests, "Requests received (a request with n choices counts once).")
    out.labelled("requests_finished_total", "counter", server.num_finished, "reason", "Choices finished, by reason.")
    out.counter("requests_rejected", server.num_rejected, "Requests that failed by their own fault (400).")
    out.labelled(
        "request_failure_total",
        "counter",
        server.num_failed,
        "reason",
        "Requests the server could not serve (5xx), by cause; not counting client aborts.",
    )
    out.counter("prompt_tokens", server.prompt_tokens, "Prompt tokens of finished choices.")
    out.histograms("time_to_first_token_seconds", {"": server.ttft}, "", "Time to the first generated token.")
    out.histograms("inter_token_latency_seconds", {"": server.itl}, "", "Time between generated tokens.")
    out.histograms("e2e_request_latency_seconds", {"": server.e2e}, "", "Time from arrival to the last token.")
    return "\n".join(out.lines) + "\n"
