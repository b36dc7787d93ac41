"""What the job tells its launcher and ``xmig status``: read from the ``Job``, never changing it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import TYPE_CHECKING, Any

from xmig.bitwise import verdict
from xmig.coord.job import describe_fault
from xmig.faults.spec import PLANNED, FaultSpec
from xmig.protocol import FaultRecord

if TYPE_CHECKING:
    from xmig.coord.machine import Job


def describe(record: FaultRecord) -> str:
    """One human line for a fault record."""
    return describe_fault(dataclasses.asdict(record))


def by_rank(values: dict[int, Any]) -> str:
    return ", ".join(f"rank {r}: {str(v)[:12]}" for r, v in sorted(values.items()))


def unfired(job: Job) -> list[str]:
    """Faults given at launch that never happened (migrations included)."""
    fired = [f for faults in job.fired.values() for f in faults]
    fired += [f for left in job.left_ranks for f in left.get("fired", [])]
    moved = {(m["rank"], m.get("why")) for m in job.migrations}
    never = [f for f in job.spec.faults if f["kind"] not in PLANNED and f not in fired]
    never += [f for f in job.spec.faults if f["kind"] == "migrate"
              and (f in job.scheduled or (f["rank"], "injected") not in moved)]  # fmt: skip
    resized = {r.get("why") for r in job.resizes}
    never += [f for f in job.spec.faults if f["kind"] == "resize"
              and str(FaultSpec.from_json(f)) not in resized]  # fmt: skip
    never += [f for f in job.scheduled_nodes]  # add-node: the job ended before its step
    return [str(FaultSpec.from_json(f)) for f in never]


def status(job: Job) -> dict[str, Any]:
    return {
        "job_id": job.spec.job_id,
        "status": job.state.value,
        "generation": job.generation,
        "world_size": job.world_size,
        "launch_world_size": job.spec.world_size,
        "progress": {str(r): s for r, s in sorted(job.progress.items())},
        "faults": len(job.faults),
        "spares_ready": sum(job.spares_ready.values()),
    }


def _with_checks(job: Job, record: dict[str, Any]) -> dict[str, Any]:
    """A recovery's record with what was found after it: whether the replicas' checksums
    agreed, why it cannot be the fault-free run (if something says so), and the verdict."""
    checks = job.checks.get(int(record["generation"]), {})
    extra: dict[str, Any] = {"replicas_equal": checks.get("verified")}
    why = checks.get("not_bit_identical")
    if why:
        extra["not_bit_identical"] = why
    extra["verified"] = verdict(record.get("replay"), checks.get("verified"), why)
    return {**record, **extra}


def _grow_checked(job: Job, record: dict[str, Any]) -> dict[str, Any]:
    """A grow's record with whether every rank's parameters were equal after its first step
    (the new ranks' against their peers')."""
    checks = job.checks.get(int(record["generation"]), {})
    return {**record, "replicas_equal": checks.get("verified")}


def final_fingerprint(job: Job) -> str | None:
    """The final parameters' SHA-256: rank 0's when every rank is a replica of it, else one
    over each set of replicas' first rank's (in rank order), so that it covers every part."""
    firsts = {r: d.params_sha256 for r, d in sorted(job.done.items())
              if d.params_sha256 is not None}  # fmt: skip
    if not any(d.replicas for d in job.done.values()):
        return firsts.get(0)
    joined = "".join(f"{rank}:{digest};" for rank, digest in firsts.items())
    return hashlib.sha256(joined.encode()).hexdigest()


def summary(job: Job, now: float) -> dict[str, Any]:
    """The run's outcome, as ``xmig run --summary`` writes it."""
    ws = job.world_size
    never = unfired(job)
    completed = job.state.value == "completed"
    exit_code = 0 if completed else 1
    if completed:
        steps = job.done[0].steps if 0 in job.done else None
        fingerprint = final_fingerprint(job)
        message = f"completed {steps} steps on {ws} ranks"
        if never:
            # a chaos run whose faults never happened tested nothing: bad input
            exit_code = 2
            message += f", but injected faults never fired: {', '.join(never)}"
    else:
        steps = min((job.progress.get(r, 0) for r in range(ws)), default=0)
        fingerprint = None
        if job.verdict is not None:
            message = f"failed: {job.verdict}"
        elif job.primary is not None:
            message = f"failed: {describe(job.primary)}"
            if job.reason not in (None, "fault"):
                message += f"; not recovered: {job.reason}"
        else:
            message = f"failed: {job.reason}"
        saved = job.jit_checkpoint
        if saved is not None and saved.get("path"):
            message += f"; just-in-time checkpoint of step {saved['step']} in {saved['path']}"
            if not saved.get("complete"):
                message += " (incomplete)"
    faults = [dataclasses.asdict(f) for f in job.faults]
    return {
        "job_id": job.spec.job_id,
        "status": job.state.value,
        "exit_code": exit_code,
        "unfired_faults": never,
        "message": message,
        "world_size": ws,
        "launch_world_size": job.spec.world_size,
        # the world's size over time: [step it took effect at, size], from the launch on
        "world_sizes": [[0 if job.spec.resume is None else None, job.spec.world_size]]
        + [[r["step"], r["new_world"]] for r in job.resizes if not r.get("refused")],
        "nnodes": job.spec.nnodes,
        "nproc_per_node": job.spec.nproc_per_node,
        "steps": steps,
        "final_params_sha256": fingerprint,
        # each set of replicas' first rank -> its parameters' SHA-256 (one set: rank 0's)
        "final_params_parts": {
            str(r): d.params_sha256
            for r, d in sorted(job.done.items())
            if d.params_sha256 is not None
        }
        if completed
        else {},  # fmt: skip
        "generation": job.generation,
        "faults": [f for f in faults if not f["secondary"]],
        "secondary_faults": [f for f in faults if f["secondary"]],
        "recoveries": [_with_checks(job, r) for r in job.recoveries],
        "migrations": job.migrations,
        # a grow's record says whether the new ranks' parameters equalled their peers'
        "resizes": [_grow_checked(job, r) if r.get("added") else r for r in job.resizes],
        "left_ranks": job.left_ranks,
        "added_nodes": job.added_nodes,
        "worker_pids": {str(r): pids for r, pids in sorted(job.worker_pids.items())},
        "worker_containers": {str(r): ids for r, ids in sorted(job.worker_containers.items())},
        "coordinator_pid": os.getpid(),
        "agent_pids": {str(n): p for n, p in sorted(job.agent_pids.items())},
        "spare_nodes": job.spec.spare_nodes,
        "lost_nodes": job.lost_nodes,
        "worker_nodes": {str(r): m.node for r, m in sorted(job.members.items())},
        "agent_netns": {str(n): i for n, i in sorted(job.agent_netns.items())},
        # where the state was saved when a fault could not be recovered (None: no such fault)
        "jit_checkpoint": job.jit_checkpoint,
        # each time the coordinator was started again, and how the job went on
        "coordinator_restarts": job.coordinator_restarts,
        "resumed_from": job.spec.resume,
        "stop_s": round(job.stop_s or 0.0, 4) if not completed else None,
        "duration_s": round(now - job.started, 3),
    }
