"""The transfer backend a server's settings name, made for one rank (apart from the interface, which the
backends implement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlm_serve.disaggregation.bootstrap import bootstrap_address, rank_host
from vlm_serve.disaggregation.control import Timeouts
from vlm_serve.disaggregation.fake import FakeBackend
from vlm_serve.disaggregation.mooncake import MooncakeBackend
from vlm_serve.disaggregation.transfer import KVLayout, Mode, TransferBackend

if TYPE_CHECKING:
    from vlm_serve.config import ServerArgs


def create_transfer_backend(server_args: ServerArgs, mode: Mode, tp_rank: int, layout: KVLayout) -> TransferBackend:
    """The backend `--disaggregation-transfer-backend` names, for this rank. A prefill rank registers
    with its server's bootstrap server (which the launcher has started) before this returns."""
    host, tp_size, timeouts = rank_host(server_args), server_args.tp_size, Timeouts.of(server_args)
    bootstrap = bootstrap_address(server_args) if mode == "prefill" else None
    if server_args.disaggregation_transfer_backend == "fake":
        return FakeBackend(mode, tp_rank, tp_size, host, layout, bootstrap, timeouts=timeouts)
    return MooncakeBackend(
        mode, tp_rank, tp_size, host, layout, bootstrap, server_args.disaggregation_ib_device, timeouts=timeouts
    )
