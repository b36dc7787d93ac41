"""The coordinator: the one place that decides. Hosts the job's c10d store and control server."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from xmig.coord.job import JobSpec, describe_fault
from xmig.faults.spec import FaultSpec, FaultSpecError, parse_fault
from xmig.wire import Peer, Server, format_address

# faults detected within this window of the first one are weighed together: the earliest is
# the cause, the rest (peers failing because it died) are its consequences
SETTLE_WINDOW_S = 0.2


def log(text: str) -> None:
    print(f"xmig: {text}", file=sys.stderr, flush=True)


class Coordinator:
    """Keeps membership, generations, the fault log and the job's outcome.

    Until in-place recovery exists the plan for any fault is to stop the job cleanly: every
    agent stops its workers, and the outcome names the failed rank, how and at which step.
    """

    def __init__(self, spec: JobSpec, token: str) -> None:
        import torch.distributed as dist  # only the coordinator and workers load torch

        self.spec = spec
        self.token = token
        self.store = dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=300),
        )
        spec.master_port = self.store.port
        self.server = Server(
            spec.master_addr, 0, token, self._handle, on_close=self._on_close, name="coord"
        )
        self.generation = 0
        self.status = "starting"
        self.started_at = time.time()
        self.agents: dict[int, Peer] = {}
        self.agent_pids: dict[int, int] = {}
        self.members: dict[int, dict[str, Any]] = {}
        self.worker_pids: dict[int, list[int]] = {r: [] for r in range(spec.world_size)}
        self.progress: dict[int, int] = {}
        self.exited: set[int] = set()
        self.done: dict[int, dict[str, Any]] = {}
        self.faults: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.stopped_nodes: set[int] = set()
        self.reason: str | None = None
        self.primary: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.launchers: list[Peer] = []
        self._lock = threading.RLock()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.finished = threading.Event()

    @property
    def address(self) -> str:
        return format_address(self.server.address)

    # ---- control messages ------------------------------------------------------------------
    def _handle(self, peer: Peer, msg: dict[str, Any]) -> dict[str, Any] | None:
        op = msg.get("op")
        role = peer.info.get("role")
        with self._lock:
            if op == "agent_hello" and role == "agent":
                node = int(msg["node"])
                if node in self.agents or not 0 <= node < self.spec.nnodes:
                    raise ValueError(f"node {node} is not expected or already joined")
                self.agents[node] = peer
                self.agent_pids[node] = int(msg["pid"])
                if len(self.agents) == self.spec.nnodes and self.status == "starting":
                    self.status = "running"
                return {"job": self.spec.to_json(), "generation": self.generation}
            if op == "worker_started":
                rank = int(msg["rank"])
                self.worker_pids[rank].append(int(msg["pid"]))
                self.members[rank] = {
                    "node": int(peer.info.get("node", -1)),
                    "pid": int(msg["pid"]),
                    "attempt": int(msg["attempt"]),
                }
            elif op == "progress":
                self.progress[int(msg["rank"])] = int(msg["step"])
            elif op == "worker_done":
                self.done[int(msg["rank"])] = msg
            elif op == "worker_exited":
                self._events.put(("exited", int(msg["rank"])))
            elif op == "fault":
                self._events.put(("fault", msg["record"]))
            elif op == "stopped":
                self._events.put(("stopped", int(msg["node"])))
            elif op == "wait_result":
                self.launchers.append(peer)
                if self.summary is not None:
                    peer.push({"op": "result", "summary": self.summary})
            elif op == "stop":
                self._events.put(("stop", str(msg.get("reason", "stopped by request"))))
            elif op == "status":
                return {"status": self._status()}
            elif op == "inject":
                return {"fault": self._inject(msg)}
            else:
                raise ValueError(f"unknown request {op!r}")
        return None

    def _on_close(self, peer: Peer) -> None:
        if peer.info.get("role") != "agent":
            return
        node = int(peer.info.get("node", -1))
        with self._lock:
            if self.agents.get(node) is peer:
                self._events.put(("agent_lost", node))

    def _status(self) -> dict[str, Any]:
        return {
            "job_id": self.spec.job_id,
            "status": self.status,
            "generation": self.generation,
            "world_size": self.spec.world_size,
            "progress": {str(r): s for r, s in sorted(self.progress.items())},
            "faults": len(self.faults),
        }

    def _inject(self, msg: dict[str, Any]) -> str:
        try:
            fault = parse_fault(str(msg.get("spec", "")), require_step=False)
        except FaultSpecError as exc:
            raise ValueError(str(exc)) from None
        if fault.rank >= self.spec.world_size:
            raise ValueError(
                f"rank {fault.rank} does not exist (world size {self.spec.world_size})"
            )
        if self.status != "running":
            raise ValueError(f"the job is {self.status}, not running")
        current = self.progress.get(fault.rank)
        if fault.step is None:
            fault = FaultSpec(fault.kind, fault.rank, (current or 0) + 1, fault.at, fault.code)
        elif current is not None and fault.step <= current:
            raise ValueError(f"rank {fault.rank} is already at step {current}")
        node = self.members.get(fault.rank, {}).get("node")
        agent = self.agents.get(node) if node is not None else None
        if agent is None or not agent.push({"op": "inject", "fault": fault.to_json()}):
            raise ValueError(f"rank {fault.rank} has no live agent")
        log(f"fault {fault} queued by request")
        return str(fault)

    # ---- decisions -------------------------------------------------------------------------
    def run(self) -> None:
        """The decision loop; returns when the job has an outcome."""
        self.server.start()
        deadline = time.monotonic() + self.spec.agent_connect_timeout
        while not self.finished.is_set():
            try:
                kind, data = self._events.get(timeout=0.1)
            except queue.Empty:
                with self._lock:
                    if self.status == "starting" and time.monotonic() > deadline:
                        missing = sorted(set(range(self.spec.nnodes)) - set(self.agents))
                        self._stop_job(
                            f"agents of nodes {missing} did not connect within "
                            f"{self.spec.agent_connect_timeout:.0f} s"
                        )
                continue
            self._decide(kind, data)

    def _decide(self, kind: str, data: Any) -> None:
        if kind == "fault":
            self._on_fault(data)
        elif kind == "agent_lost":
            with self._lock:
                if self.status in ("running", "starting"):
                    ranks = [r for r, m in self.members.items() if m["node"] == data]
                    record = {
                        "rank": ranks[0] if ranks else -1,
                        "node": data,
                        "pid": self.agent_pids.get(data, -1),
                        "attempt": 0,
                        "kind": "agent_lost",
                        "detail": f"agent of node {data} disconnected",
                        "step": min((self.progress.get(r, 0) for r in ranks), default=None),
                        "injected": None,
                        "t_fault": time.time(),
                        "t_detected": time.time(),
                        "fault_time_source": "detection",
                        "detected_after_s": 0.0,
                    }
                    self.agents.pop(data, None)
                    self._on_fault(record)
                else:
                    self.agents.pop(data, None)
                    self.stopped_nodes.add(data)
                    self._maybe_finish_stop()
        elif kind == "exited":
            with self._lock:
                self.exited.add(data)
                if self.status == "running" and len(self.exited) == self.spec.world_size:
                    self._finish("completed")
        elif kind == "stop":
            with self._lock:
                if self.status in ("running", "starting"):
                    self._stop_job(data)
        elif kind == "stopped":
            with self._lock:
                self.stopped_nodes.add(data)
                self._maybe_finish_stop()

    def _on_fault(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self.status not in ("running", "starting"):
                record["secondary"] = True
                self.faults.append(record)
                return
        # let the immediate consequences of the same fault arrive, then pick the cause
        batch = [record]
        deadline = time.monotonic() + SETTLE_WINDOW_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, data = self._events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "fault":
                batch.append(data)
            else:
                self._events.put((kind, data))
                break
        batch.sort(key=lambda r: r["t_fault"])
        with self._lock:
            for i, item in enumerate(batch):
                item["secondary"] = i > 0
                self.faults.append(item)
            self.primary = batch[0]
            log(f"fault: {describe_fault(batch[0])}")
            for item in batch[1:]:
                log(f"  then: {describe_fault(item)}")
            self._stop_job("fault")

    def _stop_job(self, reason: str) -> None:
        self.status = "stopping"
        self.reason = reason
        if reason != "fault":
            log(f"stopping the job: {reason}")
        self._stop_started = time.monotonic()
        for node, agent in list(self.agents.items()):
            if not agent.push({"op": "stop", "grace": self.spec.stop_grace}):
                self.stopped_nodes.add(node)
        self._stop_deadline = self._stop_started + self.spec.stop_grace + 10.0
        threading.Thread(target=self._stop_watchdog, daemon=True).start()
        self._maybe_finish_stop()

    def _stop_watchdog(self) -> None:
        while not self.finished.is_set():
            if time.monotonic() > self._stop_deadline:
                with self._lock:
                    if not self.finished.is_set():
                        missing = sorted(set(range(self.spec.nnodes)) - self.stopped_nodes)
                        log(f"agents of nodes {missing} did not confirm the stop in time")
                        self._finish("failed")
                return
            time.sleep(0.1)

    def _maybe_finish_stop(self) -> None:
        if self.status == "stopping" and self.stopped_nodes >= set(self.agents):
            self.stop_s = time.monotonic() - self._stop_started
            self._finish("failed")

    def _finish(self, outcome: str) -> None:
        if self.finished.is_set():
            return
        self.status = outcome
        self.summary = self._summary(outcome)
        for agent in self.agents.values():
            agent.push({"op": "shutdown"})
        for launcher in self.launchers:
            launcher.push({"op": "result", "summary": self.summary})
        self.finished.set()

    def _summary(self, outcome: str) -> dict[str, Any]:
        ws = self.spec.world_size
        if outcome == "completed":
            steps = self.done.get(0, {}).get("steps")
            fingerprint = self.done.get(0, {}).get("params_sha256")
            message = f"completed {steps} steps on {ws} ranks"
        else:
            steps = min((self.progress.get(r, 0) for r in range(ws)), default=0)
            fingerprint = None
            if self.primary is not None:
                message = f"failed: {describe_fault(self.primary)}"
            else:
                message = f"failed: {self.reason}"
        return {
            "job_id": self.spec.job_id,
            "status": outcome,
            "exit_code": 0 if outcome == "completed" else 1,
            "message": message,
            "world_size": ws,
            "nnodes": self.spec.nnodes,
            "nproc_per_node": self.spec.nproc_per_node,
            "steps": steps,
            "final_params_sha256": fingerprint,
            "generation": self.generation,
            "faults": [f for f in self.faults if not f.get("secondary")],
            "secondary_faults": [f for f in self.faults if f.get("secondary")],
            "recoveries": self.recoveries,
            "worker_pids": {str(r): pids for r, pids in sorted(self.worker_pids.items())},
            "coordinator_pid": os.getpid(),
            "agent_pids": {str(n): p for n, p in sorted(self.agent_pids.items())},
            "stop_s": round(getattr(self, "stop_s", 0.0), 4) if outcome != "completed" else None,
            "duration_s": round(time.time() - self.started_at, 3),
        }
