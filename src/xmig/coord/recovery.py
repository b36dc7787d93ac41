"""A recovery: from where the survivors are parked, choose the step to resume at, the peer
that serves the state, and whether the step is replayed or rolled back; then follow the ranks
until every one has recovered. Pure: events in, orders out, time an argument."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from xmig.bitwise import combine_replays, describe_verdict
from xmig.coord.orders import GiveUp, Note, Order, Retry, Settled, ToAll
from xmig.protocol import (
    FaultRecord,
    Parked,
    Position,
    Rebuild,
    Recovered,
    ReplayMismatched,
    StateAnnounced,
    StateSent,
    WorkerJoined,
    WorkerStarted,
)

# how a survivor came by DDP's bucket layout, as it reports when it parks (xmig.state.ddp)
LAYOUT_LOCAL = "local"
LAYOUT_INCONSISTENT = "inconsistent"


class RecoveryImpossible(Exception):
    """No plan can bring the job back; the message says why."""


def _consistent(lists: list[list[str]]) -> bool:
    """True when every list is a prefix of the longest one."""
    longest = max(lists, key=len, default=[])
    return all(lst == longest[: len(lst)] for lst in lists)


def plan_rebuild(positions: dict[int, Position], replaced: list[int], generation: int,
                 no_replay: str | None = None) -> Rebuild:  # fmt: skip
    """The ``Rebuild`` order for generation ``generation``, from where each survivor parked
    (``state_step``: the step whose start its state is; ``log_from``: the first step it
    still holds the log of; ``signatures``: step → its logged ops' signatures).
    ``no_replay``: why the step must be rolled back whatever the logs hold (an earlier
    attempt to replay it failed)."""
    if not positions:
        raise RecoveryImpossible("no rank survived to serve the state")
    early = sorted(r for r, p in positions.items() if p.state_step is None)
    if early:
        raise RecoveryImpossible(
            f"rank {early[0]} has not reached session.steps(): in-place recovery needs the "
            "step boundary"
        )
    layouts = {p.ddp_layout for p in positions.values() if p.ddp_layout}
    if len(layouts) > 1:
        raise RecoveryImpossible(
            "the survivors hold different DDP bucket layouts: no replacement can match them all"
        )
    sources = {p.ddp_layout_source for p in positions.values()}
    if LAYOUT_INCONSISTENT in sources:
        raise RecoveryImpossible(
            "rank 0 died while sending DDP's bucket layout, and the part its peers received "
            "differs from their own layout: the rest of it is lost with rank 0"
        )
    # the survivors made the layout themselves: whether it is rank 0's shows in its replacement
    verify_ready_order = LAYOUT_LOCAL in sources
    state_steps = {r: int(p.state_step) for r, p in positions.items() if p.state_step is not None}
    low = min(state_steps.values())
    # survivors past a step's update that wait in a collective issued after it (a mean loss
    # all-reduced for logging): a replay starts at that step; only their peers can end it
    behind = {r: int(p.step) for r, p in positions.items()
              if p.pending and p.step is not None and int(p.step) < state_steps[r]}  # fmt: skip
    start = min([low, *behind.values()])
    reasons = [no_replay] if no_replay else []
    if no_replay:
        pass  # a replay of this step was tried and failed
    elif not all(p.keep_log for p in positions.values()):
        reasons.append("the replay log is off")
    elif any(p.log_from is None or p.log_from > start for p in positions.values()):
        reasons.append(f"a survivor no longer holds the log of step {start}")
    else:
        reason = _inconsistent_logs(positions, start)
        if reason is not None:
            reasons.append(reason)
    waiting = min(behind, key=lambda r: (behind[r], r)) if behind else None
    stuck = "" if waiting is None else (
        f"rank {waiting} has taken step {behind[waiting]}'s update and waits in a collective "
        "it issued after it")  # fmt: skip
    if start < low and replaced:
        raise RecoveryImpossible(
            f"{stuck}: rank {min(replaced)}'s replacement resumes at step {low} and cannot "
            f"issue it, and no rank holds step {start}'s state to redo it"
        )
    if not reasons:
        candidates = [r for r, s in state_steps.items() if s == low]
        pulls = sorted(replaced)
        try:
            servers = pull_sources(positions, pulls, candidates, low)
        except RecoveryImpossible:
            # its replicas took the step's update already (the other groups' ranks had not):
            # everyone goes on from theirs
            ahead = next(r for r in pulls if not _sources_for(positions, r, candidates))
            reasons.append(f"rank {ahead}'s replicas have taken step {low}'s update already")
    if not reasons:
        return Rebuild(generation=generation, mode="replay", step=low,
                       source=servers[pulls[0]] if pulls else _busiest(positions, candidates, low),
                       pulls=pulls, why=None, verify_ready_order=verify_ready_order,
                       sources={str(r): s for r, s in servers.items()},
                       check_after=_check_after(positions, low),
                       replay_from=start if start < low else None)  # fmt: skip
    if waiting is not None:
        # a rollback serves the rest of its step without the network, and that rank's step
        # is not redone: the script would go on with a result made without its peers
        raise RecoveryImpossible(f"{stuck}: it cannot be replayed ({reasons[0]})")
    high = max(state_steps.values())
    at_high = [r for r, s in state_steps.items() if s == high]
    laggards = [r for r, s in state_steps.items() if s < high]
    pulls = sorted([*replaced, *laggards])
    servers = pull_sources(positions, pulls, at_high, None)
    return Rebuild(generation=generation, mode="rollback", step=high,
                   source=servers[pulls[0]] if pulls else min(at_high), pulls=pulls,
                   why=reasons[0], verify_ready_order=verify_ready_order,
                   sources={str(r): s for r, s in servers.items()},
                   check_after=_check_after(positions, high))  # fmt: skip


def _check_after(positions: dict[int, Position], resume: int) -> int:
    """The step after which every rank can report its checksum at the same boundary."""
    return max([resume, *(int(p.step) for p in positions.values() if p.step is not None)])


def _inconsistent_logs(positions: dict[int, Position], low: int) -> str | None:
    """Why the survivors' logs from step ``low`` on cannot be replayed: members of one group
    that logged different ops (None: every group's logs agree)."""
    logs: dict[str, dict[int, dict[str, list[str]]]] = {"world": {}}
    for rank, position in positions.items():
        logs["world"][rank] = position.signatures
        for group, steps in position.group_signatures.items():
            logs.setdefault(group, {})[rank] = steps
    for group, by_rank in logs.items():
        steps = {int(s) for signatures in by_rank.values() for s in signatures}
        for step in sorted(s for s in steps if s >= low):
            if not _consistent([sigs.get(str(step), []) for sigs in by_rank.values()]):
                where = "" if group == "world" else f" of group {group}"
                return f"the survivors logged different ops{where} in step {step}"
    return None


def _busiest(positions: dict[int, Position], candidates: list[int], step: int) -> int:
    """Of ``candidates``, the one that logged the most of ``step`` (the lowest rank on a tie)."""
    return max(candidates, key=lambda r: (len(positions[r].signatures.get(str(step), [])), -r))


def _sources_for(positions: dict[int, Position], rank: int, candidates: list[int]) -> list[int]:
    """The candidates that hold a replica of ``rank``'s state (a survivor whose ``replicas``
    name it, or any when it names no set)."""
    return [c for c in candidates if c != rank
            and (positions[c].replicas is None or rank in positions[c].replicas)]  # fmt: skip


def pull_sources(positions: dict[int, Position], pulls: list[int], candidates: list[int],
             step: int | None) -> dict[int, int]:  # fmt: skip
    """For each rank that pulls, the candidate that serves it: one that holds a replica of
    its state, the busiest one in ``step`` first (else the lowest rank)."""
    sources = {}
    for rank in pulls:
        able = _sources_for(positions, rank, candidates)
        if not able:
            replicas = sorted(r for r, p in positions.items() if r != rank
                              and (p.replicas is None or rank in p.replicas))  # fmt: skip
            if not replicas:
                raise RecoveryImpossible(
                    f"no surviving rank holds a replica of rank {rank}'s state: recovering it "
                    "would need a checkpoint"
                )
            at = ", ".join(f"rank {r} at step {positions[r].state_step}" for r in replicas)
            raise RecoveryImpossible(
                f"rank {rank}'s replicas ({at}) hold another step's state than the one the "
                f"job resumes at ({step})"
            )
        sources[rank] = _busiest(positions, able, step) if step is not None else min(able)
    return sources


class RecoveryPhase(enum.Enum):
    PARKING = "parking"  # survivors park; the replacements start
    RESTORING = "restoring"  # the plan is out: rebuild, pull, replay or roll back
    DONE = "done"
    FAILED = "failed"


# RecoveryPhase -> the phases it may go to
RECOVERY_TRANSITIONS: dict[RecoveryPhase, set[RecoveryPhase]] = {
    RecoveryPhase.PARKING: {RecoveryPhase.RESTORING, RecoveryPhase.FAILED},
    RecoveryPhase.RESTORING: {RecoveryPhase.DONE, RecoveryPhase.FAILED},
    RecoveryPhase.DONE: set(),
    RecoveryPhase.FAILED: set(),
}


@dataclass
class Recovery:
    """One recovery in progress (and, once done, its record)."""

    generation: int
    primary: FaultRecord
    replaced: list[int]
    survivors: list[int]
    started: float  # the decision (wall clock)
    deadline: float
    phase: RecoveryPhase = RecoveryPhase.PARKING
    parked: dict[int, Position] = field(default_factory=dict)
    parked_at: float | None = None
    plan: Rebuild | None = None
    joined: dict[int, float] = field(default_factory=dict)
    recovered: dict[int, Recovered] = field(default_factory=dict)
    from_spare: dict[int, bool] = field(default_factory=dict)
    placement: dict[int, int] = field(default_factory=dict)  # replaced rank -> its node
    lost: set[int] = field(default_factory=set)  # survivors that died meanwhile
    no_replay: str | None = None  # why this recovery rolls back (a replay of it failed)
    # who has yet to park, and to recover: counted down per message, which at 1,024 ranks
    # must not compare sets of every rank
    unparked: set[int] = field(init=False)
    unrecovered: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.unparked = set(self.survivors)
        self.unrecovered = self.expected

    @property
    def expected(self) -> set[int]:
        return set(self.survivors) | set(self.replaced)

    def start(self, now: float) -> list[Order]:
        return [self._note(now, "phase", phase=self.phase.value, replaced=self.replaced,
                           placement=self.placement)]  # fmt: skip

    def _enter(self, phase: RecoveryPhase, now: float, **fields: Any) -> list[Order]:
        if phase not in RECOVERY_TRANSITIONS[self.phase]:
            raise AssertionError(f"recovery cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase
        return [self._note(now, "phase", phase=phase.value, **fields)]

    def on(self, event: Any, now: float) -> list[Order]:
        """The orders ``event`` calls for (none when it does not concern this recovery)."""
        if self.phase in (RecoveryPhase.DONE, RecoveryPhase.FAILED):
            return []
        if now > self.deadline:
            return self._fail(self._late(), now)
        if isinstance(event, WorkerStarted) and event.rank in self.replaced:
            self.from_spare[event.rank] = event.from_spare
        elif isinstance(event, WorkerJoined):
            self.joined[event.rank] = event.t
            return [self._note(now, "joined", rank=event.rank)]
        elif getattr(event, "generation", self.generation) != self.generation:
            return []  # a report of an earlier recovery
        elif isinstance(event, Parked):
            return [self._note(now, "parked", rank=event.rank, step=event.position.step),
                    *self._on_parked(event, now)]  # fmt: skip
        elif isinstance(event, StateSent):
            return self._relay_digest(event)
        elif isinstance(event, ReplayMismatched):
            return self._mismatched(event, now)
        elif isinstance(event, Recovered):
            self.recovered[event.rank] = event
            self.unrecovered.discard(event.rank)
            note = self._note(now, "recovered", rank=event.rank, role=event.role,
                              phases={k: round(v, 6) for k, v in event.phases.items()})  # fmt: skip
            if self.plan is None or self.unrecovered:
                return [note]
            record = self.record(now)
            return [note, *self._enter(RecoveryPhase.DONE, now, record=record),
                    Settled(record, describe_recovery(record))]  # fmt: skip
        return []

    def _note(self, now: float, what: str, **fields: Any) -> Note:
        return Note("recovery", {"generation": self.generation, "what": what,
                                 "after_s": round(now - self.started, 6), **fields})  # fmt: skip

    def _on_parked(self, event: Parked, now: float) -> list[Order]:
        self.parked[event.rank] = event.position
        self.unparked.discard(event.rank)
        if self.plan is not None or self.unparked:
            return []
        self.parked_at = now
        try:
            self.plan = plan_rebuild(self.parked, self.replaced, self.generation,
                                     no_replay=self.no_replay)  # fmt: skip
        except RecoveryImpossible as exc:
            return self._fail(str(exc), now)
        return [*self._enter(RecoveryPhase.RESTORING, now), ToAll(self.plan)]

    def _mismatched(self, event: ReplayMismatched, now: float) -> list[Order]:
        """A replacement's op is not what its survivors logged: the step cannot be replayed.
        Where no rollback was tried yet, the recovery starts over as one."""
        why = f"rank {event.rank}'s op differs from its survivors' log ({event.why})"
        if self.plan is None or self.plan.mode != "replay" or event.rank not in self.replaced:
            return self._fail(f"the step cannot be replayed: {why}", now)
        orders = self._enter(RecoveryPhase.FAILED, now, why=why)
        return [*orders, Retry(why)]

    def _relay_digest(self, event: StateSent) -> list[Order]:
        """The serving rank's digest of the state it sent, to the rank that received it."""
        if self.plan is None:
            return []
        if event.rank != self.plan.source_of(event.target):
            return [Note("ignored", {"why": f"a state digest from rank {event.rank}, which "
                                            "serves no state"})]  # fmt: skip
        return [ToAll(StateAnnounced(generation=self.generation, rank=event.target,
                                     source=event.rank, digest=event.digest))]  # fmt: skip

    def fail(self, reason: str, now: float) -> list[Order]:
        """Give up (a rank failed, its agent was lost, or the job stops)."""
        return self._fail(reason, now)

    def _fail(self, reason: str, now: float) -> list[Order]:
        return [*self._enter(RecoveryPhase.FAILED, now), GiveUp("recovery impossible", reason)]

    def _late(self) -> str:
        if self.plan is None:
            return f"ranks {sorted(self.unparked)} did not park in time"
        missing = sorted(self.unrecovered)
        return f"ranks {missing} did not finish recovering in time"

    def record(self, now: float) -> dict[str, Any]:
        assert self.plan is not None
        fault = self.primary
        survivors = [self.recovered[r] for r in self.survivors if r in self.recovered]
        everyone = list(self.recovered.values())

        def longest(reports: list[Recovered], phase: str) -> float:
            return max((float(r.phases.get(phase, 0.0)) for r in reports), default=0.0)

        pulls = [r.pull for r in everyone if r.pull]
        pull_bytes = max((int(p["bytes"]) for p in pulls), default=0)
        pull_s = max((float(p["seconds"]) for p in pulls), default=0.0)
        setup_s = max((float(p.get("setup_seconds", 0.0)) for p in pulls), default=0.0)
        respawn = max((t - self.started for r, t in self.joined.items() if r in self.replaced),
                      default=0.0)  # fmt: skip
        resumed = max((r.t_resumed for r in everyone), default=now)
        if self.plan.mode == "rollback":
            mode = "rollback"
        else:
            mode = "respawn" if self.replaced else "in-place retry"
        replay = combine_replays([r.replay_check for r in survivors])
        phases = {
            "detect": float(fault.detected_after_s or 0.0),
            "park": (self.parked_at or self.started) - self.started,
            "respawn": respawn,
            "rebuild": longest(survivors, "rebuild"),
            "pull": max(pull_s, longest(everyone, "pull")),
            "replay": longest(survivors, "replay"),
        }
        return {
            "generation": self.generation,
            "rank": fault.rank,
            "ranks": list(self.replaced),
            "fault_kind": fault.kind,
            "step": fault.step,
            "mode": mode,
            "resume_step": self.plan.step,
            "source": self.plan.source,
            "sources": {str(r): self.plan.source_of(r) for r in self.plan.pulls},
            "groups": _groups(survivors),
            "why_rollback": self.plan.why,
            "phases": {k: round(v, 4) for k, v in phases.items()},
            "total_s": round(resumed - fault.t_fault, 4),
            "from_spare": [self.from_spare.get(r, False) for r in self.replaced],
            "nodes": {str(r): n for r, n in sorted(self.placement.items())},
            "pull_bytes": pull_bytes,
            "pull_gb_per_s": round(pull_bytes / pull_s / 1e9, 3) if pull_s > 0 else None,
            "pull_setup_s": round(setup_s, 4),
            "replay": replay,
        }


def _groups(survivors: list[Recovered]) -> dict[str, list[str]]:
    """Which process groups the survivors rebuilt and which they kept."""
    rebuilt = sorted({g for r in survivors for g in (r.groups or {}).get("rebuilt", [])})
    kept = sorted({g for r in survivors for g in (r.groups or {}).get("kept", [])} - set(rebuilt))
    return {"rebuilt": rebuilt, "kept": kept}


def _served(record: dict[str, Any]) -> str:
    """Who served whom: ``rank 0``, or ``rank 0 (to 1), rank 2 (to 3)``."""
    sources = record.get("sources") or {}
    if len(set(sources.values())) <= 1:
        return f"rank {record['source']}"
    return ", ".join(
        f"rank {s} (to {r})" for r, s in sorted(sources.items(), key=lambda i: int(i[0]))
    )


def describe_recovery(record: dict[str, Any]) -> str:
    """One human line for a recovery record."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items())
    ranks = ",".join(str(r) for r in record["ranks"]) or str(record["rank"])
    text = (
        f"recovered rank {ranks} ({record['fault_kind']} at step {record['step']}) by "
        f"{record['mode']} in {record['total_s']:.2f} s; resumed at step "
        f"{record['resume_step']} with state from {_served(record)} [{phases}]"
    )
    if record.get("why_rollback"):
        text += f"; rolled back because {record['why_rollback']}"
    return f"{text}; {describe_verdict(record.get('replay'), record['mode'])}"
