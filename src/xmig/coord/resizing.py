"""One change of the world size at a step boundary: asked for (``xmig scale``,
``--inject resize:``), or forced by a lost node whose ranks have no spare (a shrink).

Every rank pauses at the start of the same step, as for a migration (no collective in flight).
Each paused rank says whether its world can change size there; if one cannot, every rank
resumes at the old size and the job goes on. Otherwise each agent renumbers its workers, the
ranks that leave end, and the ranks that stay build the new world's communicator and DDP
at the new size, move their data streams to their new share, and resume (``Resumed``).

A shrink first parks the survivors where the fault found them (as a recovery does); each
finishes its step locally without an update (``Shrink``) and pauses at the start of the
latest step any of them holds the state of: that step redone, or, for a survivor still in
the step before (whose collectives had ended), the next, with the state pulled from a peer
as a rollback's does. The resize goes on from the pause as a planned one does: so it ends
as the planned resize at that step.

A grow starts its new ranks at once, so that their start overlaps the other ranks' way to
the pause step, and tells the paused ranks of the new world once each new rank has joined
(``xmig.init()``): one that does not start, or does not join in time, leaves every rank going
on at the old size, nothing lost (as does a rank that cannot resize, or the job's end).
Each new rank makes the new world with the others and is served the state of the pause
step's start by one of them, then says ``Resumed`` like every other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from xmig.coord.orders import (
    DropRanks,
    GiveUp,
    Note,
    Order,
    Renumber,
    Say,
    Settled,
    StartRanks,
    ToAll,
)
from xmig.coord.recovery import RecoveryImpossible, pull_sources
from xmig.coord.resize import ResizePlan
from xmig.protocol import (
    Park,
    Parked,
    Pause,
    Paused,
    PauseRefused,
    Position,
    Resize,
    Resume,
    Resumed,
    Shrink,
    StateAnnounced,
    StateSent,
    WorkerDone,
    WorkerJoined,
    WorkerStarted,
)


class ResizePhase(enum.Enum):
    PARKING = "parking"  # a shrink: the survivors park where the fault found them
    PAUSING = "pausing"  # every rank pauses at the start of ``step``
    STARTING = "starting"  # a grow: every rank paused, waiting for the new ranks to join
    RESIZING = "resizing"  # the ranks that stay build the new world
    DONE = "done"
    REFUSED = "refused"  # a rank's world cannot change size: it resumed at the old one
    DROPPED = "dropped"  # the job finished before the pause step
    FAILED = "failed"


# ResizePhase -> the phases it may go to
RESIZE_TRANSITIONS: dict[ResizePhase, set[ResizePhase]] = {
    ResizePhase.PARKING: {ResizePhase.PAUSING, ResizePhase.FAILED},
    ResizePhase.PAUSING: {ResizePhase.RESIZING, ResizePhase.STARTING, ResizePhase.REFUSED,
                          ResizePhase.DROPPED, ResizePhase.FAILED},
    # a new rank that does not start: every rank resumes at the old size
    ResizePhase.STARTING: {ResizePhase.RESIZING, ResizePhase.REFUSED, ResizePhase.FAILED},
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
    lost: list[int] = field(default_factory=list)  # a shrink: the old ranks lost
    t_fault: float | None = None  # a shrink: when the fault happened
    positions: dict[int, Position] = field(default_factory=dict)  # a shrink: where each parked
    sources: dict[str, int] = field(default_factory=dict)  # a shrink: who pulls from whom
    paused: dict[int, int] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot resize
    resumed: set[int] = field(default_factory=set)
    joined: set[int] = field(default_factory=set)  # a grow: the new ranks that joined
    start_failed: str | None = None  # a grow: why a new rank did not start
    from_spare: dict[int, bool] = field(default_factory=dict)  # a grow: new rank -> its start
    times: dict[str, float] = field(default_factory=dict)
    stop_s: float = 0.0  # the longest any rank took from its pause boundary to its report

    @property
    def step(self) -> int:
        return self.plan.step

    @property
    def survivors(self) -> list[int]:
        """The old ranks that take part: every one, less a shrink's lost ones."""
        return [r for r in range(self.plan.old_world) if r not in self.lost]

    def start(self, now: float) -> list[Order]:
        if self.lost:
            self.phase = ResizePhase.PARKING
        note = Note("resize", {"generation": self.generation, "phase": self.phase.value,
                               "from": self.plan.old_world, "to": self.plan.new_world,
                               "step": self.step, "after_s": 0.0})  # fmt: skip
        if self.lost:
            return [note, ToAll(Park(generation=self.generation, replaced=self.lost, shrink=True))]
        orders: list[Order] = [note, ToAll(Pause(generation=self.generation, step=self.step))]
        if self.plan.added:  # their start, the long pole, overlaps the way to the pause
            orders.append(StartRanks(self.generation, dict(self.plan.added), self.plan.new_world))
        return orders

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
            if phase is ResizePhase.STARTING:
                waiting = sorted(set(self.plan.added) - self.joined)
                return self.not_started(waiting, "did not join within "
                                        f"{self.deadline - self.started:.0f} s", now)  # fmt: skip
            return self.fail(f"the world was not resized within "
                             f"{self.deadline - self.started:.0f} s", now)  # fmt: skip
        if isinstance(event, WorkerStarted):  # (a report without a generation)
            if event.rank in self.plan.added:
                self.from_spare[event.rank] = event.from_spare
            return []
        if isinstance(event, WorkerJoined):
            if phase in (ResizePhase.PAUSING, ResizePhase.STARTING) \
                    and event.rank in self.plan.added:  # fmt: skip
                self.joined.add(event.rank)
                if phase is ResizePhase.STARTING and self.joined >= set(self.plan.added):
                    return self._resize(now)
            return []
        if isinstance(event, WorkerDone):
            if phase is ResizePhase.PAUSING and not self.paused:
                orders = [*self._enter(ResizePhase.DROPPED, now),
                          Say(f"resize to {self.plan.new_world} ranks not done: the job "
                              "finished first")]  # fmt: skip
                if self.plan.added:
                    orders.append(DropRanks(self.generation, sorted(self.plan.added),
                                            "the job finished first", resume=False))  # fmt: skip
                return orders
            return []
        if getattr(event, "generation", None) != self.generation:
            return []
        if isinstance(event, Parked) and phase is ResizePhase.PARKING:
            if event.rank not in self.survivors:
                return []
            self.positions[event.rank] = event.position
            if len(self.positions) < len(self.survivors):
                return []
            return self._parked(now)
        if isinstance(event, StateSent) and phase in (ResizePhase.PAUSING,
                                                      ResizePhase.RESIZING):  # fmt: skip
            return self._relay_digest(event)
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
            if len(self.paused) < len(self.survivors):
                return []
            if self.start_failed is not None:
                self.refusals.setdefault(min(self.plan.added), self.start_failed)
            if self.refusals:
                why = min(self.refusals.items())[1]
                orders = self._enter(ResizePhase.REFUSED, now, why=why)
                if self.plan.added:  # new ranks may wait to meet under this generation
                    return [*orders, DropRanks(self.generation, sorted(self.plan.added), why)]
                return [*orders, ToAll(Resume(generation=self.generation))]
            if not self.joined >= set(self.plan.added):  # the paused ranks wait for them
                return self._enter(ResizePhase.STARTING, now)
            return self._resize(now)
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

    def not_started(self, ranks: list[int], why: str, now: float) -> list[Order]:
        """New ranks of a grow that did not start or join: every rank goes on at the old
        size (the job ends the new ranks' processes)."""
        reason = f"new rank(s) {ranks} {why}"
        if self.phase is ResizePhase.PAUSING:  # given up once every other rank has paused
            self.start_failed = self.start_failed or reason
            return [Note("resize", {"generation": self.generation, "start_failed": reason})]
        if self.phase is not ResizePhase.STARTING:
            return self.fail(reason, now)
        self.refusals[ranks[0]] = reason
        return [
            *self._enter(ResizePhase.REFUSED, now, why=reason),
            DropRanks(self.generation, sorted(self.plan.added), reason),
        ]

    def _resize(self, now: float) -> list[Order]:
        """Every rank paused (and, for a grow, every new rank joined): the new world."""
        plan = self.plan
        if plan.added:  # each served by a rank that stays, in turn (several serve at once)
            servers = sorted(plan.ranks.values())
            self.sources = {str(rank): servers[i % len(servers)]
                            for i, rank in enumerate(sorted(plan.added))}  # fmt: skip
        order = Resize(
            generation=self.generation,
            step=self.step,
            world_size=plan.new_world,
            ranks=rank_map(plan),
            sources=dict(self.sources) if plan.added else {},
        )
        # the job counts the new world from now: the ranks' next reports name new ranks
        return [
            *self._enter(ResizePhase.RESIZING, now),
            Renumber({**plan.ranks, **{r: r for r in plan.added}}, plan.new_world),
            ToAll(order),
        ]

    def _parked(self, now: float) -> list[Order]:
        """Every survivor of a shrink is parked: each finishes its step without an update
        and pauses at the start of the latest step any survivor's state is of; one still
        in the step before (its collectives ended, its update not yet taken) pulls that
        step's state from a peer first. Not when a survivor past its update waits in a
        collective: only the lost peers could end it."""
        states = {r: int(p.state_step) for r, p in self.positions.items()
                  if p.state_step is not None}  # fmt: skip
        cannot = sorted((r, p.cannot_resize) for r, p in self.positions.items()
                        if p.cannot_resize)  # fmt: skip
        if cannot:  # found now, before any survivor is told to resize: the state is saved
            rank, why = cannot[0]
            return self.fail(f"the world cannot shrink: rank {rank}: {why}", now)
        early = sorted(set(self.positions) - set(states))
        if early:
            return self.fail(f"rank {early[0]} has not reached session.steps(): there is no "
                             "step boundary to resize at", now)  # fmt: skip
        waiting = sorted(r for r, p in self.positions.items()
                         if p.pending and p.step is not None and p.step < states[r])  # fmt: skip
        if waiting:
            rank = waiting[0]
            return self.fail(f"rank {rank} had taken the update of step "
                             f"{self.positions[rank].step} and waits in a collective issued "
                             "after it, which only the lost ranks could end", now)  # fmt: skip
        high = max(states.values())
        behind = sorted(r for r, s in states.items() if s < high)
        try:
            sources = pull_sources(self.positions, behind,
                                   [r for r, s in states.items() if s == high], None)  # fmt: skip
        except RecoveryImpossible as exc:
            return self.fail(str(exc), now)
        self.sources = {str(r): s for r, s in sources.items()}
        self._with_step(high)
        # where each survivor was (step, the step its state is of, collectives pending)
        where = {str(r): [p.step, p.state_step, p.pending, p.optimizer_waiting]
                 for r, p in sorted(self.positions.items())}  # fmt: skip
        return [*self._enter(ResizePhase.PAUSING, now, step=self.step, pulls=behind,
                             positions=where),
                ToAll(Shrink(generation=self.generation, step=self.step,
                             sources=self.sources))]  # fmt: skip

    def _relay_digest(self, event: StateSent) -> list[Order]:
        """A serving rank's digest of the state it sent (to a shrink's survivor still in the
        step before, or to a rank the world grows by), to the one that received it."""
        if self.sources.get(str(event.target)) != event.rank:
            return [Note("ignored", {"why": f"a state digest from rank {event.rank}, which "
                                            "serves no state"})]  # fmt: skip
        return [ToAll(StateAnnounced(generation=self.generation, rank=event.target,
                                     source=event.rank, digest=event.digest))]  # fmt: skip

    def record(self) -> dict[str, Any]:
        t = self.times
        end = t.get("done", self.started)
        resizing = t.get("resizing", t.get("refused", self.started))
        quiesced = t.get("starting", resizing)  # every rank paused
        pausing = t.get("pausing", self.started)  # a shrink: every survivor parked
        phases = {
            "park": pausing - self.started,  # a shrink: the survivors park (0 planned)
            "quiesce": quiesced - pausing,  # to the pause step (a shrink: the step rolled back)
            "stop": self.stop_s,  # from the pause boundary to the rank's report
            "start": resizing - quiesced,  # a grow: its new ranks start and join
            # renumbered, the new communicator and DDP, a grow's new ranks served their
            # state, every rank resumed
            "rebuild": end - resizing,
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
            "added": {str(r): node for r, node in sorted(self.plan.added.items())},
            # each new rank's process: a hot spare's, or one started from scratch
            "from_spare": [self.from_spare.get(r, False) for r in sorted(self.plan.added)],
            "lost": self.lost,
            # who pulled the state from whom: a shrink's laggards, a grow's new ranks
            "pulled": {r: s for r, s in sorted(self.sources.items())},
            # why a rank's world could not change size (the job went on at the old size)
            "refused": min(self.refusals.items())[1] if self.refusals else None,
            "what": self.plan.describe(),
            "phases": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            # a shrink: from the fault; planned: from the pause boundary
            "downtime_s": round(
                end - self.t_fault if self.t_fault is not None else self.stop_s + end - quiesced, 4
            ),  # fmt: skip
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
    gone = "lost" if record.get("lost") else "left"
    left = f", ranks {record['left']} {gone}" if record["left"] else ""
    added = record.get("added") or {}
    if added:
        nodes = sorted(set(added.values()))
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes}"
        left += f", ranks {sorted(int(r) for r in added)} started on {where}"
    return (f"{record['what']} in {record['total_s']:.2f} s (downtime "
            f"{record['downtime_s']:.2f} s{left}) [{phases}]")  # fmt: skip
