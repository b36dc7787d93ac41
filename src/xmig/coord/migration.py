"""One live migration: a rank's process moves to another node at a step boundary.

Every rank pauses at the start of the same step (no collective in flight), the moving rank
closes what cannot move, its node's agent checkpoints it with CRIU, the target node's agent
restores it (same PID, the target's network namespace), it reconnects, and every rank resumes
on a new generation's communicator. No state pull, no replay: the process carried its state.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("quiesce", "gpu_checkpoint", "dump", "transfer", "restore", "gpu_restore", "rejoin")


def shared_images() -> bool:
    """Whether a directory every node reads is configured (``XMIG_MIGRATE_DIR``); otherwise
    the target node's agent fetches the images from the source node's agent."""
    return "XMIG_MIGRATE_DIR" in os.environ


def job_images(job_id: str) -> list[Path]:
    """The folders a job's migrations may have left on this machine."""
    roots = [Path(tempfile.gettempdir())]
    if shared_images():
        roots.append(Path(os.environ["XMIG_MIGRATE_DIR"]))
    return [root / "xmig-migrate" / job_id for root in roots]


def images_dir(job_id: str, node: int, name: str) -> str:
    """Where a node keeps checkpoint images: the shared directory, or its own temp dir."""
    if shared_images():
        return str(Path(os.environ["XMIG_MIGRATE_DIR"]) / "xmig-migrate" / job_id / name)
    return str(Path(tempfile.gettempdir()) / "xmig-migrate" / job_id / f"node{node}" / name)


@dataclass
class Migration:
    """A migration in progress (and, once done, its record)."""

    generation: int
    rank: int
    pid: int
    source: int
    target: int
    step: int  # the boundary every rank pauses at
    images: str  # where the source node writes them
    target_images: str  # where the target node reads them (the same when shared)
    why: str  # "request" or the injected spec
    started: float = field(default_factory=time.time)
    paused: dict[int, int] = field(default_factory=dict)
    resumed: set[int] = field(default_factory=set)
    times: dict[str, float] = field(default_factory=dict)  # event -> wall clock
    dump_s: float = 0.0
    restore_s: float = 0.0
    transfer_s: float = 0.0
    image_bytes: int = 0
    restored_pid: int | None = None
    netns: int | None = None  # the network namespace the moved process reported from
    gpu: str | None = None  # the UUID of the GPU it held state on
    to_gpu: str | None = None  # the UUID of the GPU it was restored onto
    gpu_bytes: int = 0  # GPU memory it held when it stopped
    gpu_checkpoint_s: float = 0.0
    gpu_restore_s: float = 0.0
    gpu_times: dict[str, float] = field(default_factory=dict)  # each driver call
    interface: str | None = None  # the rank's own network interface, moved with it

    @property
    def rejoin_file(self) -> str:
        return f"{self.target_images}.rejoin.json"

    def order(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "generation": self.generation, **fields}

    def record(self) -> dict[str, Any]:
        t = self.times
        end = t.get("resumed", time.time())
        quiesced = t.get("quiesced", self.started)
        dumped = t.get("dumped", quiesced)
        restored = t.get("restored", dumped)
        # the agents time the GPU and CRIU steps; the rest is the time between the reports
        phases = {
            "quiesce": quiesced - self.started,
            "gpu_checkpoint": self.gpu_checkpoint_s,
            "dump": dumped - quiesced - self.gpu_checkpoint_s,
            "transfer": self.transfer_s,  # 0 with a shared directory
            "restore": restored - dumped - self.gpu_restore_s - self.transfer_s,
            "gpu_restore": self.gpu_restore_s,
            "rejoin": end - restored,
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
            "pid_kept": self.restored_pid == self.pid,
            "netns": self.netns,
            "phases": {k: round(max(0.0, v), 4) for k, v in phases.items()},
            "criu_dump_s": round(self.dump_s, 4),
            "criu_restore_s": round(self.restore_s, 4),
            "image_bytes": self.image_bytes,
            "interface": self.interface,
            "gpu": self.gpu,
            "to_gpu": self.to_gpu,
            "gpu_bytes": self.gpu_bytes,
            "gpu_calls_s": {k: round(v, 4) for k, v in self.gpu_times.items()},
            "downtime_s": round(end - quiesced, 4),
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
    gpu = ""
    if record.get("gpu"):
        gpu = f", GPU {record.get('gpu_bytes', 0) / 1e9:.2f} GB {record['gpu']}"
        if record.get("to_gpu") and record["to_gpu"] != record["gpu"]:
            gpu += f" -> {record['to_gpu']}"
    return (
        f"migrated rank {record['rank']} from node {record['from_node']} to node "
        f"{record['to_node']} at step {record['step']} in {record['total_s']:.2f} s "
        f"(downtime {record['downtime_s']:.2f} s, {kept} {record['pid']}, image "
        f"{record['image_bytes'] / 1e6:.0f} MB{gpu}) [{phases}]"
    )
