"""A collective failed: the proxy holds the framework, the agent hears of it, and a watchdog
ends the worker if no recovery begins."""

from __future__ import annotations

import logging
import threading
import time

from xmig import protocol
from xmig.worker.context import WorkerContext
from xmig.worker.errors import exit_now

logger = logging.getLogger(__name__)

# errors after which the CUDA context is unusable: the process must be replaced
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "CUDA error: an illegal",
)


def is_sticky_cuda_error(text: str) -> bool:
    """True for a CUDA error that leaves the context unusable (the rank must be respawned)."""
    lowered = text.lower()
    return any(marker.lower() in lowered for marker in STICKY_CUDA_ERRORS)


def on_trouble(ctx: WorkerContext, error: str, group: list[int] | None = None) -> None:
    """The proxy's ``on_trouble``: tell the agent (``group``: the ranks of the group the
    collective failed in), and get ready to be parked."""
    if ctx.link is None:
        logger.error("rank %d: collective failed and no agent can help: %s", ctx.rank, error)
        exit_now(1)
    if is_sticky_cuda_error(error):
        # the CUDA context is lost: only a new process can go on; the agent respawns it
        ctx.die(f"unrecoverable CUDA error, this process must be replaced: {error}")
    ctx.send(protocol.CommError(error=error, step=ctx.step, generation=ctx.proxy.generation,
                                t=time.time(), group=group))  # fmt: skip
    started = ctx.recoveries_started
    threading.Thread(target=_watchdog, args=(ctx, started), daemon=True).start()


def _watchdog(ctx: WorkerContext, started: int) -> None:
    time.sleep(ctx.env.recovery_timeout)
    if ctx.recoveries_started == started:
        ctx.die(f"a collective failed and no recovery began within "
                f"{ctx.env.recovery_timeout:.0f} s")  # fmt: skip
