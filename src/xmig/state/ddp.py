"""DistributedDataParallel's communication state, which a replacement must match.

DDP rebuilds its gradient buckets once, in its second iteration, from the order in which
gradients became ready, and broadcasts rank 0's layout (two int32 broadcasts). A replacement's
fresh DDP would issue different collectives than its long-running peers, so the layout (the
payloads of those two broadcasts) is part of the state it pulls. Relies on DDP internals
(``reducer._push_all_rebuilt_params``, ``reducer._rebuild_buckets``): tested on torch 2.11-2.14.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

REBUILD_BROADCASTS = 2


def find_ddp(obj: Any) -> DistributedDataParallel | None:
    """The DDP that trains ``obj``: ``obj`` itself when it is one, else the live DDP whose
    module is ``obj`` (a script that registered the bare module)."""
    if isinstance(obj, DistributedDataParallel):
        return obj
    if not isinstance(obj, torch.nn.Module):
        return None
    return next((d for d in live_ddps() if d.module is obj), None)


def live_ddps() -> list[DistributedDataParallel]:
    """Every DDP instance of this process (a walk over the garbage collector's objects:
    once per process, when the step loop starts)."""
    return [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]


def has_rebuilt(ddp: DistributedDataParallel) -> bool:
    return bool(ddp._get_ddp_logging_data().get("has_rebuilt_buckets", 0))


def rebuild_payloads(
    int_broadcasts: list[tuple[int | None, torch.Tensor]], step: int | None = None
) -> list[torch.Tensor] | None:
    """The two layout broadcasts DDP issued in ``step`` (default: the earliest step that
    has them; DDP's own flag for the rebuild is updated an iteration late)."""
    steps = [s for s, _ in int_broadcasts if s is not None]
    for candidate in [step] if step is not None else sorted(set(steps)):
        found = [t for s, t in int_broadcasts if s == candidate][:REBUILD_BROADCASTS]
        if len(found) == REBUILD_BROADCASTS:
            return found
    return None


def prepare_rebuild(ddp: DistributedDataParallel) -> None:
    """Make a fresh DDP rebuild its buckets at its next forward, as its peers will."""
    ddp.reducer._push_all_rebuilt_params()


def rebuild_now(ddp: DistributedDataParallel) -> bool:
    """Rebuild the buckets at once; the layout broadcasts go through the process group (which
    the caller has set to serve them from a peer's payloads)."""
    ddp.reducer._push_all_rebuilt_params()
    return bool(ddp.reducer._rebuild_buckets())
