"""Counters the scheduler keeps, and its periodic log line."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class SchedulerMetrics:
    """Cumulative since start (or the last `reset`). Step time is split in three phases: `schedule`
    (choosing the batch and building its tensors), `forward` (model forward, logits, sampling) and
    `process` (appending tokens, finish checks, caching prefixes)."""

    num_prefill_batches: int = 0
    num_mixed_batches: int = 0
    num_decode_batches: int = 0
    computed_prompt_tokens: int = 0  # prompt tokens run through the model
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    time_schedule: float = 0.0
    time_forward: float = 0.0
    time_process: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    @property
    def cache_hit_rate(self) -> float:
        total = self.computed_prompt_tokens + self.cached_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward."""
        total = self.time_schedule + self.time_forward + self.time_process
        return (self.time_schedule + self.time_process) / total if total else 0.0
