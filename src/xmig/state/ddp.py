"""DistributedDataParallel's communication state, which a replacement must match.

DDP rebuilds its gradient buckets once, in its second iteration, from the order in which
gradients became ready in its first, and broadcasts rank 0's layout (two int32 broadcasts: the
parameter indices bucket by bucket followed by the number of buckets, then each bucket's
size). A replacement's fresh DDP would issue different collectives than its long-running peers,
so the layout (the payloads of those two broadcasts) is part of the state it pulls. When rank 0
itself dies before its peers have its whole layout, the peers finish the rebuild with their own
layout (the same one, when their gradients became ready in the same order: checked) and the
replacement takes it. Relies on DDP internals (``reducer._push_all_rebuilt_params``,
``reducer._rebuild_buckets``): tested on torch 2.11-2.14.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from xmig.proxy.oplog import IntBroadcast, OpRecord

# where a rank's layout came from, as a survivor reports it when it parks
FROM_ROOT = "root"  # both payloads from rank 0 over the network
MIXED = "mixed"  # rank 0's indices (equal to this rank's own) and this rank's own sizes
LOCAL = "local"  # this rank's own: rank 0 died before sending any of it
INCONSISTENT = "inconsistent"  # rank 0's indices differ from this rank's own: sizes unknown


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


def rebuilds(ddp: DistributedDataParallel) -> bool:
    """Whether this DDP rebuilds its buckets after its first iteration (its default; not with
    ``find_unused_parameters`` or a static graph, whose sequences xmig does not model)."""
    return not ddp.find_unused_parameters and not getattr(ddp, "static_graph", False)


def is_layout_head(payload: torch.Tensor) -> bool:
    """Whether an int32 payload has the form of DDP's first layout broadcast: a permutation
    of the parameter indices followed by the number of buckets."""
    values = payload.detach().reshape(-1).cpu()
    if values.dtype != torch.int32 or values.numel() < 2:
        return False
    indices, buckets = values[:-1], int(values[-1])
    expected = torch.arange(indices.numel(), dtype=torch.int32)
    return 1 <= buckets <= indices.numel() and torch.equal(torch.sort(indices).values, expected)


def layout_pair(
    int_broadcasts: Sequence[IntBroadcast], step: int
) -> tuple[IntBroadcast, IntBroadcast | None] | None:
    """DDP's two layout broadcasts of ``step`` as this rank issued them (the second None
    while not yet issued), or None when the step has none."""
    ours = [b for b in int_broadcasts if b.step == step]
    for i, head in enumerate(ours):
        if is_layout_head(head.sent):
            second = ours[i + 1] if i + 1 < len(ours) else None
            return head, second if second is not None and second.index == head.index + 1 else None
    return None


def complete_layout(int_broadcasts: Sequence[IntBroadcast], step: int) -> list[torch.Tensor] | None:
    """The layout DDP took in ``step`` (both payloads as received), or None."""
    pair = layout_pair(int_broadcasts, step)
    if pair is None or pair[1] is None or pair[0].received is None or pair[1].received is None:
        return None
    return [pair[0].received, pair[1].received]


def rebuild_payloads(
    int_broadcasts: Sequence[IntBroadcast], step: int | None = None
) -> list[torch.Tensor] | None:
    """The layout DDP took in ``step`` (default: the earliest step that has a whole one)."""
    steps = sorted({b.step for b in int_broadcasts if b.step is not None})
    for candidate in [step] if step is not None else steps:
        layout = complete_layout(int_broadcasts, candidate)
        if layout is not None:
            return layout
    return None


def layout_digest(layout: Sequence[torch.Tensor]) -> str:
    """A short fingerprint of a layout, for ranks to compare."""
    digest = hashlib.sha256()
    for payload in layout:
        digest.update(payload.detach().cpu().contiguous().numpy().tobytes() + b"|")
    return digest.hexdigest()[:16]


def layout_source(head: IntBroadcast, second: IntBroadcast) -> str:
    """Where a layout this rank took came from (FROM_ROOT, MIXED, LOCAL or INCONSISTENT)."""
    if head.local:
        return LOCAL
    if not second.local:
        return FROM_ROOT
    assert head.received is not None
    return MIXED if torch.equal(head.received.cpu(), head.sent.cpu()) else INCONSISTENT


class LayoutPicker:
    """Picks DDP's two layout broadcasts of one step out of a rank's ops (a proxy's
    ``local_filter``): they are served locally when rank 0, their root, has died."""

    def __init__(self, step: int, head_index: int | None = None) -> None:
        self.step = step
        self.head_index = head_index

    def __call__(self, record: OpRecord) -> bool:
        broadcast = record.int_broadcast
        if broadcast is None or record.step != self.step:
            return False
        if self.head_index is None:
            if not is_layout_head(broadcast.sent):
                return False
            self.head_index = record.index
        return record.index in (self.head_index, self.head_index + 1)


class ReadyOrder:
    """Records the order in which a DDP's parameters get their gradients in one backward:
    DDP builds its buckets from rank 0's order of its first iteration."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.order: list[int] = []
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.order.append(i))
            for i, p in enumerate(params)
        ]

    def stop(self) -> list[int]:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return self.order


def prepare_rebuild(ddp: DistributedDataParallel) -> None:
    """Make a fresh DDP rebuild its buckets at its next forward, as its peers will."""
    ddp.reducer._push_all_rebuilt_params()


def rebuild_now(ddp: DistributedDataParallel) -> bool:
    """Rebuild the buckets at once; the layout broadcasts go through the process group (which
    the caller has set to serve them from a peer's payloads)."""
    ddp.reducer._push_all_rebuilt_params()
    return bool(ddp.reducer._rebuild_buckets())
