"""One live migration: a rank's process moves to another node at a step boundary.

Every rank pauses at the start of the same step (no collective in flight), the moving rank
closes what cannot move, its node's agent checkpoints it with CRIU, the target node's agent
restores it (same PID, the target's network namespace), it reconnects, and every rank resumes
on a new generation's communicator. No state pull, no replay: the process carried its state.
"""

from __future__ import annotations

import enum
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmig.coord.orders import GiveUp, Note, Order, Say, Settled, ToAll, ToNode
from xmig.paths import local_images_root
from xmig.protocol import (
    Dump,
    Dumped,
    Pause,
    Paused,
    PauseRefused,
    Prepare,
    Prepared,
    Rejoined,
    Restore,
    Restored,
    Resume,
    Resumed,
    WorkerDone,
)

# the downtime is the sum of those from ``stop`` on; ``park`` is a part of ``stop`` (the moving
# rank parks while the communicators are aborted), shown on its own
PHASES = ("prepare", "quiesce", "stop", "park", "gpu_checkpoint", "dump", "transfer", "restore",
          "gpu_restore", "unpark", "rejoin")  # fmt: skip
DOWNTIME_PHASES = ("stop", "gpu_checkpoint", "dump", "transfer", "restore", "gpu_restore",
                   "unpark", "rejoin")  # fmt: skip


def shared_images() -> bool:
    """Whether a directory every node reads is configured (``XMIG_MIGRATE_DIR``); otherwise
    the target node's agent fetches the images from the source node's agent."""
    return "XMIG_MIGRATE_DIR" in os.environ


def stream_forced() -> bool:
    """Whether images go over the network even between agents of one machine
    (``XMIG_STREAM_IMAGES=1``: to exercise or measure the path between machines)."""
    return os.environ.get("XMIG_STREAM_IMAGES") == "1"


def job_images(job_id: str) -> list[Path]:
    """The folders a job's migrations may have left on this machine."""
    roots = [Path(tempfile.gettempdir()), local_images_root()]
    if shared_images():
        roots.append(Path(os.environ["XMIG_MIGRATE_DIR"]))
    return [root / "xmig-migrate" / job_id for root in dict.fromkeys(roots)]


def images_dir(job_id: str, node: int, name: str) -> str:
    """Where a node keeps checkpoint images: the shared directory, or its own
    (``local_images_root``)."""
    if shared_images():
        return str(Path(os.environ["XMIG_MIGRATE_DIR"]) / "xmig-migrate" / job_id / name)
    return str(local_images_root() / "xmig-migrate" / job_id / f"node{node}" / name)


class MigrationPhase(enum.Enum):
    PREPARING = "preparing"  # the moving rank makes room for its tensors, still training
    PAUSING = "pausing"  # every rank pauses at the start of ``step``
    DUMPING = "dumping"  # the source node checkpoints the rank
    RESTORING = "restoring"  # the target node restores it
    REJOINING = "rejoining"  # the restored process reconnects
    RESUMING = "resuming"  # every rank resumes on the new generation
    DONE = "done"
    DROPPED = "dropped"  # the job finished before the pause step: nothing to move
    FAILED = "failed"


# MigrationPhase -> the phases it may go to
MIGRATION_TRANSITIONS: dict[MigrationPhase, set[MigrationPhase]] = {
    MigrationPhase.PREPARING: {MigrationPhase.PAUSING, MigrationPhase.DROPPED,
                               MigrationPhase.FAILED},
    MigrationPhase.PAUSING: {MigrationPhase.DUMPING, MigrationPhase.DROPPED,
                             MigrationPhase.FAILED},
    MigrationPhase.DUMPING: {MigrationPhase.RESTORING, MigrationPhase.FAILED},
    MigrationPhase.RESTORING: {MigrationPhase.REJOINING, MigrationPhase.FAILED},
    MigrationPhase.REJOINING: {MigrationPhase.RESUMING, MigrationPhase.FAILED},
    MigrationPhase.RESUMING: {MigrationPhase.DONE, MigrationPhase.FAILED},
    MigrationPhase.DONE: set(),
    MigrationPhase.DROPPED: set(),
    MigrationPhase.FAILED: set(),
}  # fmt: skip


