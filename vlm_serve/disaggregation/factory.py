"""The transfer backend a server's settings name, made for one rank (apart from the interface, which the
backends implement)."""

from __future__ import annotations

from dataclasses import dataclass

from vlm_serve.config import Concerns, DisaggregationSettings, HttpSettings, ParallelSettings
from vlm_serve.disaggregation.bootstrap import bootstrap_address, rank_host
from vlm_serve.disaggregation.control import Timeouts
from vlm_serve.disaggregation.fake import FakeBackend
from vlm_serve.disaggregation.mooncake import MooncakeBackend
from vlm_serve.disaggregation.transfer import KVLayout, Mode, TransferBackend


@dataclass(frozen=True)
class TransferConcerns(Concerns):
    """What a rank's transfer backend reads: PD's settings, the ranks and nodes, the address it serves on."""

    disaggregation: DisaggregationSettings
    parallel: ParallelSettings
    http: HttpSettings


def create_transfer_backend(settings: TransferConcerns, mode: Mode, tp_rank: int, layout: KVLayout) -> TransferBackend:
    """The backend `--disaggregation-transfer-backend` names, for this rank. A prefill rank registers
    with its server's bootstrap server (which the launcher has started) before this returns."""
    pd, host = settings.disaggregation, settings.http.host
    timeouts, tp_size = Timeouts.of(pd), settings.parallel.tp_size
    bootstrap = (
        bootstrap_address(host, settings.parallel, pd.disaggregation_bootstrap_port) if mode == "prefill" else None
    )
    if pd.disaggregation_transfer_backend == "fake":
        return FakeBackend(mode, tp_rank, tp_size, rank_host(host), layout, bootstrap, timeouts=timeouts)
    return MooncakeBackend(
        mode, tp_rank, tp_size, rank_host(host), layout, bootstrap, pd.disaggregation_ib_device, timeouts=timeouts
    )
