"""What the scheduler reads of a server's settings, concern by concern."""

from __future__ import annotations

from dataclasses import dataclass

from vlm_serve.config import (
    Concerns,
    DisaggregationSettings,
    HiCacheSettings,
    LogSettings,
    ModelSettings,
    SchedulerSettings,
    SpeculativeSettings,
)
from vlm_serve.disaggregation.factory import TransferConcerns


@dataclass(frozen=True)
class SchedulerConcerns(Concerns):
    """How batches are filled, the prefix cache's tiers, drafting, this server's side of PD and its transfer
    backend's settings, the seed of the random policy, the log interval."""

    schedule: SchedulerSettings
    hicache: HiCacheSettings
    speculative: SpeculativeSettings
    disaggregation: DisaggregationSettings
    transfer: TransferConcerns
    model: ModelSettings
    log: LogSettings
