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
from xmig.coord.migration import (
    Migration,
    describe_migration,
    gpu_conflict,
    images_dir,
    shared_images,
)
from xmig.coord.recovery import Recovery, RecoveryImpossible, describe_recovery, plan_rebuild
from xmig.faults.spec import FaultSpec, FaultSpecError, parse_fault
from xmig.wire import Peer, Server, format_address, listening_socket

# faults detected within this window of the first one are weighed together: the earliest is
# the cause, the rest (peers failing because it died) are its consequences
SETTLE_WINDOW_S = 0.1
CHECK_INTERVAL_S = 0.1  # how often deadlines and agents' silence are checked
# reports the decision loop handles in order: recoveries' and migrations' steps
QUEUED_REPORTS = ("worker_joined", "parked", "recovered", "recovery_failed", "paused",
                  "pause_refused", "rejoined", "resumed", "dumped", "restored", "verify",
                  "not_bit_identical")  # fmt: skip


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
        # c10d's store listens on every interface unless handed a socket: bound to the job's
        # address only, so that only the job's hosts reach it (its keys carry no token)
        self._store_socket = listening_socket(spec.master_addr, spec.master_port)
        self.store = dist.TCPStore(
            spec.master_addr,
            self._store_socket.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=300),
            master_listen_fd=self._store_socket.fileno(),
            use_libuv=True,
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
        self.released = False  # every rank finished: finished ranks were let go
        # what the ranks said of each recovery's outcome: generation -> its checks
        self.checks: dict[int, dict[str, Any]] = {}
        self.verdict: str | None = None  # why the job's result cannot be trusted, if it cannot
        self.done: dict[int, dict[str, Any]] = {}
        self.faults: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.stopped_nodes: set[int] = set()
        self.reason: str | None = None
        self.primary: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.launchers: list[Peer] = []
        self.joined: set[int] = set()
        self.spares_ready: dict[int, int] = {}
        self.agent_seen: dict[int, float] = {}  # node -> monotonic time of its last message
        self.agent_netns: dict[int, int] = {}  # node -> its network namespace's inode
        self.node_announced: dict[int, dict[str, Any]] = {}  # injected node losses
        self.lost_nodes: list[int] = []
        self.fired: dict[int, list[dict[str, Any]]] = {}  # rank -> injected faults carried out
        self.recovery: Recovery | None = None
        self.recovery_deadline = 0.0
        self.migration: Migration | None = None
        self.migrations: list[dict[str, Any]] = []
        self.criu: dict[int, dict[str, Any]] = {}  # node -> whether CRIU is usable there
        self.scheduled = [f for f in spec.faults if f["kind"] == "migrate"]
        self.total_steps: int | None = None  # as the script's step loop said
        self._warned: set[str] = set()
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
            if role == "agent":
                self.agent_seen[int(peer.info.get("node", -1))] = time.monotonic()
            if op == "agent_hello" and role == "agent":
                node = int(msg["node"])
                if node in self.agents or not 0 <= node < self.spec.all_nodes:
                    raise ValueError(f"node {node} is not expected or already joined")
                self.agents[node] = peer
                self.agent_pids[node] = int(msg["pid"])
                if msg.get("netns") is not None:
                    self.agent_netns[node] = int(msg["netns"])
                if len(self.agents) == self.spec.all_nodes and self.status == "starting":
                    self.status = "running"
                return {"job": self.spec.to_json(), "generation": self.generation}
            if op == "agent_alive":
                return None
            if op == "node_dying":
                self.node_announced[int(msg["node"])] = {"fault": msg["fault"], "t": msg["t"]}
                return None
            if op == "worker_started":
                rank = int(msg["rank"])
                self.worker_pids[rank].append(int(msg["pid"]))
                self.members[rank] = {
                    "node": int(peer.info.get("node", -1)),
                    "pid": int(msg["pid"]),
                    "attempt": int(msg["attempt"]),
                    "from_spare": bool(msg.get("from_spare")),
                }
                if self.recovery is not None and rank in self.recovery.replaced:
                    self.recovery.from_spare[rank] = bool(msg.get("from_spare"))
            elif op == "state_digest":
                self._relay_digest(msg)
            elif op == "unreachable_faults":
                self._warn_unreachable(msg["faults"], int(msg["total"]))
            elif op == "spares":
                self.spares_ready[int(msg["node"])] = int(msg["ready"])
            elif op == "progress":
                self.progress[int(msg["rank"])] = int(msg["step"])
                self._start_scheduled_migration(int(msg["rank"]), int(msg["step"]))
            elif op == "worker_done":
                self.done[int(msg["rank"])] = msg
                self._events.put(("done", int(msg["rank"])))
                if self.migration is not None:
                    self._events.put(("done_during_migration", int(msg["rank"])))
            elif op == "criu":
                self.criu[int(msg["node"])] = {"usable": bool(msg["usable"]),
                                               "detail": str(msg["detail"]),
                                               "gpus": list(msg.get("gpus") or [])}  # fmt: skip
            elif op == "migrate":
                to = msg.get("to")
                return {"migration": self._request_migration(
                    int(msg["rank"]), None if to is None else int(to), "request")}  # fmt: skip
            elif op in QUEUED_REPORTS:
                self._events.put((op, msg))
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

    def _check_agents_alive(self) -> None:
        """An agent silent for longer than the heartbeat timeout is lost, connection or not."""
        now = time.monotonic()
        for node, peer in list(self.agents.items()):
            seen = self.agent_seen.get(node)
            if seen is not None and now - seen > self.spec.heartbeat_timeout:
                self.agent_seen.pop(node, None)
                log(f"agent of node {node} silent for {now - seen:.1f} s")
                peer.push({"op": "shutdown"})  # should it come back: its node is given up
                self._events.put(("agent_lost", node))

    def _agent_lost_record(self, node: int) -> dict[str, Any] | None:
        """Forget a lost agent; the fault record for its ranks, or None when it had none."""
        self.agents.pop(node, None)
        self.lost_nodes.append(node)
        ranks = sorted(r for r, m in self.members.items() if m["node"] == node)
        if not ranks:
            log(f"spare node {node} was lost")
            return None
        detected = time.time()
        announced = self.node_announced.pop(node, None)
        t_fault = float(announced["t"]) if announced else detected
        return {
            "rank": ranks[0],
            "ranks": ranks,
            "node": node,
            "pid": self.agent_pids.get(node, -1),
            "attempt": 0,
            "kind": "agent_lost",
            "detail": f"agent of node {node} and its ranks {ranks} gone",
            "step": min((self.progress.get(r, 0) for r in ranks), default=None),
            "injected": announced["fault"] if announced else None,
            "t_fault": t_fault,
            "t_detected": detected,
            "fault_time_source": "injection" if announced else "detection",
            "detected_after_s": round(max(0.0, detected - t_fault), 6),
        }

    def _warn_unreachable(self, faults: list[dict[str, Any]], total: int) -> None:
        """A rank's step loop is shorter than its injected faults: say so at once (the end
        counts them as an error)."""
        self.total_steps = total
        late = [f for f in self.scheduled if int(f["step"]) >= total]
        for fault in [*faults, *late]:
            name = str(FaultSpec.from_json(fault))
            if name not in self._warned:
                self._warned.add(name)
                log(f"warning: fault {name} will never fire: the script runs {total} steps")

    def _unfired(self) -> list[str]:
        """Faults given at launch that never happened (migrations included)."""
        fired = [f for faults in self.fired.values() for f in faults]
        done = {(m["rank"], m.get("why")) for m in self.migrations}
        unfired = [f for f in self.spec.faults if f["kind"] != "migrate" and f not in fired]
        unfired += [f for f in self.spec.faults if f["kind"] == "migrate"
                    and (f in self.scheduled or (f["rank"], "injected") not in done)]  # fmt: skip
        return [str(FaultSpec.from_json(f)) for f in unfired]

    def _status(self) -> dict[str, Any]:
        return {
            "job_id": self.spec.job_id,
            "status": self.status,
            "generation": self.generation,
            "world_size": self.spec.world_size,
            "progress": {str(r): s for r, s in sorted(self.progress.items())},
            "faults": len(self.faults),
            "spares_ready": sum(self.spares_ready.values()),
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
        # without a step the rank itself takes its next step: progress seen here may lag
        if fault.step is not None and current is not None and fault.step <= current:
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
        next_check = 0.0
        while not self.finished.is_set():
            try:
                kind, data = self._events.get(timeout=CHECK_INTERVAL_S)
            except queue.Empty:
                pass
            else:
                self._decide(kind, data)
            # the time-outs are checked even while events keep coming (fast steps)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_INTERVAL_S
                self._check_timeouts(deadline)

    def _check_timeouts(self, start_deadline: float) -> None:
        with self._lock:
            if self.status == "starting" and time.monotonic() > start_deadline:
                missing = sorted(set(range(self.spec.all_nodes)) - set(self.agents))
                self._stop_job(
                    f"agents of nodes {missing} did not connect within "
                    f"{self.spec.agent_connect_timeout:.0f} s"
                )
            self._check_recovery_deadline()
            if self.status in ("running", "recovering", "migrating"):
                self._check_agents_alive()

    def _decide(self, kind: str, data: Any) -> None:
        if kind == "fault":
            self._on_fault(data)
        elif kind == "agent_lost":
            with self._lock:
                if data not in self.agents:
                    return  # already handled (its connection closed and it went silent)
                if self.status in ("running", "starting", "recovering", "migrating"):
                    record = self._agent_lost_record(data)
                    m = self.migration
                    # a spare target node has no ranks yet, and is needed all the same
                    moving = m is not None and data in (m.source, m.target)
                    if self.status == "migrating" and (record is not None or moving):
                        if record is not None:
                            self.faults.append({**record, "secondary": False})
                        self._abort_migration(f"the agent of node {data} was lost")
                        return
                    if record is None:
                        return
                    if self.status == "recovering":
                        self.faults.append({**record, "secondary": False})
                        self._abort_recovery(f"the agent of node {data} was lost during recovery")
                        return
                    self._on_fault(record)
                else:
                    self.agents.pop(data, None)
                    self.stopped_nodes.add(data)
                    self._maybe_finish_stop()
        elif kind == "done":
            with self._lock:
                self._maybe_release()
        elif kind == "exited":
            with self._lock:
                self.exited.add(data)
                recovery = self.recovery
                if recovery is not None and data in recovery.survivors:
                    self._abort_recovery(f"rank {data} finished and exited during the recovery, "
                                         "so it cannot replay the last step")  # fmt: skip
                    return
                if self.status == "running" and len(self.exited) == self.spec.world_size:
                    self._finish("completed")
        elif kind == "worker_joined":
            with self._lock:
                self.joined.add(int(data["rank"]))
                if self.recovery is not None:
                    self.recovery.joined[int(data["rank"])] = float(data["t"])
        elif kind in ("parked", "recovered", "recovery_failed"):
            with self._lock:
                self._on_recovery_report(kind, data)
        elif kind in ("verify", "not_bit_identical"):
            with self._lock:
                self._on_check(kind, data)
        elif kind in ("paused", "pause_refused", "rejoined", "resumed", "dumped", "restored",
                      "done_during_migration"):  # fmt: skip
            with self._lock:
                self._on_migration_report(kind, data)
        elif kind == "stop":
            with self._lock:
                if self.status in ("running", "starting", "recovering", "migrating"):
                    if self.recovery is not None or self.migration is not None:
                        for agent in self.agents.values():
                            agent.push({"op": "abort", "reason": data})
                        self.recovery = self.migration = None
                    self._stop_job(data)
        elif kind == "stopped":
            with self._lock:
                self.stopped_nodes.add(data)
                self._maybe_finish_stop()

    def _on_fault(self, record: dict[str, Any]) -> None:
        with self._lock:
            stale = (
                record.get("generation") is not None and int(record["generation"]) < self.generation
            )
            if record["kind"] == "comm_error" and (self.status == "recovering" or stale):
                return  # a survivor noticing the fault that is being recovered from
            if self.status == "recovering":
                record["secondary"] = False
                self.faults.append(record)
                log(f"fault during recovery: {describe_fault(record)}")
                self._abort_recovery("a second fault hit during recovery")
                return
            if self.status == "migrating":
                record["secondary"] = False
                self.faults.append(record)
                self.primary = record
                log(f"fault during a migration: {describe_fault(record)}")
                self._abort_migration("a fault hit during the migration")
                return
            if self.status not in ("running", "starting"):
                record["secondary"] = True
                self.faults.append(record)
                return
        # let the immediate consequences of the same fault arrive, then pick the cause
        batch = [record]
        others = []
        deadline = time.monotonic() + SETTLE_WINDOW_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, data = self._events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "fault":
                batch.append(data)
            elif kind == "agent_lost" and data in self.agents:
                with self._lock:
                    lost = self._agent_lost_record(data)
                if lost is not None:
                    batch.append(lost)
            else:
                others.append((kind, data))
        for event in others:
            self._events.put(event)
        deaths = sorted((r for r in batch if r["kind"] != "comm_error"), key=lambda r: r["t_fault"])
        errors = sorted((r for r in batch if r["kind"] == "comm_error"), key=lambda r: r["t_fault"])
        # a death explains the communication errors its peers saw; without one, the first
        # communication error is the fault itself
        ordered = deaths + errors
        with self._lock:
            for i, item in enumerate(ordered):
                item["secondary"] = i > 0 and (item["kind"] == "comm_error" or not deaths)
                self.faults.append(item)
                if item.get("injected"):
                    self.fired.setdefault(int(item["injected"]["rank"]), []).append(
                        item["injected"]
                    )
            self.primary = ordered[0]
            log(f"fault: {describe_fault(ordered[0])}")
            for item in ordered[1:]:
                if not item["secondary"]:
                    log(f"  also: {describe_fault(item)}")
            if self.status in ("running", "starting"):
                dead = {rank for r in deaths for rank in r.get("ranks", [r["rank"]])}
                self._start_recovery(ordered[0], sorted(dead))

    # ---- recovery ----------------------------------------------------------------------------
    def _start_recovery(self, primary: dict[str, Any], replaced: list[int]) -> None:
        why_not = self._why_no_recovery(primary, replaced)
        if why_not is not None:
            self.reason = why_not
            log(f"no in-place recovery: {why_not}")
            self._stop_job("fault")
            return
        self.generation += 1
        survivors = [r for r in range(self.spec.world_size) if r not in replaced]
        self.recovery = Recovery(self.generation, primary, replaced, survivors)
        self.recovery_deadline = time.monotonic() + self.spec.recovery_timeout
        self.status = "recovering"
        self.joined -= set(replaced)
        for rank in replaced:
            self.done.pop(rank, None)
        park = {"op": "park", "generation": self.generation, "replaced": replaced}
        for agent in self.agents.values():
            agent.push(park)
        placement = self._placement(replaced)
        for rank in replaced:
            member = self.members[rank]
            self.agents[placement[rank]].push({
                "op": "respawn", "rank": rank, "generation": self.generation,
                "local_rank": rank % self.spec.nproc_per_node,
                "attempt": int(member["attempt"]) + 1,
                "fired": self.fired.get(rank, []),  # on another node: not to be fired again
            })  # fmt: skip
        self.recovery.placement = placement
        moved = sorted({n for r, n in placement.items() if n != self.members[r]["node"]})
        what = f"respawning rank {replaced}" if replaced else "rebuilding in place"
        if moved:
            what += f" on spare node {', '.join(map(str, moved))}"
        log(f"recovery to generation {self.generation}: {what}")

    def _idle_nodes(self) -> list[int]:
        """Live nodes with no rank on them: spare nodes, or ones whose ranks moved away."""
        busy = {m["node"] for m in self.members.values()}
        return sorted(n for n in self.agents if n not in busy)

    def _placement(self, replaced: list[int]) -> dict[int, int]:
        """Where each replacement starts: its own node while that lives, else an idle one
        (all ranks of one lost node go to the same idle node)."""
        placement: dict[int, int] = {}
        idle = self._idle_nodes()
        moved: dict[int, int] = {}
        for rank in replaced:
            node = self.members[rank]["node"]
            if node in self.agents:
                placement[rank] = node
            else:
                if node not in moved:
                    moved[node] = idle.pop(0)
                placement[rank] = moved[node]
        return placement

    def _why_no_recovery(self, primary: dict[str, Any], replaced: list[int]) -> str | None:
        homeless = {self.members[r]["node"] for r in replaced} - set(self.agents)
        if len(homeless) > len(self._idle_nodes()):
            return (
                f"node {sorted(homeless)[0]} was lost and there is no spare node to take its "
                "ranks (--spare-nodes)"
            )
        if len(self.recoveries) >= self.spec.max_recoveries:
            return f"the job already recovered {len(self.recoveries)} times (--max-recoveries)"
        unmanaged = sorted(set(range(self.spec.world_size)) - self.joined - set(replaced))
        if unmanaged:
            return f"rank {unmanaged[0]} never called xmig.init(), so it cannot be parked"
        gone = sorted(self.exited - set(replaced))
        if gone:
            return (f"ranks {gone} finished and exited before the fault, so they cannot serve "
                    "the state or replay the last step with a replacement")  # fmt: skip
        if len(replaced) >= self.spec.world_size:
            return "every rank failed: no peer holds the state"
        for done in self.recoveries[-2:]:
            if replaced and done["ranks"] == replaced and done["step"] == primary.get("step"):
                return (
                    f"rank {replaced[0]} failed again at step {primary.get('step')}: "
                    "a crash that repeats is not a fault to recover from"
                )
        return None

    def _on_recovery_report(self, kind: str, data: dict[str, Any]) -> None:
        recovery = self.recovery
        rank = int(data["rank"])
        if kind == "recovery_failed":
            if recovery is not None:
                self._abort_recovery(f"rank {rank} could not recover: {data.get('error')}")
            return
        if recovery is None or int(data.get("generation", -1)) != recovery.generation:
            return
        if kind == "parked":
            recovery.parked[rank] = data["position"]
            if recovery.plan is None and set(recovery.parked) >= set(recovery.survivors):
                recovery.parked_at = time.time()
                try:
                    plan = plan_rebuild(recovery.parked, recovery.replaced, recovery.generation)
                except RecoveryImpossible as exc:
                    self._abort_recovery(str(exc))
                    return
                recovery.plan = plan
                for agent in self.agents.values():
                    agent.push(plan)
        elif kind == "recovered":
            recovery.recovered[rank] = data
            if recovery.plan is not None and set(recovery.recovered) >= recovery.expected:
                record = recovery.record()
                self._settled(self.recoveries, record, describe_recovery(record))

    def _settled(self, records: list[dict[str, Any]], record: dict[str, Any], line: str) -> None:
        """A recovery or migration has finished: keep its record, run on, say so."""
        records.append(record)
        self.recovery = self.migration = None
        self.status = "running"
        log(line)
        self._maybe_release()

    def _maybe_release(self) -> None:
        """Once every rank has finished its steps, nobody can need a finished rank's state
        any more: let them all exit. Until then they stay, able to park and serve. Replicas
        that end with different parameters fail the job instead."""
        if self.released or self.status != "running":
            return
        if set(self.done) >= set(range(self.spec.world_size)):
            sums = {r: d.get("checksum") for r, d in self.done.items() if d.get("checksum")}
            if len(set(sums.values())) > 1:
                self._distrust(
                    f"the ranks' parameters differ at the end ({_by_rank(sums)}): "
                    "DDP's replicas must be equal; the result is not trustworthy"
                )
                return
            self.released = True
            self._push_all({"op": "release"})

    def _relay_digest(self, msg: dict[str, Any]) -> None:
        """The serving rank's digest of the state it sent, to the rank that received it."""
        recovery = self.recovery
        plan = recovery.plan if recovery is not None else None
        if plan is None or int(msg["generation"]) != recovery.generation:  # type: ignore[union-attr]
            return
        if int(msg["rank"]) != int(plan["source"]):
            log(f"ignored a state digest from rank {msg['rank']}, which serves no state")
            return
        self._push_all({"op": "state_digest", "generation": int(msg["generation"]),
                        "rank": int(msg["target"]), "source": int(msg["rank"]),
                        "digest": str(msg["digest"])})  # fmt: skip

    def _on_check(self, kind: str, data: dict[str, Any]) -> None:
        """What the ranks say after a recovery: their replicas' checksums (all equal, or the
        job stops) and whether the recovered run can still be the fault-free run's."""
        generation = int(data["generation"])
        checks = self.checks.setdefault(generation, {"verified": None, "sums": {}})
        if kind == "not_bit_identical":
            checks["not_bit_identical"] = str(data["why"])
            log(f"warning: the recovery of generation {generation} is not bit-identical to "
                f"a run without the fault: {data['why']}")  # fmt: skip
            return
        checks["sums"][int(data["rank"])] = data.get("checksum")
        if len(checks["sums"]) < self.spec.world_size:
            return
        sums = {r: c for r, c in checks["sums"].items() if c}
        checks["verified"] = len(set(sums.values())) <= 1 if sums else None
        if checks["verified"] is False:
            self._distrust(f"after the recovery of generation {generation} the ranks' parameters "
                           f"differ at step {data['step']} ({_by_rank(sums)}): the state was "
                           "corrupted in transit or the script does not recompute a step the "
                           "same way")  # fmt: skip

    def _distrust(self, reason: str) -> None:
        """Stop a job whose result cannot be trusted, saying why."""
        self.verdict = reason
        log(f"stopping: {reason}")
        if self.recovery is not None or self.migration is not None:
            self._push_all({"op": "abort", "reason": reason})
            self.recovery = self.migration = None
        self._stop_job(reason)

    def _abort_recovery(self, reason: str) -> None:
        self._give_up("recovery impossible", reason)

    def _give_up(self, what: str, reason: str) -> None:
        """End a recovery or migration that cannot finish: every worker is told, the job
        stops with ``reason``."""
        self._push_all({"op": "abort", "reason": reason})
        self.recovery = self.migration = None
        self.reason = reason
        log(f"{what}: {reason}")
        self._stop_job("fault")

    # ---- migration ---------------------------------------------------------------------------
    def _migration_problem(self, rank: int, target: int | None) -> tuple[str | None, int]:
        """Why ``rank`` cannot move to ``target`` now (None: it can), and the target."""
        if self.status != "running":
            return f"the job is {self.status}, not running", -1
        if not 0 <= rank < self.spec.world_size:
            return f"rank {rank} does not exist (world size {self.spec.world_size})", -1
        member = self.members.get(rank)
        if member is None or rank not in self.progress:
            return f"rank {rank} has not started training yet", -1
        if target is None:
            idle = self._idle_nodes()
            if not idle:
                return "no idle node to move to: name one with --to, or start the job with "\
                       "--spare-nodes", -1  # fmt: skip
            target = idle[0]
        if not 0 <= target < self.spec.all_nodes:
            return f"node {target} does not exist (nodes 0..{self.spec.all_nodes - 1})", target
        if target not in self.agents:
            return f"node {target} is lost", target
        if target == member["node"]:
            return f"rank {rank} is already on node {target}", target
        for node in (member["node"], target):
            status = self.criu.get(node)
            if status is None:
                return f"node {node} has not reported whether CRIU works there yet", target
            if not status["usable"]:
                return f"CRIU is not usable on node {node}: {status['detail']}", target
        gpus = {node: status.get("gpus", []) for node, status in self.criu.items()}
        nodes = {r: m["node"] for r, m in self.members.items()}
        problem = gpu_conflict(rank, target, nodes, gpus, self.spec.nproc_per_node)
        return problem, target

    def _request_migration(self, rank: int, target: int | None, why: str) -> str:
        problem, target = self._migration_problem(rank, target)
        if problem is not None:
            raise ValueError(problem)
        self.generation += 1
        member = self.members[rank]
        step = max(self.progress.values()) + 1  # a boundary no rank has passed yet
        name = f"rank{rank}-g{self.generation}"
        source = int(member["node"])
        self.migration = Migration(
            self.generation, rank, int(member["pid"]), source, target, step,
            images_dir(self.spec.job_id, source, name), images_dir(self.spec.job_id, target, name),
            why,
        )  # fmt: skip
        self.status = "migrating"
        self.recovery_deadline = time.monotonic() + self.spec.recovery_timeout
        self._push_all(self.migration.order("pause", step=step))
        text = (f"moving rank {rank} from node {member['node']} to node {target} at the "
                f"start of step {step} (generation {self.generation})")  # fmt: skip
        log(text)
        return text

    def _start_scheduled_migration(self, rank: int, step: int) -> None:
        for fault in list(self.scheduled):
            if fault["rank"] == rank and step >= int(fault["step"]) - 1:
                self.scheduled.remove(fault)
                try:
                    self._request_migration(rank, fault.get("to"), "injected")
                except ValueError as exc:
                    log(f"injected migration of rank {rank} not done: {exc}")

    def _push_all(self, msg: dict[str, Any]) -> None:
        for agent in self.agents.values():
            agent.push(msg)

    def _on_migration_report(self, kind: str, data: Any) -> None:
        m = self.migration
        if m is None:
            return
        if kind == "done_during_migration":
            if not m.paused:
                # the pause step lies past the last one: no rank will ever reach it
                log(f"migration of rank {m.rank} not done: the job finished first")
                self.migration = None
                self.status = "running"
            return
        if int(data.get("generation", -1)) != m.generation:
            return
        rank = int(data.get("rank", -1))
        now = time.time()
        if kind == "pause_refused":
            m.step = max(m.step, int(data["step"]) + 1)
            m.paused.clear()
            self._push_all(m.order("pause", step=m.step))
        elif kind == "paused" and int(data["step"]) == m.step:
            m.paused[rank] = m.step
            if len(m.paused) == self.spec.world_size:
                m.times["quiesced"] = now
                # the moving worker reads where to reconnect from the rejoin file once it
                # runs on the target node
                self.agents[m.source].push(m.order("dump", rank=m.rank, images=m.images,
                                                   rejoin_file=m.rejoin_file,
                                                   serve=not shared_images()))  # fmt: skip
        elif kind == "dumped":
            if not data.get("ok"):
                self._abort_migration(f"checkpointing rank {m.rank} failed: {data.get('error')}")
                return
            m.times["dumped"] = now
            m.dump_s, m.image_bytes = float(data["dump_s"]), int(data["image_bytes"])
            m.gpu_checkpoint_s, m.gpu = float(data.get("gpu_checkpoint_s", 0.0)), data.get("gpu")
            m.gpu_bytes = int(data.get("gpu_bytes", 0))
            m.gpu_times.update(data.get("gpu_times") or {})
            member = self.members[m.rank]
            self.agents[m.target].push(m.order(
                "restore", rank=m.rank, pid=m.pid, images=m.target_images,
                rejoin_file=m.rejoin_file, fetch=data.get("serve"),
                local_rank=m.rank % self.spec.nproc_per_node, attempt=member["attempt"],
                fds=data.get("fds", {}), gpu=m.gpu,
                gpus_before=data.get("gpus_before", []),
                interface=data.get("interface")))  # fmt: skip
            if data.get("interface"):
                m.interface = str(data["interface"]["name"])
        elif kind == "restored":
            if not data.get("ok"):
                self._abort_migration(f"restoring rank {m.rank} failed: {data.get('error')}")
                return
            m.times["restored"] = now
            m.restore_s, m.restored_pid = float(data["restore_s"]), int(data["pid"])
            m.gpu_restore_s = float(data.get("gpu_restore_s", 0.0))
            m.gpu_times.update(data.get("gpu_times") or {})
            m.to_gpu = data.get("to_gpu")
            m.transfer_s = float(data.get("transfer_s", 0.0))
            self.members[m.rank]["node"] = m.target
        elif kind == "rejoined" and rank == m.rank:
            m.netns = data.get("netns")
            self._push_all(m.order("resume"))
        elif kind == "resumed":
            m.resumed.add(rank)
            if len(m.resumed) == self.spec.world_size:
                m.times["resumed"] = now
                record = m.record()
                self._settled(self.migrations, record, describe_migration(record))

    def _abort_migration(self, reason: str) -> None:
        self._give_up("migration failed", reason)

    def _check_recovery_deadline(self) -> None:
        if self.migration is not None and time.monotonic() > self.recovery_deadline:
            self._abort_migration(f"rank {self.migration.rank} was not moved within "
                                  f"{self.spec.recovery_timeout:.0f} s")  # fmt: skip
            return
        recovery = self.recovery
        if recovery is None or time.monotonic() <= self.recovery_deadline:
            return
        if recovery.plan is None:
            missing = sorted(set(recovery.survivors) - set(recovery.parked))
            self._abort_recovery(f"ranks {missing} did not park in time")
        else:
            missing = sorted(recovery.expected - set(recovery.recovered))
            self._abort_recovery(f"ranks {missing} did not finish recovering in time")

    def _stop_job(self, reason: str) -> None:
        self.status = "stopping"
        if reason != "fault" or self.reason is None:
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

    def _with_checks(self, record: dict[str, Any]) -> dict[str, Any]:
        checks = self.checks.get(int(record["generation"]), {})
        extra = {"verified": checks.get("verified")}
        if checks.get("not_bit_identical"):
            extra["not_bit_identical"] = checks["not_bit_identical"]
        return {**record, **extra}

    def _summary(self, outcome: str) -> dict[str, Any]:
        ws = self.spec.world_size
        unfired = self._unfired()
        exit_code = 0 if outcome == "completed" else 1
        if outcome == "completed":
            steps = self.done.get(0, {}).get("steps")
            fingerprint = self.done.get(0, {}).get("params_sha256")
            message = f"completed {steps} steps on {ws} ranks"
            if unfired:
                # a chaos run whose faults never happened tested nothing: bad input
                exit_code = 2
                message += f", but injected faults never fired: {', '.join(unfired)}"
        else:
            steps = min((self.progress.get(r, 0) for r in range(ws)), default=0)
            fingerprint = None
            if self.verdict is not None:
                message = f"failed: {self.verdict}"
            elif self.primary is not None:
                message = f"failed: {describe_fault(self.primary)}"
                if self.reason not in (None, "fault"):
                    message += f"; not recovered: {self.reason}"
            else:
                message = f"failed: {self.reason}"
        return {
            "job_id": self.spec.job_id,
            "status": outcome,
            "exit_code": exit_code,
            "unfired_faults": unfired,
            "message": message,
            "world_size": ws,
            "nnodes": self.spec.nnodes,
            "nproc_per_node": self.spec.nproc_per_node,
            "steps": steps,
            "final_params_sha256": fingerprint,
            "generation": self.generation,
            "faults": [f for f in self.faults if not f.get("secondary")],
            "secondary_faults": [f for f in self.faults if f.get("secondary")],
            "recoveries": [self._with_checks(r) for r in self.recoveries],
            "migrations": self.migrations,
            "worker_pids": {str(r): pids for r, pids in sorted(self.worker_pids.items())},
            "coordinator_pid": os.getpid(),
            "agent_pids": {str(n): p for n, p in sorted(self.agent_pids.items())},
            "spare_nodes": self.spec.spare_nodes,
            "lost_nodes": self.lost_nodes,
            "worker_nodes": {str(r): m["node"] for r, m in sorted(self.members.items())},
            "agent_netns": {str(n): i for n, i in sorted(self.agent_netns.items())},
            "stop_s": round(getattr(self, "stop_s", 0.0), 4) if outcome != "completed" else None,
            "duration_s": round(time.time() - self.started_at, 3),
        }


def _by_rank(values: dict[int, Any]) -> str:
    return ", ".join(f"rank {r}: {str(v)[:12]}" for r, v in sorted(values.items()))
