"""The check after a recovery: every rank reports a checksum of its parameters at the same
boundary, and the coordinator stops the job if DDP's replicas differ (each set of replicas
compared within itself)."""

from __future__ import annotations

import time

from xmig import protocol
from xmig.state import params_checksum
from xmig.worker.context import WorkerContext


class Verifier:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._due: tuple[int, int] | None = None  # (generation, step) to report a checksum at

    def expect(self, generation: int, step: int) -> None:
        """The recovery of ``generation`` resumed at ``step``: report at the start of the
        step after it (or at the end), when the recovered step is done everywhere."""
        total = self._ctx.total if self._ctx.total is not None else step + 1
        self._due = (generation, min(step + 1, total))

    def at_boundary(self, step: int) -> None:
        due, self._due = self._due, None
        if due is None or due[1] != step:
            self._due = due
            return
        self._ctx.send(protocol.Verify(generation=due[0], step=step, checksum=self.checksum(),
                                       replicas=self._ctx.replicas(), t=time.time()))  # fmt: skip

    def checksum(self) -> str | None:
        """A checksum of the parameters when they have replicas (DDP's, or the ranks that hold
        the same DTensor shards), to compare within each set of replicas."""
        ctx = self._ctx
        model = ctx.registry.model()
        if model is None or (ctx.registry.ddp is None and ctx.replicas() is None):
            return None
        return params_checksum(model)
