"""One change of the world size at a step boundary, with no fault (``xmig scale``,
``--inject resize:``).

Every rank pauses at the start of the same step, as for a migration (no collective in flight).
Each paused rank says whether its world can change size there; if one cannot, every rank
resumes at the old size and the job goes on. Otherwise each agent renumbers its workers, the
ranks that leave end, and the ranks that stay build the new world's communicator and DDP
at the new size, move their data streams to their new share, and resume (``Resumed``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from xmig.coord.orders import GiveUp, Note, Order, Renumber, Say, Settled, ToAll
from xmig.coord.resize import ResizePlan
from xmig.protocol import Pause, Paused, PauseRefused, Resize, Resume, Resumed, WorkerDone


class ResizePhase(enum.Enum):
    PAUSING = "pausing"  # every rank pauses at the start of ``step``
    RESIZING = "resizing"  # the ranks that stay build the new world
    DONE = "done"
    REFUSED = "refused"  # a rank's world cannot change size: it resumed at the old one
    DROPPED = "dropped"  # the job finished before the pause step
    FAILED = "failed"


# ResizePhase -> the phases it may go to
RESIZE_TRANSITIONS: dict[ResizePhase, set[ResizePhase]] = {
    ResizePhase.PAUSING: {ResizePhase.RESIZING, ResizePhase.REFUSED, ResizePhase.DROPPED,
                          ResizePhase.FAILED},
    ResizePhase.RESIZING: {ResizePhase.DONE, ResizePhase.FAILED},
    ResizePhase.REFUSED: {ResizePhase.DONE, ResizePhase.FAILED},  # once every rank resumed
    ResizePhase.DONE: set(),
    ResizePhase.DROPPED: set(),
    ResizePhase.FAILED: set(),
}  # fmt: skip
ENDED = (ResizePhase.DONE, ResizePhase.DROPPED, ResizePhase.FAILED)


def rank_map(plan: ResizePlan) -> list[int]:
    """The ``Resize`` order's ``ranks``: each old rank's new rank, -1 for one that leaves."""
    return [plan.ranks.get(old, -1) for old in range(plan.old_world)]


@dataclass
class Resizing:
    """A resize in progress (and, once done, its record). Pure: events in, orders out."""

    generation: int
    plan: ResizePlan
    why: str  # "request" or the injected spec
    started: float
    deadline: float
    phase: ResizePhase = ResizePhase.PAUSING
    paused: dict[int, int] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot resize
    resumed: set[int] = field(default_factory=set)
    times: dict[str, float] = field(default_factory=dict)
    stop_s: float = 0.0  # the longest any rank took from its pause boundary to its report

    @property
    def step(self) -> int:
        return self.plan.step

    def start(self, now: float) -> list[Order]:
        return [Note("resize", {"generation": self.generation, "phase": self.phase.value,
                                "from": self.plan.old_world, "to": self.plan.new_world,
                                "step": self.step, "after_s": 0.0}),
                ToAll(Pause(generation=self.generation, step=self.step))]  # fmt: skip

    def _enter(self, phase: ResizePhase, now: float, **fields: Any) -> list[Order]:
        if phase not in RESIZE_TRANSITIONS[self.phase]:
            raise AssertionError(f"resize cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase
        self.times[phase.value] = now
        return [Note("resize", {"generation": self.generation, "phase": phase.value,
                                "after_s": round(now - self.started, 6), **fields})]  # fmt: skip

    def fail(self, reason: str, now: float) -> list[Order]:
        return [*self._enter(ResizePhase.FAILED, now), GiveUp("resize failed", reason)]

    def _with_step(self, step: int) -> None:
        plan = self.plan
        self.plan = ResizePlan(plan.cause, step, plan.old_world, plan.new_world, plan.ranks,
                               plan.added, plan.nodes)  # fmt: skip

    def on(self, event: Any, now: float) -> list[Order]:
        """The orders ``event`` calls for (none when it does not concern this resize)."""
        phase = self.phase
        if phase in ENDED:
            return []
        if now > self.deadline:
            return self.fail(f"the world was not resized within "
                             f"{self.deadline - self.started:.0f} s", now)  # fmt: skip
        if isinstance(event, WorkerDone):
            if phase is ResizePhase.PAUSING and not self.paused:
                return [*self._enter(ResizePhase.DROPPED, now),
                        Say(f"resize to {self.plan.new_world} ranks not done: the job "
                            "finished first")]  # fmt: skip
            return []
        if getattr(event, "generation", None) != self.generation:
            return []
        if isinstance(event, PauseRefused) and phase is ResizePhase.PAUSING:
            self._with_step(max(self.step, event.step + 1))
            self.paused.clear()
            self.refusals.clear()
            self.stop_s = 0.0
            return [Note("resize", {"generation": self.generation, "phase": "repause",
                                    "step": self.step}),
                    ToAll(Pause(generation=self.generation, step=self.step))]  # fmt: skip
        if isinstance(event, Paused) and phase is ResizePhase.PAUSING:
            if event.step == self.step:
                self.paused[event.rank] = event.step
                self.stop_s = max(self.stop_s, event.stop_s)
                if event.cannot_resize:
                    self.refusals[event.rank] = event.cannot_resize
            if len(self.paused) < self.plan.old_world:
                return []
            if self.refusals:
                why = min(self.refusals.items())[1]
                return [*self._enter(ResizePhase.REFUSED, now, why=why),
                        ToAll(Resume(generation=self.generation))]  # fmt: skip
            order = Resize(
                generation=self.generation,
                step=self.step,
                world_size=self.plan.new_world,
                ranks=rank_map(self.plan),
            )
            # the job counts the new world from now: the ranks' next reports name new ranks
            return [
                *self._enter(ResizePhase.RESIZING, now),
                Renumber(dict(self.plan.ranks), self.plan.new_world),
                ToAll(order),
            ]
        if isinstance(event, Resumed) and phase in (ResizePhase.RESIZING, ResizePhase.REFUSED):
            self.resumed.add(event.rank)
            size = self.plan.new_world if phase is ResizePhase.RESIZING else self.plan.old_world
            if len(self.resumed) < size:
                return []
            self.times[ResizePhase.DONE.value] = now
            record = self.record()
            orders = self._enter(ResizePhase.DONE, now, record=record)
            return [*orders, Settled(record, describe_resize(record))]
        return []

    def record(self) -> dict[str, Any]:
        t = self.times
        end = t.get("done", self.started)
        quiesced = t.get("resizing", self.started)  # every rank paused
        phases = {
            "quiesce": quiesced - self.started,  # the job trains on to the pause step
            "stop": self.stop_s,  # from the pause boundary to the rank's report
            "rebuild": end - quiesced,  # renumbered, new communicator and DDP, resumed
        }
        return {
            "kind": "resize",
            "cause": self.plan.cause.value,
            "step": self.step,
            "generation": self.generation,
            "why": self.why,
            "old_world": self.plan.old_world,
            "new_world": self.plan.new_world,
            "ranks": {str(old): new for old, new in sorted(self.plan.ranks.items())},
            "left": self.plan.dropped,
            # why a rank's world could not change size (the job went on at the old size)
            "refused": min(self.refusals.items())[1] if self.refusals else None,
            "what": self.plan.describe(),
            "phases": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            "downtime_s": round(self.stop_s + end - quiesced, 4),
            "total_s": round(end - self.started, 4),
        }


def describe_resize(record: dict[str, Any]) -> str:
    """One human line for a resize record."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items())
    if record.get("refused"):
        return (
            f"resize to {record['new_world']} ranks refused at step {record['step']}: "
            f"{record['refused']}; the job went on at {record['old_world']} [{phases}]"
        )
    left = f", ranks {record['left']} left" if record["left"] else ""
    return (f"{record['what']} in {record['total_s']:.2f} s (downtime "
            f"{record['downtime_s']:.2f} s{left}) [{phases}]")  # fmt: skip
