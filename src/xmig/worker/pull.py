"""A rank's state pulled by another over a two-rank communicator: served, received, and
checked against the digest its sender announced over the authenticated control channel."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from xmig import protocol
from xmig.state import ReplacementPayload, TransferStats, recv_state, send_state
from xmig.worker.context import WorkerContext
from xmig.worker.errors import RecoveryFailed


def pull_report(role: str, stats: TransferStats) -> dict[str, Any]:
    return {"role": role, "bytes": stats.bytes, "seconds": stats.seconds,
            "setup_seconds": stats.setup_seconds}  # fmt: skip


def serve(
    ctx: WorkerContext,
    generation: int,
    targets: list[int],
    payload_for: Callable[[int], ReplacementPayload],
) -> dict[str, Any]:
    """Send each rank of ``targets`` in turn its payload; returns the pull's report."""
    total = TransferStats()
    for target in targets:
        pair = ctx.comms.communicator(f"pull{target}", generation, 0, 2)
        stats = send_state(pair, payload_for(target).to_wire(), ctx.device)
        # over the authenticated channel: the receiver checks what it got against it
        ctx.send(protocol.StateSent(generation=generation, target=target, digest=stats.digest,
                                    t=time.time()))  # fmt: skip
        total.bytes += stats.bytes
        total.seconds += stats.seconds
        total.setup_seconds += stats.setup_seconds
    return pull_report("source", total)


def receive(
    ctx: WorkerContext, generation: int, stream: torch.cuda.Stream | None = None
) -> tuple[Any, TransferStats]:
    """Receive what the serving rank sends this one (not yet checked: ``check_digest``)."""
    # on a thread of its own in a replacement, while its script makes its process groups
    store = ctx.comms.job_store() if ctx.env.token is not None else None
    pair = ctx.comms.communicator(f"pull{ctx.rank}", generation, 1, 2, store=store)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return recv_state(pair, ctx.device, ctx.device)


def check_digest(ctx: WorkerContext, generation: int, digest: str) -> None:
    """Load nothing a peer sent unless it is what the peer says it sent: the pull's
    communicator meets through the job's store, which the job does not authenticate."""
    timeout = ctx.env.recovery_timeout
    announced = ctx.orders.digests.next(generation, timeout)
    if announced is None:
        raise RecoveryFailed(
            f"the peer serving the state announced no digest within {timeout:.0f} s"
        )
    if announced.digest != digest:
        raise RecoveryFailed(
            f"the state received from rank {announced.source} is not what it sent (SHA-256 "
            f"{digest[:16]}… received, {str(announced.digest)[:16]}… announced): it was "
            f"altered or corrupted in transit; the pull's connection was set up through "
            f"the job's c10d store at {ctx.env.master_addr}:{ctx.env.master_port}"
        )
