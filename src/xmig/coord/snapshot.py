"""What a restarted coordinator needs of its predecessor's ``Job``, as JSON.

The coordinator writes it (``snapshot``) whenever something that lasts changes: the job's
state, its generation, membership, the fault log, recoveries, migrations, checks, the
outcome; never for a rank's progress, which the agents report again. A coordinator started
again reads it (``restore``): the job then waits in ``REJOINING`` for its agents, which say
which workers they hold and at which step (``Job.on(AgentHello)``), and goes on from there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmig.jobspec import HostLaunch, JobSpec
from xmig.protocol import FaultRecord, WorkerDone, fields_of

if TYPE_CHECKING:
    from xmig.coord.machine import Job

SNAPSHOT_VERSION = 1
SNAPSHOT_NAME = "coordinator.json"
BOOKKEEPING_LAG_S = 1.0


class SnapshotError(ValueError):
    """A snapshot that cannot be read back (the restarted coordinator cannot go on)."""


def busy_with(job: Job) -> dict[str, Any] | None:
    """What the job was in the middle of: a recovery (its replaced ranks), a migration (its
    rank) or a checkpoint; None when nothing was."""
    if job.recovery is not None:
        return {"what": "recovery", "ranks": list(job.recovery.replaced),
                "generation": job.recovery.generation}  # fmt: skip
    if job.migration is not None:
        return {"what": "migration", "ranks": [job.migration.rank],
                "generation": job.migration.generation}  # fmt: skip
    if job.resizing is not None:  # a grow's new ranks hold no state (to end, not to save)
        return {"what": "resize", "ranks": sorted(job.resizing.plan.added),
                "generation": job.resizing.generation}  # fmt: skip
    if job.checkpoint is not None:
        return {"what": "checkpoint", "ranks": [], "generation": job.checkpoint.generation}
    if job.batch:
        return {"what": "fault", "ranks": sorted({r for f in job.batch for r in f.lost_ranks}),
                "generation": job.generation}  # fmt: skip
    return None


def revision(job: Job) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(what the job decided, its bookkeeping): the snapshot is written before a decision is
    carried out, and at most every ``BOOKKEEPING_LAG_S`` for the bookkeeping alone (a rank
    started, joined, exited, its checksum: one event a rank, which at 1,024 ranks must not
    each rewrite the snapshot; agents tell a restarted coordinator again what matters of it).
    Cheap: compared after every event, never a sum over the ranks."""
    decided = (job.state, job.generation, len(job.faults), len(job.batch), len(job.recoveries),
               len(job.migrations), len(job.resizes), job.world_size, len(job.lost_nodes),
               len(job.added_nodes), len(job.joining), job.wanted_world,
               tuple(sorted(job.agents)),
               len(job.checks), job.verdict, job.reason, job.jit_checkpoint is not None,
               job.released, job.restarts, len(job.scheduled), len(job.warned),
               job.total_steps, len(job.coordinator_restarts))  # fmt: skip
    kept = (len(job.exited), len(job.joined), job.spawned,
            sum(len(c.get("sums", {})) for c in job.checks.values()))  # fmt: skip
    return decided, kept


def snapshot(job: Job) -> dict[str, Any]:
    """The job's lasting state as JSON."""
    return {
        "version": SNAPSHOT_VERSION,
        "job_id": job.spec.job_id,
        "started": job.started,
        "state": job.state.value,
        "busy": busy_with(job),
        "generation": job.generation,
        "agents": sorted(job.agents),
        "agent_pids": _keys_str(job.agent_pids),
        "agent_netns": _keys_str(job.agent_netns),
        "members": {
            str(r): {"node": m.node, "pid": m.pid, "attempt": m.attempt, "from_spare": m.from_spare}
            for r, m in job.members.items()
        },
        "worker_pids": _keys_str(job.worker_pids),
        "worker_containers": _keys_str(job.worker_containers),
        "joined": sorted(job.joined),
        "done": {str(r): fields_of(d) for r, d in job.done.items()},
        "exited": sorted(job.exited),
        "faults": [dataclasses.asdict(f) for f in job.faults],
        "batch": [dataclasses.asdict(f) for f in job.batch],
        "held": [dataclasses.asdict(f) for f in job.held],
        "primary": dataclasses.asdict(job.primary) if job.primary is not None else None,
        "recoveries": job.recoveries,
        "migrations": job.migrations,
        "resizes": job.resizes,
        "left_ranks": job.left_ranks,
        "world_size": job.world_size,
        "scheduled_resizes": job.scheduled_resizes,
        "scheduled_nodes": job.scheduled_nodes,
        "wanted_world": job.wanted_world,
        "added_nodes": job.added_nodes,
        "joining": _keys_str(job.joining),
        "launched_as": _keys_str(job.launched_as),
        "local_ranks": _keys_str(job.local_ranks),
        "checks": [[g, _checks_json(c)] for g, c in sorted(job.checks.items())],
        "verdict": job.verdict,
        "reason": job.reason,
        "lost_nodes": job.lost_nodes,
        "fired": _keys_str(job.fired),
        "scheduled": job.scheduled,
        "total_steps": job.total_steps,
        "warned": sorted(job.warned),
        "jit_checkpoint": job.jit_checkpoint,
        "released": job.released,
        "restarts": job.restarts,
        "coordinator_restarts": job.coordinator_restarts,
    }


