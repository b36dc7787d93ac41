"""Worker-side fault injection: fires each FaultSpec once, at its step and point."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from xmig.faults.spec import RECOVERY_POINTS, FaultSpec

NODE_LOSS_WAIT_S = 30.0


class InjectedCollectiveError(RuntimeError):
    """Raised from inside a collective by a ``raise`` fault, as an NCCL/CUDA error would be."""


class InjectedLateError(InjectedCollectiveError):
    """A ``raise`` at ``completion=K``: the proxy launches the collective and reports this
    error once it has ended, as a collective broken by a lost peer fails after its launch."""

    after_launch = True  # what the proxy looks for (it does not import this package)


class Injector:
    """Holds this rank's pending faults and fires them at the matching point.

    ``announce(spec)`` is called, and must return, before a fault is carried out: it tells the
    agent what is about to happen and when, so detection latency can be measured.
    """

    def __init__(
        self,
        rank: int,
        announce: Callable[[FaultSpec], None],
        current_step: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.rank = rank
        self._announce = announce
        self._current_step = current_step
        self._pending: list[FaultSpec] = []
        self._armed_raise: FaultSpec | None = None
        self._lock = threading.Lock()

    def add(self, spec: FaultSpec) -> None:
        if spec.rank != self.rank:
            raise ValueError(f"fault {spec} is for rank {spec.rank}, this is rank {self.rank}")
        if spec.step is None:  # "the next step", as this rank sees it
            spec = replace(spec, step=(self._current_step() or 0) + 1)
        with self._lock:
            self._pending.append(spec)

    @property
    def pending(self) -> list[FaultSpec]:
        with self._lock:
            return list(self._pending)

    def unreachable(self, total: int) -> list[FaultSpec]:
        """Pending faults a loop of ``total`` steps never reaches (the end's boundary and
        the collectives issued after the loop are the last points it has)."""
        return [
            s
            for s in self.pending
            if s.step is not None
            and (
                s.step > total
                or (
                    s.step == total
                    and s.at not in ("boundary", *RECOVERY_POINTS)
                    and s.collective is None
                    and s.completion is None
                )  # fmt: skip
            )
        ]

    def needs(self, point: str) -> bool:
        """Whether a pending fault fires at ``point`` (so the caller knows which hooks to set)."""
        return any(spec.at == point for spec in self.pending)

    def _take(self, match: Callable[[FaultSpec], bool]) -> FaultSpec | None:
        with self._lock:
            for spec in self._pending:
                if match(spec):
                    self._pending.remove(spec)
                    return spec
        return None

    def at_point(self, step: int, point: str) -> None:
        """Called at ``forward``, ``backward``, ``optimizer`` and ``boundary`` of ``step``."""
        if point == "boundary" and self._armed_raise is not None:
            spec, self._armed_raise = self._armed_raise, None
            self._fire(spec)
        spec = self._take(lambda s: s.step == step and s.at == point)
        if spec is None:
            return
        if spec.kind == "raise" and point == "backward":
            # surfaces from the next collective of the step, like a communication error
            self._armed_raise = spec
            return
        self._fire(spec)

    def at_phase(self, step: int | None, phase: str) -> None:
        """Called as this rank, parked in ``step``, begins a phase of a recovery (or writes
        its shard of a checkpoint)."""
        spec = self._take(lambda s: s.step == step and s.at == phase)
        if spec is not None:
            self._fire(spec)

    def at_collective(self, step: int, index: int, op: str) -> None:
        """Called by the proxy before it issues the ``index``-th collective of ``step``."""
        if self._armed_raise is not None:
            spec, self._armed_raise = self._armed_raise, None
            self._fire(spec, op)
        spec = self._take(lambda s: s.step == step and index in (s.collective, s.completion))
        if spec is not None:
            self._fire(spec, op)

    def _fire(self, spec: FaultSpec, op: str | None = None) -> None:
        self._announce(spec)
        if spec.kind in ("kill", "hang") and os.getpid() == 1:
            # a container's init: the kernel drops the signals it sends itself; its agent,
            # told by the announcement, sends them from outside
            time.sleep(NODE_LOSS_WAIT_S)
            os._exit(1)
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "exit":
            os._exit(spec.code)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "node":
            # the agent, told by the announcement, takes the whole node down, this rank too
            time.sleep(NODE_LOSS_WAIT_S)
            os._exit(1)
        elif spec.kind == "raise":
            where = f" in {op}" if op else ""
            error = InjectedLateError if spec.completion is not None else InjectedCollectiveError
            raise error(
                f"injected communication error{where} on rank {self.rank} "
                f"(simulated ncclRemoteError, fault {spec})"
            )
