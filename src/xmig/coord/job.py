"""The job as the coordinator keeps it: its spec, and what happened to it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class JobSpec:
    """Everything the coordinator and agents need to run a job (set by ``xmig run``)."""

    job_id: str
    script: str
    args: list[str]
    cwd: str
    nnodes: int
    nproc_per_node: int
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    stop_grace: float = 3.0
    agent_connect_timeout: float = 60.0
    keep_log: bool = True
    recovery_timeout: float = 120.0
    max_recoveries: int = 10
    hot_spares: int = 1
    spare_nodes: int = 0
    simulate_hosts: bool = False

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def all_nodes(self) -> int:
        """Nodes with workers plus the spare ones."""
        return self.nnodes + self.spare_nodes

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["world_size"] = self.world_size
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        data = dict(data)
        data.pop("world_size", None)
        return cls(**data)


DETAIL_CHARS = 200


def describe_fault(record: dict[str, Any]) -> str:
    """One human line for a fault record."""
    detail = str(record["detail"]).strip().splitlines()[0] if record["detail"] else "?"
    if len(detail) > DETAIL_CHARS:
        detail = detail[: DETAIL_CHARS - 1] + "…"
    record = {**record, "detail": detail}
    how = {
        "signal": f"killed by {record['detail']}",
        "exit": f"exited with {record['detail']}",
        "hang": f"hung: {record['detail']}",
        "error": f"error: {record['detail']}",
        "agent_lost": f"lost with its node: {record['detail']}",
        "comm_error": f"collective failed: {record['detail']}",
    }.get(record["kind"], f"failed: {record['detail']}")
    step = record.get("step")
    where = f"step {step}" if step is not None else "before its first step"
    text = f"rank {record['rank']} (node {record['node']}, pid {record['pid']}), {where}: {how}"
    if record.get("injected"):
        fault = record["injected"]
        text += f" [injected {fault['kind']} at {fault['at']}]"
    latency = record.get("detected_after_s")
    if latency is not None:
        text += f"; detected after {latency * 1000:.1f} ms"
        if record.get("fault_time_source") == "last_heartbeat":
            text += " since its last heartbeat"
    return text