def restore(spec: JobSpec, data: dict[str, Any], now: float, launch: HostLaunch | None = None,
            how: str = "restarted") -> Job:  # fmt: skip
    """The job a snapshot describes, waiting for its agents to rejoin (``REJOINING``)."""
    from xmig.coord.machine import Job, JobState, Member, Rejoin

    if data.get("version") != SNAPSHOT_VERSION or data.get("job_id") != spec.job_id:
        raise SnapshotError(f"not a snapshot of job {spec.job_id} (version "
                            f"{data.get('version')!r}, job {data.get('job_id')!r})")  # fmt: skip
    try:
        job = Job(spec, started=float(data["started"]), launch=launch)
        job.generation = int(data["generation"])
        job.agent_pids = _keys_int(data["agent_pids"])
        job.agent_netns = _keys_int(data["agent_netns"])
        job.members = {int(r): Member(**m) for r, m in data["members"].items()}
        job.worker_pids = {r: list(p) for r, p in _keys_int(data["worker_pids"]).items()}
        job.worker_containers = {r: list(c) for r, c in
                                 _keys_int(data.get("worker_containers", {})).items()}  # fmt: skip
        job.joined = set(data["joined"])
        job.done = {int(r): WorkerDone(**d) for r, d in data["done"].items()}
        job.exited = set(data["exited"])
        job.faults = [FaultRecord(**f) for f in data["faults"]]
        job.primary = FaultRecord(**data["primary"]) if data["primary"] else None
        job.recoveries = list(data["recoveries"])
        job.migrations = list(data["migrations"])
        job.resizes = list(data.get("resizes", []))
        job.left_ranks = list(data.get("left_ranks", []))
        job.world_size = int(data.get("world_size", spec.world_size))
        job.scheduled_resizes = list(data.get("scheduled_resizes", job.scheduled_resizes))
        job.scheduled_nodes = list(data.get("scheduled_nodes", job.scheduled_nodes))
        job.wanted_world = int(data.get("wanted_world", job.wanted_world))
        job.added_nodes = [int(n) for n in data.get("added_nodes", [])]
        job.joining = _keys_int(data.get("joining", {}))
        job.launched_as = _keys_int(data.get("launched_as", _keys_str(job.launched_as)))
        job.local_ranks = _keys_int(data.get("local_ranks", _keys_str(job.local_ranks)))
        job.checks = {int(g): _checks_back(c) for g, c in data["checks"]}
        job.verdict, job.reason = data["verdict"], data["reason"]
        job.lost_nodes = list(data["lost_nodes"])
        job.fired = {r: list(f) for r, f in _keys_int(data["fired"]).items()}
        job.scheduled = list(data["scheduled"])
        job.total_steps = data["total_steps"]
        job.warned = set(data["warned"])
        job.jit_checkpoint = data["jit_checkpoint"]
        job.released = bool(data["released"])
        job.restarts = int(data["restarts"]) + 1
        job.coordinator_restarts = list(data["coordinator_restarts"])
        busy = data["busy"]
        job.batch = [FaultRecord(**f) for f in data["batch"]]  # a fault not yet settled
        job.held = [FaultRecord(**f) for f in data.get("held", [])]  # deaths held meanwhile
        before = JobState(data["state"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"the coordinator's snapshot cannot be read: {exc}") from None
    job.state = JobState.REJOINING
    job.rejoin = Rejoin(before=before, busy=busy, expected=set(data["agents"]), started=now,
                        deadline=now + spec.rejoin_timeout, how=how)  # fmt: skip
    return job


def snapshot_path(folder: Path) -> Path:
    return folder / SNAPSHOT_NAME


def write_snapshot(path: Path, data: dict[str, Any]) -> None:
    """Written aside and renamed: a coordinator killed meanwhile leaves the last whole one."""
    partial = path.with_name(f".{path.name}.partial")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(data, default=str))  # (json.dump encodes in pure Python)
    os.replace(partial, path)


def read_snapshot(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read the coordinator's snapshot {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path} is not a coordinator's snapshot")
    return data


def _keys_str(values: dict[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in values.items()}


def _keys_int(values: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in values.items()}


def _checks_json(checks: dict[str, Any]) -> dict[str, Any]:
    out = dict(checks)
    for name in ("sums", "replicas"):
        if name in out:
            out[name] = _keys_str(out[name])
    return out


def _checks_back(checks: dict[str, Any]) -> dict[str, Any]:
    out = dict(checks)
    for name in ("sums", "replicas"):
        if name in out:
            out[name] = _keys_int(out[name])
    return out
