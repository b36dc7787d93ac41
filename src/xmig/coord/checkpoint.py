"""A just-in-time checkpoint, when a fault cannot be recovered: park the ranks that still
hold state, choose one step every shard has a live holder at and one writer per shard, have
them write, then seal the checkpoint with its manifest. Pure: events in, orders out, time an
argument (the ``Coordinator`` writes the manifest and renames the folder: ``Seal``)."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmig import __version__
from xmig.coord.orders import Note, Order, Saved, Seal, ToAll
from xmig.jobspec import JobSpec
from xmig.protocol import CheckpointWritten, Park, Parked, Position, WriteCheckpoint
from xmig.state.checkpoint import (
    CheckpointError,
    Manifest,
    Shard,
    file_sha256,
    lost_coordinator_folder,
    partial_name,
    read_metadata,
    seal,
    shard_file,
)


@dataclass(frozen=True)
class CheckpointPlan:
    """The step saved, which rank writes which shard, and the shards nobody holds."""

    step: int | None  # None: nothing can be saved (``why`` says why)
    shards: dict[int, list[int]]  # shard -> the ranks whose state it is
    writers: dict[int, int]  # writing rank -> its shard
    missing: list[int]  # shards with no live holder
    why: str | None = None  # why not everything is saved


def replica_sets(positions: dict[int, Position], world_size: int) -> list[list[int]]:
    """Every rank in exactly one set of ranks holding the same state, as the survivors report
    their replicas (None: every rank); a rank no survivor names is a set of its own."""
    sets: list[set[int]] = []
    for rank, position in sorted(positions.items()):
        members = set(position.replicas) if position.replicas else set(range(world_size))
        members.add(rank)
        overlapping = [s for s in sets if s & members]
        for found in overlapping:
            sets.remove(found)
            members |= found
        sets.append(members)
    named = set().union(*sets) if sets else set()
    sets += [{r} for r in range(world_size) if r not in named]
    return sorted((sorted(s) for s in sets), key=lambda s: s[0])


def plan_checkpoint(positions: dict[int, Position], world_size: int) -> CheckpointPlan:
    """One writer per shard, every shard at the same step: the latest step that each shard
    with a live holder has a holder at. ``positions``: where each live rank parked."""
    sets = replica_sets(positions, world_size)
    shards = dict(enumerate(sets))
    early = sorted(r for r, p in positions.items() if p.state_step is None)
    if early:
        return CheckpointPlan(None, shards, {}, sorted(shards),
                              f"rank {early[0]} has not reached session.steps(): there is no "
                              "step to save")  # fmt: skip
    held: dict[int, dict[int, list[int]]] = {}  # shard -> step -> its holders at that step
    for shard, ranks in shards.items():
        for rank in ranks:
            if rank in positions:
                step = int(positions[rank].state_step)  # type: ignore[arg-type]
                held.setdefault(shard, {}).setdefault(step, []).append(rank)
    missing = sorted(set(shards) - set(held))
    if not held:
        return CheckpointPlan(None, shards, {}, missing, "no rank that holds the state is left")
    common = set.intersection(*(set(steps) for steps in held.values()))
    if not common:
        at = "; ".join(f"shard {k} at step {', '.join(map(str, sorted(s)))}"
                       for k, s in sorted(held.items()))  # fmt: skip
        return CheckpointPlan(None, shards, {}, missing,
                              f"the live copies are of different steps ({at}): no one step "
                              "can be saved for every shard")  # fmt: skip
    step = max(common)
    writers = {min(held[k][step]): k for k in sorted(held)}
    why = None
    if missing:
        lost = "; ".join(f"shard {k} (rank{'s' if len(shards[k]) > 1 else ''} "
                         f"{', '.join(map(str, shards[k]))})" for k in missing)  # fmt: skip
        why = f"no live copy of {lost} is left: nothing is saved for it"
    return CheckpointPlan(step, shards, writers, missing, why)


class CheckpointPhase(enum.Enum):
    PARKING = "parking"  # the ranks that hold state park and say where
    WRITING = "writing"  # one writer per shard writes it
    SEALING = "sealing"  # the manifest goes in and the folder is renamed into place
    DONE = "done"
    FAILED = "failed"


# CheckpointPhase -> the phases it may go to
CHECKPOINT_TRANSITIONS: dict[CheckpointPhase, set[CheckpointPhase]] = {
    CheckpointPhase.PARKING: {
        CheckpointPhase.WRITING,
        CheckpointPhase.DONE,
        CheckpointPhase.FAILED,
    },  # fmt: skip
    CheckpointPhase.WRITING: {CheckpointPhase.SEALING, CheckpointPhase.FAILED},
    CheckpointPhase.SEALING: {CheckpointPhase.DONE, CheckpointPhase.FAILED},
    CheckpointPhase.DONE: set(),
    CheckpointPhase.FAILED: set(),
}


@dataclass(frozen=True)
class Sealed:
    """The coordinator's report on a ``Seal``: the checkpoint is in place, or why not."""

    generation: int
    error: str | None = None


