"""What this rank knows of its DDP's bucket layout, which a replacement must match (see
``xmig.state.ddp``): taken at the end of a step, served to a replacement, adopted by one."""

from __future__ import annotations

import time

import torch

from xmig import protocol
from xmig.proxy import ProxyProcessGroup
from xmig.state import DdpPayload
from xmig.state import ddp as ddp_state
from xmig.worker.context import WorkerContext
from xmig.worker.errors import RecoveryFailed


class DdpLayout:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self.layout: list[torch.Tensor] | None = None
        self.source = ddp_state.FROM_ROOT  # how this rank came by ``layout``
        # the order this rank's gradients became ready in its first iteration (DDP's layout
        # comes from rank 0's), and the peers' order a replacement must find it equal to
        self.ready_order: list[int] | None = None
        self.verify_order: list[int] | None = None
        self._ready: ddp_state.ReadyOrder | None = None

    @property
    def proxy(self) -> ProxyProcessGroup:
        """The proxy of the group DDP trains over (its layout broadcasts go through it)."""
        ctx = self._ctx
        ddp = ctx.registry.ddp
        group = ctx.groups.of(getattr(ddp, "process_group", None)) if ddp is not None else None
        return group.proxy if group is not None else ctx.proxy

    @property
    def root(self) -> int:
        """The global rank that broadcasts DDP's layout: its group's rank 0."""
        ctx = self._ctx
        ddp = ctx.registry.ddp
        group = ctx.groups.of(getattr(ddp, "process_group", None)) if ddp is not None else None
        return group.ranks[0] if group is not None else 0

    @property
    def digest(self) -> str | None:
        return ddp_state.layout_digest(self.layout) if self.layout else None

    def watch_first_iteration(self, step: int, total: int) -> None:
        ddp = self._ctx.registry.ddp
        if ddp is not None and ddp_state.rebuilds(ddp) and step < total:
            self._ready = ddp_state.ReadyOrder(ddp)  # for this process's first iteration

    def stop(self) -> None:
        if self._ready is not None:
            self._ready.stop()

    def end_of_step(self, step: int) -> None:
        ddp = self._ctx.registry.ddp
        if ddp is not None and self.layout is None and ddp_state.rebuilds(ddp):
            # the layout DDP took in this step, if it rebuilt its buckets in it
            self.layout = ddp_state.complete_layout(self.proxy.int_broadcasts, step)
        if self._ready is not None:
            self._check_ready_order(self._ready.stop())
            self._ready = None

    def _check_ready_order(self, order: list[int]) -> None:
        """Keep this process's first ready order; a replacement that took a layout its peers
        made themselves (its rank 0 died before sending DDP's) says whether it is the one
        the fault-free run had: rank 0's order is now this process's."""
        ctx = self._ctx
        self.ready_order = order
        expected, self.verify_order = self.verify_order, None
        if expected is None or expected == order or ctx.link is None:
            return
        pairs = enumerate(zip(order, expected, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), min(len(order), len(expected)))
        why = (f"rank {ctx.rank}'s gradients became ready in another order than its peers' "
               f"(from position {first} on), so DDP's buckets, which its peers built in their "
               "own order, differ from the fault-free run's")  # fmt: skip
        ctx.send(protocol.NotBitIdentical(generation=ctx.env.generation, why=why, t=time.time()))

    def outgoing(self, step: int, verify_ready_order: bool) -> DdpPayload:
        """The layout a replacement resuming at ``step`` must take."""
        payload = DdpPayload(layout=self.layout, ready_order=self.ready_order,
                             verify_ready_order=verify_ready_order)  # fmt: skip
        if self._ctx.registry.ddp is not None and self.layout is None:
            seen = self.proxy.int_broadcasts
            # rebuilt in an earlier step, or in this one (its payloads go out again, from the
            # replacement when it is their root)
            earlier = [b for b in seen if b.step is not None and b.step < step]
            payload.layout = ddp_state.rebuild_payloads(earlier)
            pair = ddp_state.layout_pair(seen, step)
            if payload.layout is None and pair is not None:
                payload.in_step = ddp_state.complete_layout(seen, step)
                payload.in_step_index = pair[0].index
        return payload

    def adopt(self, payload: DdpPayload, step: int, first_step: int | None) -> None:
        """A replacement's fresh DDP takes the layout its peers use: at once, or, when they
        rebuild in ``step`` itself, from the layout broadcasts of that step."""
        ctx = self._ctx
        ddp = ctx.registry.ddp
        if ddp is None:
            return
        if payload.layout is not None:
            proxy = self.proxy
            proxy.serve_broadcasts(payload.layout)
            # served here whatever the proxy's mode: every rank of a job resumed from a
            # checkpoint takes the layout at once (a replacement's proxy serves it anyway)
            with proxy.locally():
                if not ddp_state.rebuild_now(ddp):
                    raise RecoveryFailed("DDP refused to take its peers' bucket layout")
            self.layout = payload.layout
        elif step > (first_step or 0):
            ddp_state.prepare_rebuild(ddp)  # its peers rebuild in this very step
            for index, tensor in enumerate(payload.in_step or [], start=payload.in_step_index):
                self.proxy.override_broadcast(step, index, tensor)
        if payload.verify_ready_order:
            self.verify_order = payload.ready_order