@dataclass
class Migration:
    """A migration in progress (and, once done, its record). Pure: events in, orders out."""

    generation: int
    rank: int
    pid: int
    source: int
    target: int
    step: int  # the boundary every rank pauses at
    images: str  # where the source node writes them
    target_images: str  # where the target node reads them (the same when shared)
    why: str  # "request" or the injected spec
    world_size: int
    local_rank: int
    attempt: int
    started: float
    deadline: float
    serve_images: bool = True  # the source agent serves them (no shared folder)
    phase: MigrationPhase = MigrationPhase.PREPARING
    paused: dict[int, int] = field(default_factory=dict)
    resumed: set[int] = field(default_factory=set)
    times: dict[str, float] = field(default_factory=dict)  # event -> wall clock
    dump_s: float = 0.0
    restore_s: float = 0.0
    transfer_s: float = 0.0
    image_bytes: int = 0
    criu_stats: dict[str, float] = field(default_factory=dict)  # CRIU's account of the dump
    criu_restore_stats: dict[str, float] = field(default_factory=dict)  # and of the restore
    dump_steps: dict[str, float] = field(default_factory=dict)  # the source agent's steps
    restore_steps: dict[str, float] = field(default_factory=dict)  # the target agent's
    restored_pid: int | None = None
    container: str | None = None  # container mode: the rank's container
    own_pid: int | None = None  # its PID as it saw it before (in its container: its own)
    restored_own_pid: int | None = None  # and after
    netns: int | None = None  # the network namespace the moved process reported from
    gpu: str | None = None  # the UUID of the GPU it held state on
    to_gpu: str | None = None  # the UUID of the GPU it was restored onto
    gpu_bytes: int = 0  # GPU memory it held when it stopped
    gpu_checkpoint_s: float = 0.0
    gpu_restore_s: float = 0.0
    gpu_times: dict[str, float] = field(default_factory=dict)  # each driver call
    interface: str | None = None  # the rank's own network interface, moved with it
    room_bytes: int = 0  # the room the moving rank made for its tensors outside its process
    prepare_error: str | None = None  # why it made none
    held_bytes: int = 0  # GPU memory it held when it paused, before parking
    parked_bytes: int = 0  # what it parked outside the process
    dropped_bytes: int = 0  # its replay log's copies of the steps before the pause
    stop_s: float = 0.0  # the longest any rank took from its pause boundary to its report
    park_s: float = 0.0
    unpark_s: float = 0.0

    @property
    def rejoin_file(self) -> str:
        return f"{self.target_images}.rejoin.json"

    def start(self, now: float) -> list[Order]:
        return [Note("migration", {"generation": self.generation, "phase": self.phase.value,
                                   "rank": self.rank, "from": self.source, "to": self.target,
                                   "step": self.step, "after_s": 0.0}),
                ToAll(Prepare(generation=self.generation, rank=self.rank))]  # fmt: skip

    def _enter(self, phase: MigrationPhase, now: float, **fields: Any) -> list[Order]:
        if phase not in MIGRATION_TRANSITIONS[self.phase]:
            raise AssertionError(f"migration cannot go from {self.phase.name} to {phase.name}")
        self.phase = phase
        self.times[phase.value] = now
        return [Note("migration", {"generation": self.generation, "phase": phase.value,
                                   "after_s": round(now - self.started, 6), **fields})]  # fmt: skip

    def fail(self, reason: str, now: float) -> list[Order]:
        return [*self._enter(MigrationPhase.FAILED, now), GiveUp("migration failed", reason)]

    def on(self, event: Any, now: float) -> list[Order]:
        """The orders ``event`` calls for (none when it does not concern this migration)."""
        phase = self.phase
        if phase in (MigrationPhase.DONE, MigrationPhase.DROPPED, MigrationPhase.FAILED):
            return []
        if now > self.deadline:
            return self.fail(f"rank {self.rank} was not moved within "
                             f"{self.deadline - self.started:.0f} s", now)  # fmt: skip
        if isinstance(event, WorkerDone):
            if phase is MigrationPhase.PREPARING or (
                phase is MigrationPhase.PAUSING and not self.paused
            ):
                # the pause step lies past the last one: no rank will ever reach it
                return [
                    *self._enter(MigrationPhase.DROPPED, now),
                    Say(f"migration of rank {self.rank} not done: the job finished first"),
                ]
            return []
        if getattr(event, "generation", None) != self.generation:
            return []
        if isinstance(event, Prepared) and phase is MigrationPhase.PREPARING:
            if event.rank != self.rank:
                return []
            self.room_bytes = event.room_bytes if event.ok else 0
            self.prepare_error = None if event.ok else event.error
            if event.step is not None:  # it trained on meanwhile
                self.step = max(self.step, event.step + 1)
            # the job trained on while the room was made: the pause gets the whole time too
            self.deadline = now + (self.deadline - self.started)
            return [*self._enter(MigrationPhase.PAUSING, now, step=self.step,
                                 room_bytes=self.room_bytes, error=self.prepare_error),
                    ToAll(Pause(generation=self.generation, step=self.step))]  # fmt: skip
        if isinstance(event, PauseRefused) and phase is MigrationPhase.PAUSING:
            self.step = max(self.step, event.step + 1)
            self.paused.clear()
            self.stop_s = self.park_s = 0.0
            return [Note("migration", {"generation": self.generation, "phase": "repause",
                                       "step": self.step}),
                    ToAll(Pause(generation=self.generation, step=self.step))]  # fmt: skip
        if isinstance(event, Paused) and phase is MigrationPhase.PAUSING:
            if event.step == self.step:
                self.paused[event.rank] = event.step
                self.stop_s = max(self.stop_s, event.stop_s)
                if event.rank == self.rank:
                    self.park_s = event.park_s
            if len(self.paused) < self.world_size:
                return []
            # the moving worker reads where to reconnect from the rejoin file once it runs on
            # the target node
            return [*self._enter(MigrationPhase.DUMPING, now),
                    ToNode(self.source, Dump(generation=self.generation, rank=self.rank,
                                             images=self.images, rejoin_file=self.rejoin_file,
                                             serve=self.serve_images))]  # fmt: skip
        if isinstance(event, Dumped) and phase is MigrationPhase.DUMPING:
            if not event.ok:
                return self.fail(f"checkpointing rank {self.rank} failed: {event.error}", now)
            self.dump_s, self.image_bytes = event.dump_s, event.image_bytes
            self.criu_stats, self.dump_steps = dict(event.criu_stats), dict(event.steps)
            self.gpu_checkpoint_s, self.gpu = event.gpu_checkpoint_s, event.gpu
            self.gpu_bytes = event.gpu_bytes
            self.held_bytes, self.parked_bytes = event.held_bytes, event.parked_bytes
            self.dropped_bytes = event.dropped_bytes
            self.gpu_times.update(event.gpu_times)
            if event.interface:
                self.interface = str(event.interface["name"])
            self.container, self.own_pid = event.container, event.own_pid
            restore = Restore(
                generation=self.generation, rank=self.rank, pid=self.pid,
                images=self.target_images, rejoin_file=self.rejoin_file, fetch=event.serve,
                local_rank=self.local_rank, attempt=self.attempt, fds=event.fds, gpu=self.gpu,
                gpus_before=event.gpus_before, interface=event.interface,
                host_files=event.host_files, container=event.container,
            )  # fmt: skip
            return [*self._enter(MigrationPhase.RESTORING, now), ToNode(self.target, restore)]
        if isinstance(event, Restored) and phase is MigrationPhase.RESTORING:
            if not event.ok:
                return self.fail(f"restoring rank {self.rank} failed: {event.error}", now)
            self.restore_s, self.restored_pid = event.restore_s, event.pid
            self.restored_own_pid = event.own_pid
            self.gpu_restore_s, self.to_gpu = event.gpu_restore_s, event.to_gpu
            self.gpu_times.update(event.gpu_times)
            self.transfer_s = event.transfer_s
            self.criu_restore_stats = dict(event.criu_stats)
            self.restore_steps = dict(event.steps)
            return self._enter(MigrationPhase.REJOINING, now)
        if isinstance(event, Rejoined) and phase is MigrationPhase.REJOINING:
            if event.rank != self.rank:
                return []
            self.netns, self.unpark_s = event.netns, event.unpark_s
            return [*self._enter(MigrationPhase.RESUMING, now),
                    ToAll(Resume(generation=self.generation))]  # fmt: skip
        if isinstance(event, Resumed) and phase is MigrationPhase.RESUMING:
            self.resumed.add(event.rank)
            if len(self.resumed) < self.world_size:
                return []
            self.times[MigrationPhase.DONE.value] = now
            record = self.record()
            orders = self._enter(MigrationPhase.DONE, now, record=record)
            return [*orders, Settled(record, describe_migration(record))]
        return []

    def record(self) -> dict[str, Any]:
        t = self.times
        end = t.get("done", self.started)
        pausing = t.get("pausing", self.started)  # the moving rank has made its room
        quiesced = t.get("dumping", pausing)  # every rank paused
        dumped = t.get("restoring", quiesced)
        restored = t.get("rejoining", dumped)
        # the agents time the GPU and CRIU steps; the rest is the time between the reports
        phases = {
            "prepare": pausing - self.started,  # the job still trains
            "quiesce": quiesced - pausing,
            "stop": self.stop_s,  # the end of quiesce: trained no more, not yet reported
            "park": self.park_s,
            "gpu_checkpoint": self.gpu_checkpoint_s,
            "dump": dumped - quiesced - self.gpu_checkpoint_s,
            "transfer": self.transfer_s,  # 0 with a shared directory
            "restore": restored - dumped - self.gpu_restore_s - self.transfer_s,
            "gpu_restore": self.gpu_restore_s,
            "unpark": self.unpark_s,
            "rejoin": end - restored - self.unpark_s,
        }
        return {
            "kind": "migration",
            "rank": self.rank,
            "from_node": self.source,
            "to_node": self.target,
            "step": self.step,
            "generation": self.generation,
            "why": self.why,
            "pid": self.pid,
            "restored_pid": self.restored_pid,
            # as the process sees it: a container's init keeps its PID in its namespace
            "pid_kept": (
                self.restored_own_pid == self.own_pid is not None
                if self.container is not None
                else self.restored_pid == self.pid
            ),
            "container": self.container,
            "pid_in_container": self.restored_own_pid if self.container is not None else None,
            "netns": self.netns,
            "phases": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            "criu_dump_s": round(self.dump_s, 4),
            "criu_restore_s": round(self.restore_s, 4),
            "image_bytes": self.image_bytes,
            "criu_dump_stats": {k: round(v, 4) for k, v in self.criu_stats.items()},
            "criu_restore_stats": {k: round(v, 4) for k, v in self.criu_restore_stats.items()},
            # where the dump and restore phases went, step by step, as their agents timed them
            "dump_steps": {k: round(v, 4) for k, v in self.dump_steps.items()},
            "restore_steps": {k: round(v, 4) for k, v in self.restore_steps.items()},
            "interface": self.interface,
            "gpu": self.gpu,
            "to_gpu": self.to_gpu,
            "gpu_bytes": self.gpu_bytes,  # what the driver's checkpoint moved
            "held_bytes": self.held_bytes,  # on the GPU at the pause (0: a CPU job)
            "parked_bytes": self.parked_bytes,  # moved outside the process instead
            "dropped_bytes": self.dropped_bytes,  # the log's copies, not moved at all
            "room_bytes": self.room_bytes,
            "prepare_error": self.prepare_error,
            "gpu_calls_s": {k: round(v, 4) for k, v in self.gpu_times.items()},
            "downtime_s": round(self.stop_s + end - quiesced, 4),
            "total_s": round(end - self.started, 4),
        }


