"""The process group the framework talks to; it forwards every op to the real communicator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from xmig.ccl import Communicator

# Every op of c10d's ProcessGroup that a framework may issue; each is forwarded by name.
FORWARDED_OPS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
)

BeforeOp = Callable[[int | None, int, str], None]


class ProxyProcessGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` that counts the ops of the current step and forwards them.

    ``before_op(step, index, op)`` runs before each op is issued (fault injection uses it).
    """

    def __init__(self, communicator: Communicator, before_op: BeforeOp | None = None) -> None:
        super().__init__(communicator.rank, communicator.size)
        self.communicator = communicator
        self.before_op = before_op
        self.step: int | None = None
        self.ops_in_step = 0
        self._group_name = ""

    def begin_step(self, step: int) -> None:
        """Called at the step boundary: op indices restart at 0."""
        self.step = step
        self.ops_in_step = 0

    def _issue(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        index = self.ops_in_step
        self.ops_in_step += 1
        if self.before_op is not None:
            self.before_op(self.step, index, op)
        return getattr(self.communicator.backend, op)(*args)

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return "xmig"

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name


def _forwarder(op: str) -> Callable[..., dist.Work]:
    def forward(self: ProxyProcessGroup, *args: Any) -> dist.Work:
        return self._issue(op, args)

    forward.__name__ = op
    forward.__doc__ = f"Forward ``{op}`` to the current communicator."
    return forward


for _op in FORWARDED_OPS:
    setattr(ProxyProcessGroup, _op, _forwarder(_op))
