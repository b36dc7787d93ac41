"""The job as the coordinator keeps it: its spec (``xmig.jobspec``), and what happened to it."""

from __future__ import annotations

from typing import Any

# the spec belongs to the whole job (launcher, coordinator, agents, workers): it lives in
# xmig.jobspec; imported from here too
from xmig.jobspec import JobSpec, JobSpecError

__all__ = ["JobSpec", "JobSpecError", "describe_fault"]


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