def gpu_conflict(rank: int, target: int, nodes: dict[int, int], gpus: dict[int, list[str]],
                 nproc_per_node: int) -> str | None:  # fmt: skip
    """Why ``rank`` cannot go to node ``target`` for its GPU (None: it can). ``nodes``: each
    rank's node; ``gpus``: each node's GPUs in its workers' order. Measured: a process whose
    GPU state the driver restores onto a GPU that another process uses fails its first
    kernels (``unspecified launch failure``), so the target GPU must be one no other rank
    holds."""
    local = rank % nproc_per_node
    target_gpus = gpus.get(target) or []
    if local >= len(target_gpus):
        return None  # no GPUs there (a CPU job), or none known
    wanted = target_gpus[local]
    for other, node in sorted(nodes.items()):
        held = gpus.get(node) or []
        index = other % nproc_per_node
        if other != rank and index < len(held) and held[index] == wanted:
            return (
                f"node {target}'s GPU {wanted} is in use by rank {other}: the CUDA "
                "driver cannot restore a process onto a GPU another process uses"
            )
    return None


def describe_migration(record: dict[str, Any]) -> str:
    """One human line for a migration record."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items())
    kept = "same PID" if record["pid_kept"] else "NEW PID"
    pid = str(record["pid"])
    if record.get("container"):  # its PID inside the container; the host's changes
        pid = (f"{record.get('pid_in_container')} in container {record['container']}, host PID "
               f"{record['pid']} -> {record.get('restored_pid')}")  # fmt: skip
    gpu = ""
    if record.get("gpu"):
        gpu = f", GPU {record.get('gpu_bytes', 0) / 1e9:.2f} GB {record['gpu']}"
        if record.get("to_gpu") and record["to_gpu"] != record["gpu"]:
            gpu += f" -> {record['to_gpu']}"
    return (
        f"migrated rank {record['rank']} from node {record['from_node']} to node "
        f"{record['to_node']} at step {record['step']} in {record['total_s']:.2f} s "
        f"(downtime {record['downtime_s']:.2f} s, {kept} {pid}, image "
        f"{record['image_bytes'] / 1e6:.0f} MB{gpu}) [{phases}]"
    )