@dataclass
class Checkpoint:
    """One just-in-time checkpoint being written (and, once done, its record)."""

    spec: JobSpec
    generation: int
    reason: str  # why the job cannot go on
    holders: list[int]  # the ranks whose state can be trusted
    started: float
    deadline: float
    phase: CheckpointPhase = CheckpointPhase.PARKING
    parked: dict[int, Position] = field(default_factory=dict)
    plan: CheckpointPlan | None = None
    written: dict[int, CheckpointWritten] = field(default_factory=dict)  # shard -> report

    @property
    def folder(self) -> str:
        assert self.spec.checkpoint_dir is not None
        return self.spec.checkpoint_dir

    @property
    def name(self) -> str:
        assert self.plan is not None
        return f"{self.spec.job_id}-step{self.plan.step}"

    @property
    def final_path(self) -> str:
        return os.path.join(self.folder, self.name)

    @property
    def partial_path(self) -> str:
        return os.path.join(self.folder, partial_name(self.name))

    def _enter(self, phase: CheckpointPhase, now: float, **fields: Any) -> list[Order]:
        if phase not in CHECKPOINT_TRANSITIONS[self.phase]:
            raise AssertionError(f"checkpoint cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase
        return [self._note(now, "phase", phase=phase.value, **fields)]

    def _note(self, now: float, what: str, **fields: Any) -> Note:
        return Note("checkpoint", {"generation": self.generation, "what": what,
                                   "after_s": round(now - self.started, 6), **fields})  # fmt: skip

    def start(self, now: float) -> list[Order]:
        others = sorted(set(range(self.spec.world_size)) - set(self.holders))
        return [self._note(now, "phase", phase=self.phase.value, holders=self.holders),
                ToAll(Park(generation=self.generation, replaced=others))]  # fmt: skip

    def on(self, event: Any, now: float) -> list[Order]:
        """The orders ``event`` calls for (none when it does not concern this checkpoint)."""
        if self.phase in (CheckpointPhase.DONE, CheckpointPhase.FAILED):
            return []
        if now > self.deadline:
            return self.fail(self._late(), now)
        if getattr(event, "generation", self.generation) != self.generation:
            return []
        if isinstance(event, Parked) and event.rank in self.holders:
            self.parked[event.rank] = event.position
            return [self._note(now, "parked", rank=event.rank), *self._maybe_plan(now)]
        if isinstance(event, CheckpointWritten) and self.phase is CheckpointPhase.WRITING:
            return self._written(event, now)
        if isinstance(event, Sealed) and self.phase is CheckpointPhase.SEALING:
            if event.error is not None:
                return self.fail(f"sealing the checkpoint failed: {event.error}", now)
            return self._done(self.final_path, now)
        return []

    def lost(self, ranks: list[int], now: float) -> list[Order]:
        """Ranks died meanwhile: no longer holders; a writer among them fails the checkpoint."""
        if self.phase in (CheckpointPhase.DONE, CheckpointPhase.FAILED):
            return []
        if self.phase is CheckpointPhase.PARKING:
            self.holders = [r for r in self.holders if r not in ranks]
            for rank in ranks:
                self.parked.pop(rank, None)
            return self._maybe_plan(now)
        assert self.plan is not None
        writing = sorted(r for r in ranks if r in self.plan.writers
                         and self.plan.writers[r] not in self.written)  # fmt: skip
        if writing:
            return self.fail(f"rank {writing[0]} was lost while it wrote its shard", now)
        return []

    def fail(self, reason: str, now: float) -> list[Order]:
        orders = self._enter(CheckpointPhase.FAILED, now, why=reason)
        return [*orders, Saved(self.record(None, reason, now))]

    def _late(self) -> str:
        if self.phase is CheckpointPhase.PARKING:
            missing = sorted(set(self.holders) - set(self.parked))
            return f"ranks {missing} did not park for the checkpoint in time"
        assert self.plan is not None
        missing = sorted(r for r, k in self.plan.writers.items() if k not in self.written)
        return f"ranks {missing} did not write their shards in time"

    def _maybe_plan(self, now: float) -> list[Order]:
        if self.plan is not None or len(self.parked) < len(self.holders):
            return []  # (cheap: one Parked a rank)
        if not set(self.parked) >= set(self.holders):
            return []
        self.plan = plan = plan_checkpoint(self.parked, self.spec.world_size)
        if plan.step is None or not plan.writers:
            orders = self._enter(CheckpointPhase.DONE, now, why=plan.why)
            return [*orders, Saved(self.record(None, plan.why, now))]
        orders = self._enter(CheckpointPhase.WRITING, now, step=plan.step,
                             writers={str(r): k for r, k in plan.writers.items()},
                             missing=plan.missing)  # fmt: skip
        writers = {str(r): k for r, k in sorted(plan.writers.items())}
        return [*orders, ToAll(WriteCheckpoint(generation=self.generation,
                                               folder=self.partial_path, step=plan.step,
                                               writers=writers))]  # fmt: skip

    def _written(self, event: CheckpointWritten, now: float) -> list[Order]:
        assert self.plan is not None
        if self.plan.writers.get(event.rank) != event.shard:
            return [self._note(now, "ignored", rank=event.rank, shard=event.shard)]
        if event.error is not None:
            return self.fail(f"rank {event.rank} could not write shard {event.shard}: "
                             f"{event.error}", now)  # fmt: skip
        self.written[event.shard] = event
        note = self._note(now, "written", rank=event.rank, shard=event.shard, bytes=event.bytes,
                          seconds=round(event.seconds, 4))  # fmt: skip
        if set(self.written) < set(self.plan.writers.values()):
            return [note]
        orders = self._enter(CheckpointPhase.SEALING, now)
        return [note, *orders, Seal(self.generation, self.partial_path, self.final_path,
                                    self.manifest(now))]  # fmt: skip

    def manifest(self, now: float) -> Manifest:
        assert self.plan is not None
        first = next(iter(self.written.values()))
        shards = [Shard(shard=k, ranks=self.plan.shards[k], file=w.file, bytes=w.bytes,
                        sha256=w.sha256, writer=w.rank)
                  for k, w in sorted(self.written.items())]  # fmt: skip
        return _manifest(self.spec, self.plan, shards, first.first_step, first.objects,
                         self.reason, now)  # fmt: skip

    def _done(self, path: str, now: float) -> list[Order]:
        assert self.plan is not None
        orders = self._enter(CheckpointPhase.DONE, now, path=path)
        return [*orders, Saved(self.record(path, self.plan.why, now))]

    def record(self, path: str | None, why: str | None, now: float) -> dict[str, Any]:
        """What the summary keeps: where the checkpoint is (None: none was written) and why
        not everything (or nothing) could be saved."""
        plan = self.plan
        return {
            "path": path,
            "step": plan.step if plan is not None else None,
            "complete": path is not None and plan is not None and not plan.missing,
            "shards": len(self.written),
            "missing": [{"shard": k, "ranks": plan.shards[k]} for k in plan.missing]
            if plan is not None else [],
            "bytes": sum(w.bytes for w in self.written.values()),
            "seconds": round(now - self.started, 4),
            "why": why,
        }  # fmt: skip


def _manifest(spec: JobSpec, plan: CheckpointPlan, shards: list[Shard], first_step: int | None,
              objects: list[str], reason: str, now: float) -> Manifest:  # fmt: skip
    assert plan.step is not None
    return Manifest(
        job_id=spec.job_id, step=plan.step, first_step=first_step, world_size=spec.world_size,
        nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node, script=spec.script_path,
        args=list(spec.args), shards=shards,
        missing=[{"shard": k, "ranks": plan.shards[k]} for k in plan.missing],
        objects=list(objects), reason=reason, created=now, versions={"xmig": __version__},
        spec=spec.to_json(),
    )  # fmt: skip


def _saved_states(partial: Path, world_size: int
                  ) -> tuple[dict[int, tuple[Path, dict[str, str]]], CheckpointPlan]:  # fmt: skip
    """The states ranks saved in ``partial`` (rank -> its file and metadata), and the
    checkpoint they make."""
    saved: dict[int, tuple[Path, dict[str, str]]] = {}
    for path in sorted(partial.glob("rank-*.safetensors")) if partial.is_dir() else []:
        try:
            metadata = read_metadata(path)
            saved[int(metadata["rank"])] = (path, metadata)
        except (CheckpointError, KeyError, ValueError, OSError):
            continue  # a file cut short by the rank's end (or still being written)
    positions = {
        rank: Position(step=int(m["step"]), state_step=int(m["step"]), log_from=None,
                       keep_log=True, signatures={}, replicas=json.loads(m["replicas"]))
        for rank, (_, m) in saved.items()
    }  # fmt: skip
    return saved, plan_checkpoint(positions, world_size)


def saved_states_complete(spec: JobSpec) -> bool:
    """Whether the states saved after the coordinator was lost make a complete checkpoint
    (hosts that save into a shared folder arrive one by one)."""
    if spec.checkpoint_dir is None:
        return False
    partial = Path(lost_coordinator_folder(spec.checkpoint_dir, spec.job_id))
    saved, plan = _saved_states(partial, spec.world_size)
    return bool(saved) and plan.step is not None and bool(plan.writers) and not plan.missing


def seal_saved_states(spec: JobSpec, reason: str, now: float) -> dict[str, Any]:
    """After the coordinator was lost, every rank saved its own state (``rank-R`` files,
    with its step and replicas in their metadata): keep one file per set of replicas, all of
    one step (``plan_checkpoint``), drop the duplicates, seal it with its manifest. The
    launcher calls this once the agents are gone; the record is the summary's."""
    record: dict[str, Any] = {"path": None, "step": None, "complete": False, "shards": 0,
                              "missing": [], "bytes": 0, "why": None}  # fmt: skip
    if spec.checkpoint_dir is None:
        return {**record, "why": "no folder to write it to"}
    partial = Path(lost_coordinator_folder(spec.checkpoint_dir, spec.job_id))
    saved, plan = _saved_states(partial, spec.world_size)
    if not saved:
        return {**record, "why": "no rank saved its state"}
    if plan.step is None or not plan.writers:
        return {**record, "why": plan.why}
    shards = []
    for rank, shard in sorted(plan.writers.items()):
        path = partial / shard_file(shard)
        os.replace(saved[rank][0], path)
        size, digest = path.stat().st_size, file_sha256(path)
        shards.append(Shard(shard=shard, ranks=plan.shards[shard], file=path.name, bytes=size,
                            sha256=digest, writer=rank))  # fmt: skip
    for duplicate in partial.glob("rank-*.safetensors"):
        duplicate.unlink()
    first = saved[min(plan.writers)][1]
    manifest = _manifest(spec, plan, shards, json.loads(first["first_step"]),
                         json.loads(first["objects"]), reason, now)  # fmt: skip
    final = Path(spec.checkpoint_dir) / f"{spec.job_id}-step{plan.step}"
    try:
        seal(partial, final, manifest)
    except (OSError, CheckpointError) as exc:
        return {**record, "why": f"sealing the checkpoint failed: {exc}"}
    return {**record, "path": str(final), "step": plan.step, "complete": not plan.missing,
            "shards": len(shards), "missing": manifest.missing,
            "bytes": sum(s.bytes for s in shards), "why": plan.why}  # fmt: skip
