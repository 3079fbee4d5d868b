"""Counters and histograms the scheduler keeps."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field, fields

from vlm_serve.messages.backend import SpeculativeCounts
from vlm_serve.multimodal.items import MEDIA_STAGES, MultimodalItem

# upper bounds in seconds, from sub-millisecond cache hits to minute-long videos
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Observations counted per bucket (`counts[i]`: values <= `buckets[i]` and above the bucket
    before; the last count is above every bucket), with their sum, as Prometheus exposes them."""

    buckets: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 12))  # 4 KiB ... 4 GiB


def _stage_histograms() -> dict[str, Histogram]:
    return {stage: Histogram() for stage in MEDIA_STAGES}


@dataclass
class SchedulerMetrics:
    """Cumulative since start (or the last `reset`). Time goes to three phases: `schedule` (building a
    chosen batch's tensors), `forward` (the model's forward, logits and sampling: under overlap, the
    forward thread's busy time, which the other two overlap) and `process` (appending tokens, finish
    checks)."""

    num_prefill_batches: int = 0
    num_mixed_batches: int = 0
    num_decode_batches: int = 0
    peak_decode_batch: int = 0  # the most requests one decode batch ran
    computed_prompt_tokens: int = 0  # prompt tokens run through the model
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    spec: SpeculativeCounts = field(default_factory=SpeculativeCounts)  # speculative decoding
    num_retractions: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    time_schedule: float = 0.0
    time_forward: float = 0.0
    time_process: float = 0.0
    media_items: int = 0  # images and videos of requests that passed the encoding stage
    media_seconds: dict[str, Histogram] = field(default_factory=_stage_histograms)  # per MEDIA_STAGES stage
    # PD: requests' KV transfers (sent on the prefill side, received on the decode side), this rank's share
    kv_transfer_bytes: int = 0
    kv_transfer_request_bytes: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    kv_transfer_seconds: Histogram = field(default_factory=Histogram)  # first KV sent / destination given .. done
    kv_transfer_failures: dict[str, int] = field(default_factory=dict)  # by the stage it failed at

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)

    def observe_media(self, items: list[MultimodalItem]) -> None:
        for item in items:
            self.media_items += 1
            for stage, histogram in self.media_seconds.items():
                histogram.observe(getattr(item.timings, stage))

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes += nbytes
        self.kv_transfer_request_bytes.observe(nbytes)
        self.kv_transfer_seconds.observe(seconds)

    def transfer_failed(self, stage: str) -> None:
        self.kv_transfer_failures[stage] = self.kv_transfer_failures.get(stage, 0) + 1

    @property
    def cache_hit_rate(self) -> float:
        total = self.computed_prompt_tokens + self.cached_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0
