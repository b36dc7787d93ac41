"""Control plane at scale: the real coordinator driven by simulated agents and workers.

    python bench/control_scale.py [--sizes 16x2,128x16,1024x128] [--repeat 3]
                                  [--out bench/results/control-scale.md] [--profile]

Starts the REAL coordinator (``python -m xmig.coord``, as ``xmig run`` starts it: the job spec
as JSON on its stdin, the token in its environment, its ready line on its stdout) for a job of
N ranks on M nodes, and drives it with stub agents and stub workers that speak the real
protocol (``xmig.protocol``'s messages over ``xmig.wire.Client``) in the real order: agent
hello, the CRIU report, workers started, spares ready, workers joined, steps (progress), worker
heartbeats and ``agent_alive`` at the job's intervals; then a fault: one agent reports a worker
killed by SIGKILL (``fault``), each agent relays the park to its survivors, which report
``parked`` with their logs and layout (a replay is possible), the failed rank's agent respawns
it from a hot spare (``spares``, ``worker_started``, ``worker_joined``), the serving survivor
announces the digest of the state it sent (``state_sent``), the replacement and the survivors
report ``recovered``, the job runs on (``verify`` at the boundary after the recovered step),
every worker finishes (``done``: equal replica checksums, rank 0's parameters' SHA-256) and,
once released, exits; the coordinator's ``result`` ends the run.

Where the stubs live: ONE process, this one. Each stub agent is a ``wire.Client`` to the
coordinator, whose reader thread receives the coordinator's pushes and stamps their arrival;
ONE driver thread plays every agent's main loop and every worker (timers and orders, in
order). A worker's messages reach its agent as objects (each kind is encoded and decoded
against the catalogue once, the first time), not over a socket of their own: that hop never
reaches the coordinator, and 1,024 more connections with two threads each would take the
CPU from the coordinator on a 2-core machine. One process rather than a few: on 2 cores the
coordinator needs one core to itself; several stub processes would only compete for the
other, and one GIL-bound process keeps the stubs' load at most one core.

Measured per run (the stubs' clock is the coordinator's: one machine):
- decision time to the park orders: from just before the ``fault`` is sent to the last of
  the recovery's first orders (``park`` to every agent, ``respawn`` to one) received;
- decision time to the plan: from the last ``parked`` sent to the last ``rebuild`` received;
- steady-state traffic into the coordinator: messages/s and bytes/s (the frames as
  ``wire.Connection.send`` writes them: length prefix and JSON), counted by the stubs over
  the steady window, before the fault;
- the coordinator's CPU seconds per second over the steady window (psutil) and over the
  recovery (fault sent → the recovery's ``done`` in its event log; from the process's CPU
  clock, in ns, as psutil's 10 ms ticks are too coarse for a window of 0.2 s).
The coordinator's event log splits each decision into intake, decision and delivery.

``--profile`` adds one run of the largest size with py-spy attached to the coordinator (the
thread holding the GIL, 1 kHz) for 2 s of the steady window, around the recovery and over the
job's end (py-spy from ``$PY_SPY``, the PATH or ``/tmp/pyspy-venv``: ``python -m venv
/tmp/pyspy-venv && /tmp/pyspy-venv/bin/pip install py-spy``). ``--keep DIR`` keeps each run's
event log and coordinator stderr. To measure one commit while others land, run from an
export of it: ``git archive COMMIT src | tar -x -C DIR`` and ``PYTHONPATH=DIR/src``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import os
import queue
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from machine_info import machine

from xmig import protocol as proto
from xmig.jobenv import JOB_ID, TOKEN
from xmig.jobspec import JobSpec
from xmig.procs import die_with_parent
from xmig.wire import Client, WireError, parse_address

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "control-scale.md"
SIZES = ((16, 2), (128, 16), (1024, 128))
READY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 15.0
FAKE_PID_BASE = 50_000_000  # stub workers' "PIDs": above any pid_max, so no real process
CHECKSUM = hashlib.sha256(b"stub replica checksum").hexdigest()
FINGERPRINT = hashlib.sha256(b"stub parameters").hexdigest()
LAYOUT = hashlib.sha256(b"stub ddp layout").hexdigest()[:16]
DIGEST = hashlib.sha256(b"stub state").hexdigest()
BUCKET = 6_553_600  # DDP's 25 MiB bucket, in float32
STATE_BYTES = 42_300_000  # what a replacement pulls (the demo GPT's size on CPU)
OTHER_BENCHES = re.compile(r"bench/(?!control_scale)\w+\.py")
SWITCH_INTERVAL_S = 0.0005  # a reader thread stamps an order within this of its arrival

log = logging.getLogger("control_scale")


# ---- configuration and results -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    """One simulated job: its size, the stubs' pace, and the run's bound."""

    ranks: int
    nodes: int
    step_s: float = 0.25  # one training step, every rank in lockstep (DDP)
    warmup_s: float = 1.0  # steps before the steady window
    steady_s: float = 5.0  # the steady window, then the fault
    post_steps: int = 4  # steps after the faulty one
    ops_per_step: int = 16  # all-reduces a step logs (25 MiB buckets)
    park_s: float = 0.005  # a survivor's park (halting its proxies)
    join_s: float = 0.02  # a hot spare's start to its hello
    pull_s: float = 0.05  # the state transfer
    replay_s: float = 0.02  # the survivors' replay once the replacement runs
    fail_rank: int = 1
    deadline_s: float | None = None  # None: 60 s + 0.15 s a rank
    log_level: str = "INFO"
    profile: Path | None = None  # a folder for py-spy's output (None: no profile)
    py_spy: str | None = None

    def __post_init__(self) -> None:
        if self.ranks % self.nodes or self.ranks < 2:
            raise ValueError(f"{self.ranks} ranks do not fill {self.nodes} nodes")
        if not 0 <= self.fail_rank < self.ranks:
            raise ValueError(f"rank {self.fail_rank} does not exist")

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_s / self.step_s))

    @property
    def fault_step(self) -> int:
        return self.warmup_steps + max(1, round(self.steady_s / self.step_s))

    @property
    def total_steps(self) -> int:
        return self.fault_step + max(2, self.post_steps)

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else 60.0 + 0.15 * self.ranks


@dataclasses.dataclass
class RunResult:
    """What one simulated job measured and how it ended."""

    ranks: int
    nodes: int
    status: str = "not run"
    error: str | None = None
    summary: dict[str, Any] | None = None
    decide_park_s: float | None = None
    decide_plan_s: float | None = None
    steady_s: float = 0.0
    steady_msgs: dict[str, int] = dataclasses.field(default_factory=dict)
    steady_bytes: int = 0
    cpu_steady: float | None = None  # CPU seconds per second
    cpu_recovery: float | None = None
    cpu_recovery_s: float | None = None  # CPU seconds in the recovery window
    recovery_window_s: float | None = None
    breakdown: dict[str, float] = dataclasses.field(default_factory=dict)
    coordinator_exit: int | None = None
    started_pids: list[int] = dataclasses.field(default_factory=list)
    left_running: list[int] = dataclasses.field(default_factory=list)
    stub_threads_left: int = 0
    wall_s: float = 0.0
    profiles: dict[str, Path] = dataclasses.field(default_factory=dict)

    @property
    def recoveries(self) -> int:
        return len((self.summary or {}).get("recoveries", []))

    @property
    def completed(self) -> bool:
        return (self.summary or {}).get("status") == "completed"

    @property
    def msgs_per_s(self) -> float:
        return sum(self.steady_msgs.values()) / self.steady_s if self.steady_s else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.steady_bytes / self.steady_s if self.steady_s else 0.0


class SimulationError(RuntimeError):
    """The simulated job did not end as it should (the message says how)."""


# ---- the stubs' one thread: timers and events in order -------------------------------------
class Loop:
    """Timers and events posted from other threads, run one at a time on the driver thread."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]]
        self._inbox = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the driver thread."""
        self._inbox.put((fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(time.monotonic() + delay, fn, *args)

    def at(self, due: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._timers, (due, next(self._seq), fn, args))

    def run(self, done: Callable[[], bool], deadline: float) -> None:
        """Run timers and events until ``done()``; SimulationError at ``deadline``."""
        while not done():
            now = time.monotonic()
            if now >= deadline:
                raise SimulationError("the run passed its deadline")
            if self._timers and self._timers[0][0] <= now:
                _, _, fn, args = heapq.heappop(self._timers)
                fn(*args)
                continue
            due = self._timers[0][0] if self._timers else now + 0.05
            try:
                fn, args = self._inbox.get(timeout=max(0.0, min(due, deadline, now + 0.05) - now))
            except queue.Empty:
                continue
            fn(*args)


# ---- the stub agents and workers -----------------------------------------------------------
@dataclasses.dataclass
class Worker:
    """A stub worker: what its process would do, and what its agent knows of it."""

    rank: int
    local_rank: int
    pid: int
    attempt: int
    phase: str = "starting"  # starting, training, parked, joining, done, dead, exited
    step: int | None = None  # the step it said it entered
    link: str = "none"  # its agent's view: none (no hello yet), running, done, exited
    seen_step: int | None = None  # the agent's ``Worker.step``
    verify_at: tuple[int, int] | None = None  # (generation, step) to report a checksum at
    plan: proto.Rebuild | None = None


class StubAgent:
    """One node's agent: its connection to the coordinator and its workers."""

    def __init__(self, sim: Simulation, node: int) -> None:
        self.sim = sim
        self.node = node
        self.workers: dict[int, Worker] = {}
        self.client: Client | None = None
        self.closed = False

    def connect(self) -> None:
        """Connect and say hello, as ``Agent.run`` does; the reply carries the job spec."""
        sim = self.sim
        self.client = Client(
            sim.address,
            sim.token,
            info={"role": "agent", "node": self.node, "pid": os.getpid()},
            on_push=self._on_push,
            on_close=self._on_close,
        )
        hello = proto.AgentHello(
            node=self.node, pid=os.getpid(), netns=os.stat("/proc/self/ns/net").st_ino
        )
        reply = self.client.call(hello.OP, **proto.fields_of(hello))
        self.sim.job = JobSpec.from_json(reply["job"])

    # -- from the reader thread: stamp, then hand to the driver
    def _on_push(self, frame: dict[str, Any]) -> None:
        self.sim.loop.post(self.sim.on_order, self, frame, time.time())

    def _on_close(self) -> None:
        self.sim.loop.post(self.sim.on_coordinator_closed, self)

    # -- on the driver thread
    def send(self, msg: proto.Message) -> None:
        """A message for the coordinator, as ``Agent._send`` sends it."""
        if self.client is None or self.closed:
            return
        fields = self.sim.fields(msg)
        try:
            self.client.notify(msg.OP, **fields)
        except WireError as exc:
            raise SimulationError(f"node {self.node} lost the coordinator: {exc}") from None
        self.sim.sent[msg.OP] += 1
        if self.sim.counting:  # the frame as ``Connection.send`` writes it: length, JSON
            frame = json.dumps({"op": msg.OP, **fields}, separators=(",", ":")).encode()
            self.sim.sent_bytes[msg.OP] += 4 + len(frame)

    def intake(self, worker: Worker, msg: proto.Message) -> None:
        """A worker's message, as ``Agent._on_worker_message`` takes it."""
        self.sim.check_worker_message(msg)
        if worker.link in ("none", "exited") and not isinstance(msg, proto.Hello):
            return
        if msg.FORWARD:  # a report for the coordinator: its rank from the connection
            self.send(dataclasses.replace(msg, rank=worker.rank))  # type: ignore[call-arg]
        elif isinstance(msg, proto.Hello):
            worker.link = "running"
            self.send(
                proto.WorkerJoined(
                    rank=worker.rank, pid=worker.pid, attempt=worker.attempt, t=time.time()
                )
            )
        elif isinstance(msg, (proto.Heartbeat, proto.StepStarted)):
            if msg.step is not None and msg.step != worker.seen_step:
                worker.seen_step = msg.step
                self.send(proto.Progress(rank=worker.rank, step=msg.step))
        elif isinstance(msg, proto.Done):
            worker.link = "done"
            self.send(
                proto.WorkerDone(
                    rank=worker.rank,
                    steps=msg.steps,
                    params_sha256=msg.params_sha256,
                    checksum=msg.checksum,
                    replicas=msg.replicas,
                )
            )

    def relayed(self) -> list[Worker]:
        """The workers an order for all of them reaches (``Agent._relay``)."""
        return [w for w in self.workers.values() if w.link in ("running", "done")]

    def close(self) -> None:
        self.closed = True
        if self.client is not None:
            self.client.close()


class Simulation:
    """The stubs of one job, against a coordinator at ``address``."""

    def __init__(
        self, cfg: Config, address: tuple[str, int], token: str, coordinator: psutil.Process
    ) -> None:
        self.cfg = cfg
        self.address = address
        self.token = token
        self.coordinator = coordinator
        self.loop = Loop()
        self.agents = [StubAgent(self, n) for n in range(cfg.nodes)]
        self.launcher: Client | None = None
        self.sent: collections.Counter[str] = collections.Counter()
        self.sent_bytes: collections.Counter[str] = collections.Counter()
        self.counting = False  # frame bytes are counted in the steady window only
        self._checked: set[str] = set()
        self._position_fields: tuple[proto.Position, dict[str, Any]] | None = None
        self._position: proto.Position | None = None
        self.job: JobSpec | None = None  # as the coordinator's reply to a hello has it
        self.parked_sent: set[int] = set()
        self.joined = 0  # first processes that said hello
        self.step = -1
        self.ticking = False
        self.next_tick = 0.0
        self.summary: dict[str, Any] | None = None
        self.failure: str | None = None
        self.served = False
        self.replacement_joined = False
        self.recovering: set[int] = set()  # ranks whose ``recovered`` is still to send
        self.spy: subprocess.Popen | None = None
        # measurements (wall clock)
        self.t_fault_sent: float | None = None
        self.first_round: dict[str, float] = {}  # "park@node" / "respawn@node" -> received
        self.plan_received: dict[int, float] = {}
        self.t_first_parked_sent: float | None = None
        self.t_last_parked_sent: float | None = None
        self.steady: dict[str, Any] = {}
        # (wall time, the coordinator's CPU seconds): its process CPU clock, in ns
        self.samples: list[tuple[float, float]] = []
        self._sampling = threading.Event()
        self.profiles: dict[str, Path] = {}

    # -- plumbing
    def fields(self, msg: proto.Message) -> dict[str, Any]:
        """``fields_of(msg)``; a parked position shared by every survivor is made plain once."""
        if isinstance(msg, proto.Parked):
            cached = self._position_fields
            if cached is None or cached[0] is not msg.position:
                cached = (msg.position, dataclasses.asdict(msg.position))
                self._position_fields = cached
            return {
                "generation": msg.generation,
                "position": cached[1],
                "rank": msg.rank,
                "t": msg.t,
            }
        return proto.fields_of(msg)

    def check_worker_message(self, msg: proto.Message) -> None:
        """The first message of each kind goes through the catalogue both ways."""
        if msg.OP in self._checked:
            return
        frame = json.loads(json.dumps(proto.encode(msg)))
        if proto.decode(frame, proto.Party.AGENT, proto.Party.WORKER) != msg:
            raise SimulationError(f"{msg.OP!r} does not survive the catalogue")
        self._checked.add(msg.OP)

    def worker(self, rank: int) -> tuple[StubAgent, Worker]:
        agent = self.agents[rank // self.cfg.per_node]
        return agent, agent.workers[rank]

    def all_workers(self) -> list[tuple[StubAgent, Worker]]:
        return [(a, w) for a in self.agents for w in a.workers.values()]

    # -- the run
    def run(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.deadline
        sampler = threading.Thread(target=self._sample, name="cpu-sampler", daemon=True)
        sampler.start()
        try:
            self.launcher = Client(
                self.address, self.token, info={"role": "launcher"}, on_push=self._on_result
            )
            self.launcher.call("wait_result")
            self.loop.post(self._connect, 0)
            self.loop.run(lambda: self.summary is not None or self.failure is not None, deadline)
            if self.failure is not None:
                raise SimulationError(self.failure)
        finally:
            self._sampling.set()
            self._stop_spy()
            for agent in self.agents:
                agent.close()
            if self.launcher is not None:
                self.launcher.close()
            sampler.join(5)

    def _sample(self) -> None:
        """The coordinator's CPU time every 5 ms, from its process CPU clock (every thread's,
        in ns: psutil's counts 10 ms ticks, too coarse for a recovery of 0.2 s)."""
        clock = process_cpu_clock(self.coordinator.pid)
        while not self._sampling.wait(0.005):
            try:
                self.samples.append((time.time(), time.clock_gettime(clock)))
            except OSError:
                return

    def _on_result(self, frame: dict[str, Any]) -> None:
        msg = proto.decode(frame, proto.Party.LAUNCHER, proto.Party.COORDINATOR)
        if isinstance(msg, proto.Result):
            self.loop.post(self._result, msg.summary)

    def _result(self, summary: dict[str, Any]) -> None:
        self.summary = summary

    def on_coordinator_closed(self, agent: StubAgent) -> None:
        if not agent.closed and self.summary is None:
            self.failure = f"the coordinator closed node {agent.node}'s connection"

    # -- start: what ``Agent.run`` does after its hello, and the workers' start
    def _connect(self, node: int) -> None:
        """Node ``node``'s agent connects and starts; the next one after it (the agents'
        timers run meanwhile, as each real agent's own do from its hello on)."""
        agent = self.agents[node]
        agent.connect()
        self._start_agent(agent, node / self.cfg.nodes)
        if node + 1 < self.cfg.nodes:
            self.loop.post(self._connect, node + 1)

    def _start_agent(self, agent: StubAgent, phase: float) -> None:
        cfg = self.cfg
        agent.send(proto.CriuStatus(node=agent.node, usable=False, detail="stub agent", gpus=[]))
        for local in range(cfg.per_node):
            rank = agent.node * cfg.per_node + local
            worker = Worker(rank, local, FAKE_PID_BASE + rank * 100, attempt=0)
            agent.workers[rank] = worker
            agent.send(
                proto.WorkerStarted(
                    rank=rank,
                    node=agent.node,
                    pid=worker.pid,
                    attempt=0,
                    t=time.time(),
                    from_spare=False,
                )
            )
            self.loop.after(cfg.join_s + 0.1 * phase, self._hello, agent, worker)
        self.loop.after(0.2 + 0.1 * phase, agent.send, proto.Spares(node=agent.node, ready=1))
        interval = self._interval()
        self.loop.after(interval * (1 + phase), self._alive, agent)
        self.loop.after(interval * (0.5 + phase), self._heartbeats, agent)

    def _interval(self) -> float:
        assert self.job is not None
        return self.job.heartbeat_interval

    def _hello(self, agent: StubAgent, worker: Worker) -> None:
        worker.phase = "training" if worker.attempt == 0 else "joining"
        agent.intake(worker, proto.Hello(rank=worker.rank, pid=worker.pid, attempt=worker.attempt))
        if worker.attempt > 0:
            self.replacement_joined = True
            self._maybe_serve()
        else:
            self.joined += 1
            if self.joined == self.cfg.ranks:  # every rank in its step loop: steps begin
                self.ticking = True
                self.next_tick = time.monotonic() + 0.1
                self.loop.at(self.next_tick, self._tick)

    def _alive(self, agent: StubAgent) -> None:
        """``Agent._keep_alive``: every heartbeat interval."""
        if agent.closed:
            return
        agent.send(proto.AgentAlive())
        self.loop.after(self._interval(), self._alive, agent)

    def _heartbeats(self, agent: StubAgent) -> None:
        """Each live worker's heartbeat to its agent (``AgentLink._heartbeat``)."""
        if agent.closed:
            return
        now = time.time()
        for worker in list(agent.workers.values()):
            if worker.phase not in ("dead", "exited", "starting"):
                agent.intake(worker, proto.Heartbeat(step=worker.step, t=now))
        self.loop.after(self._interval(), self._heartbeats, agent)

    # -- steps
    def _tick(self) -> None:
        cfg = self.cfg
        if not self.ticking:
            return
        self.step += 1
        step = self.step
        if step == cfg.warmup_steps:
            self._steady_mark("start")
            self._profile_start("steady")
        if step == cfg.warmup_steps + max(1, round(2.0 / cfg.step_s)):
            self._stop_spy()
        if step == cfg.fault_step - 2:
            self._profile_start("recovery")
        if step == cfg.fault_step:
            self._steady_mark("end")
        if step == cfg.total_steps:
            self._profile_start("end")
        for agent, worker in self.all_workers():
            if worker.phase == "training":
                self._boundary(agent, worker, step)
        if step >= cfg.total_steps:
            self.ticking = False
            return
        if step == cfg.fault_step:
            self.ticking = False  # every survivor will wait in the step's collectives
            self.loop.after(cfg.step_s / 2, self._fault)
            return
        self.next_tick += cfg.step_s
        self.loop.at(self.next_tick, self._tick)

    def _boundary(self, agent: StubAgent, worker: Worker, step: int) -> None:
        """``StepLoop.run`` at a boundary: the checksum when due, then the step (or the end)."""
        if worker.verify_at is not None and worker.verify_at[1] == step:
            agent.intake(
                worker,
                proto.Verify(
                    generation=worker.verify_at[0],
                    step=step,
                    checksum=CHECKSUM,
                    replicas=None,
                    t=time.time(),
                ),
            )
            worker.verify_at = None
        if step >= self.cfg.total_steps:
            worker.phase = "done"
            agent.intake(
                worker,
                proto.Done(
                    steps=step,
                    params_sha256=FINGERPRINT if worker.rank == 0 else None,
                    checksum=CHECKSUM,
                    replicas=None,
                ),
            )
            return
        worker.step = step
        agent.intake(worker, proto.StepStarted(step=step, t=time.time()))

    def _steady_mark(self, which: str) -> None:
        try:
            cpu = self.coordinator.cpu_times()
        except psutil.Error as exc:
            raise SimulationError(f"the coordinator is gone: {exc}") from None
        self.counting = which == "start"
        self.steady[which] = {
            "t": time.time(),
            "cpu": cpu.user + cpu.system,
            "sent": collections.Counter(self.sent),
        }

    # -- the fault and the recovery
    def _fault(self) -> None:
        """The failed rank's process is SIGKILLed; its agent reports it (``Agent._reap``)."""
        agent, worker = self.worker(self.cfg.fail_rank)
        worker.phase, worker.link = "dead", "exited"
        now = time.time()
        record = proto.FaultRecord(
            rank=worker.rank,
            node=agent.node,
            pid=worker.pid,
            attempt=worker.attempt,
            kind="signal",
            detail="SIGKILL",
            step=worker.seen_step,
            t_fault=now,
            t_detected=now,
            fault_time_source="detection",
            detected_after_s=0.0,
        )
        self.t_fault_sent = time.time()
        agent.send(proto.Fault(record=record))

    def on_order(self, agent: StubAgent, frame: dict[str, Any], received: float) -> None:
        """A coordinator's push to ``agent``, decoded as ``Agent._on_coord_push`` does."""
        try:
            order = proto.decode(frame, proto.Party.AGENT, proto.Party.COORDINATOR)
        except proto.ProtocolError as exc:
            self.failure = f"node {agent.node} got a message it cannot decode: {exc}"
            return
        handler = ORDERS.get(type(order))
        if handler is None:
            self.failure = f"node {agent.node} got an order the stubs do not play: {order.OP}"
            return
        handler(self, agent, order, received)

    def _park(self, agent: StubAgent, order: proto.Park, received: float) -> None:
        if order.generation == 1:
            self.first_round[f"park@{agent.node}"] = received
        for worker in agent.relayed():
            if worker.rank in order.replaced or worker.phase != "training":
                continue
            worker.phase = "parked"
            self.recovering.add(worker.rank)
            self.loop.after(self.cfg.park_s, self._parked, agent, worker, order.generation)

    def _parked(self, agent: StubAgent, worker: Worker, generation: int) -> None:
        """A survivor parked in the step the fault hit, half its ops done (``position()``)."""
        agent.intake(
            worker, proto.Parked(generation=generation, position=self.position(), t=time.time())
        )
        self.parked_sent.add(worker.rank)
        if len(self.parked_sent) == 1:
            self.t_first_parked_sent = time.time()
        if len(self.parked_sent) == self.cfg.ranks - 1:
            self.t_last_parked_sent = time.time()

    def position(self) -> proto.Position:
        """Where every survivor stands (one object, shared): in the faulty step, half its
        all-reduces logged, the previous step's log kept, DDP's layout rank 0's."""
        if self._position is None:
            step = self.cfg.fault_step
            ops = signatures(self.cfg.ops_per_step)
            self._position = proto.Position(
                step=step,
                state_step=step,
                log_from=max(0, step - 1),
                keep_log=True,
                signatures={str(step - 1): ops, str(step): ops[: len(ops) // 2]},
                pending=1,
                optimizer_waiting=False,
                ddp_layout=LAYOUT,
                ddp_layout_source="root",
                group_signatures={},
                replicas=None,
            )
        return self._position

    def _respawn(self, agent: StubAgent, order: proto.Respawn, received: float) -> None:
        """``Agent._respawn``: the rank from a hot spare (the spares' count first)."""
        if order.generation == 1:
            self.first_round[f"respawn@{agent.node}"] = received
        old = agent.workers[order.rank]
        old.phase, old.link = "dead", "exited"
        worker = Worker(
            order.rank,
            order.local_rank,
            FAKE_PID_BASE + order.rank * 100 + order.attempt,
            attempt=order.attempt,
        )
        agent.workers[order.rank] = worker
        self.recovering.add(order.rank)
        agent.send(proto.Spares(node=agent.node, ready=0))
        agent.send(
            proto.WorkerStarted(
                rank=order.rank,
                node=agent.node,
                pid=worker.pid,
                attempt=order.attempt,
                t=time.time(),
                from_spare=True,
            )
        )
        self.loop.after(self.cfg.join_s, self._hello, agent, worker)
        self.loop.after(2.0, agent.send, proto.Spares(node=agent.node, ready=1))  # a new spare

    def _rebuild(self, agent: StubAgent, order: proto.Rebuild, received: float) -> None:
        if order.generation == 1:
            self.plan_received[agent.node] = received
        for worker in agent.relayed():
            if worker.phase == "parked":
                worker.plan = order
        self._maybe_serve()

    def _maybe_serve(self) -> None:
        """The serving survivor sends the state once it has the plan and the replacement
        runs (``pull.serve``), then announces its digest."""
        if self.served or not self.replacement_joined:
            return
        for _, worker in self.all_workers():
            plan = worker.plan
            if plan is not None and worker.phase == "parked" and plan.served_by(worker.rank):
                self.served = True
                self.loop.after(self.cfg.pull_s, self._state_sent, worker, plan)
                return

    def _state_sent(self, worker: Worker, plan: proto.Rebuild) -> None:
        agent, _ = self.worker(worker.rank)
        for target in plan.served_by(worker.rank):
            agent.intake(
                worker,
                proto.StateSent(
                    generation=plan.generation, target=target, digest=DIGEST, t=time.time()
                ),
            )

    def _announced(self, agent: StubAgent, order: proto.StateAnnounced, received: float) -> None:
        """The digest reaches the replacement, which loads the state and runs; the
        survivors' replay then completes."""
        cfg = self.cfg
        for worker in agent.relayed():
            if worker.rank == order.rank and worker.phase == "joining":
                if order.digest != DIGEST:
                    self.failure = f"rank {worker.rank} got the wrong digest"
                    return
                self._recovered(agent, worker, "replacement", order.generation)
        if agent.node != 0:
            return  # the survivors' part, once (every agent gets the announcement)
        for survivor_agent, worker in self.all_workers():
            if worker.phase == "parked" and worker.plan is not None:
                self.loop.after(
                    cfg.replay_s,
                    self._recovered,
                    survivor_agent,
                    worker,
                    "survivor",
                    order.generation,
                )

    def _recovered(self, agent: StubAgent, worker: Worker, role: str, generation: int) -> None:
        cfg = self.cfg
        step = cfg.fault_step
        pull = None
        if role == "replacement":
            pull = {
                "role": "receiver",
                "bytes": STATE_BYTES,
                "seconds": cfg.pull_s,
                "setup_seconds": 0.0,
            }
            phases = {"pull": cfg.pull_s, "join": 0.001, "waited": cfg.pull_s}
            msg = proto.Recovered(
                generation=generation,
                role=role,
                phases=phases,
                pull=pull,
                t_resumed=time.time(),
                t=time.time(),
            )
            check_after = step
        else:
            plan = worker.plan
            assert plan is not None
            if plan.served_by(worker.rank):
                pull = {
                    "role": "source",
                    "bytes": STATE_BYTES,
                    "seconds": cfg.pull_s,
                    "setup_seconds": 0.0,
                }
            phases = {
                "park": cfg.park_s,
                "rebuild": 0.01,
                "pull": cfg.pull_s if pull else 0.0,
                "replay": cfg.replay_s,
            }
            replay = {"compared": cfg.ops_per_step // 2, "unverifiable": 0, "differ": []}
            msg = proto.Recovered(
                generation=generation,
                role=role,
                phases=phases,
                pull=pull,
                t_resumed=time.time(),
                replay_check=replay,
                groups={"rebuilt": ["world"], "kept": []},
                t=time.time(),
            )
            check_after = plan.check_after if plan.check_after is not None else plan.step
            worker.plan = None
        worker.phase = "training"
        worker.verify_at = (generation, min(check_after + 1, cfg.total_steps))
        agent.intake(worker, msg)
        if role == "replacement":  # it starts at the survivors' step
            worker.step = step
            agent.intake(worker, proto.StepStarted(step=step, t=time.time()))
        self.recovering.discard(worker.rank)
        if not self.recovering:
            self.loop.after(0.3, self._stop_spy)
            self.ticking = True
            self.next_tick = time.monotonic() + cfg.step_s
            self.loop.at(self.next_tick, self._tick)

    # -- the end
    def _release(self, agent: StubAgent, order: proto.Release, received: float) -> None:
        """Every rank finished: each exits with 0, and its agent says so."""
        for worker in agent.relayed():
            if worker.phase == "done":
                worker.phase, worker.link = "exited", "exited"
                agent.send(proto.WorkerExited(rank=worker.rank, pid=worker.pid, t=time.time()))

    def _stop_workers(self, agent: StubAgent, order: proto.StopWorkers, received: float) -> None:
        for worker in agent.workers.values():
            worker.phase, worker.link = "exited", "exited"
        agent.send(proto.Stopped(node=agent.node))

    def _shutdown(self, agent: StubAgent, order: proto.Shutdown, received: float) -> None:
        agent.close()

    def _ignore(self, agent: StubAgent, order: proto.Message, received: float) -> None:
        log.info("node %d: %s", agent.node, order.OP)

    # -- py-spy around the windows that matter
    def _profile_start(self, name: str) -> None:
        if self.cfg.profile is None or self.cfg.py_spy is None:
            return
        self._stop_spy()
        out = self.cfg.profile / f"{name}.txt"
        self.spy = subprocess.Popen(
            [
                self.cfg.py_spy,
                "record",
                "--pid",
                str(self.coordinator.pid),
                "--rate",
                "1000",
                "--format",
                "raw",
                "--output",
                str(out),
                "--nonblocking",
                "--gil",
                "--threads",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        self.profiles[name] = out

    def _stop_spy(self) -> None:
        spy, self.spy = self.spy, None
        if spy is None:
            return
        with contextlib.suppress(ProcessLookupError):
            spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()


ORDERS: dict[type, Callable[[Simulation, StubAgent, Any, float], None]] = {
    proto.Park: Simulation._park,
    proto.Respawn: Simulation._respawn,
    proto.Rebuild: Simulation._rebuild,
    proto.StateAnnounced: Simulation._announced,
    proto.Release: Simulation._release,
    proto.StopWorkers: Simulation._stop_workers,
    proto.Shutdown: Simulation._shutdown,
    proto.Abort: Simulation._ignore,
}


def signatures(ops: int) -> list[str]:
    """A DDP step's all-reduces as the proxy logs them: 25 MiB buckets, the last smaller."""
    sizes = [BUCKET] * (ops - 1) + [BUCKET // 6]
    return [f"allreduce|({n},):torch.float32|reduceOp=RedOpType.SUM" for n in sizes]


# ---- the coordinator process ---------------------------------------------------------------
def start_coordinator(
    spec: JobSpec, token: str, jobs_dir: Path, stderr: Path
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """``python -m xmig.coord`` as the launcher starts it; its ready line."""
    env = dict(os.environ)
    env.update(
        {TOKEN: token, JOB_ID: spec.job_id, "XMIG_JOBS_DIR": str(jobs_dir), "PYTHONUNBUFFERED": "1"}
    )
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "xmig.coord"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(spec.to_json()) + "\n").encode())
    proc.stdin.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SimulationError(f"the coordinator did not start within {READY_TIMEOUT_S} s")
        if select.select([proc.stdout], [], [], left)[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise SimulationError(f"the coordinator exited at start (code {proc.wait()})")
            buf += chunk
    ready = json.loads(buf.split(b"\n", 1)[0])
    if "error" in ready:
        raise SimulationError(f"the coordinator refused to start: {ready['error']}")
    return proc, ready


def end_process(pid: int, proc: subprocess.Popen | None = None, grace: float = 2.0) -> None:
    """End ``pid`` (SIGTERM, then SIGKILL) and reap it when it is our child."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and alive(pid, proc):
        time.sleep(0.02)
    if alive(pid, proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def alive(pid: int, proc: subprocess.Popen | None = None) -> bool:
    if proc is not None and proc.pid == pid:
        return proc.poll() is None
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- one run -------------------------------------------------------------------------------
def run_simulation(cfg: Config, keep: Path | None = None) -> RunResult:
    """One job of ``cfg.ranks`` ranks on ``cfg.nodes`` nodes through a fault, to its result.
    Every process it starts has ended when it returns. ``keep``: where to copy the
    coordinator's event log and stderr."""
    result = RunResult(cfg.ranks, cfg.nodes)
    started = time.monotonic()
    threads_before = threading.active_count()
    work = Path(tempfile.mkdtemp(prefix="xmig-scale-"))
    token = secrets.token_hex(32)
    spec = JobSpec(
        job_id=f"scale{cfg.ranks}-{secrets.token_hex(3)}",
        script="stub_train.py",
        args=(),
        cwd=str(work),
        nnodes=cfg.nodes,
        nproc_per_node=cfg.per_node,
        log_level=cfg.log_level,
    )
    proc: subprocess.Popen | None = None
    coord_pid: int | None = None
    sim: Simulation | None = None
    previous_switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        proc, ready = start_coordinator(spec, token, work, work / "coordinator.err")
        coord_pid = int(ready.get("pid", proc.pid))
        result.started_pids = sorted({proc.pid, coord_pid})
        sim = Simulation(cfg, parse_address(ready["address"]), token, psutil.Process(coord_pid))
        sim.run()
        result.summary = sim.summary
        result.status = "completed" if result.completed else "failed"
    except (SimulationError, WireError, OSError, TimeoutError) as exc:
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}"
        log.error("%d ranks: %s", cfg.ranks, result.error)
    finally:
        sys.setswitchinterval(previous_switch)
        if proc is not None:
            try:
                result.coordinator_exit = proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("the coordinator (pid %d) did not exit by itself", proc.pid)
            for pid in result.started_pids:
                if alive(pid, proc):
                    end_process(pid, proc)
            result.left_running = [p for p in result.started_pids if alive(p, proc)]
        if sim is not None and sim.spy is not None:
            end_process(sim.spy.pid, sim.spy)
        until = time.monotonic() + 2.0  # the stubs' reader threads see their sockets close
        while threading.active_count() > threads_before and time.monotonic() < until:
            time.sleep(0.01)
        result.stub_threads_left = max(0, threading.active_count() - threads_before)
        result.wall_s = time.monotonic() - started
        if sim is not None:
            _measure(sim, result, work / spec.job_id / "events.jsonl")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for name in (f"{spec.job_id}/events.jsonl", "coordinator.err"):
                with contextlib.suppress(OSError):
                    shutil.copy(work / name, keep / Path(name).name)
        shutil.rmtree(work, ignore_errors=True)
    return result


def process_cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (Linux: ``clock_getcpuclockid``)."""
    return ((~pid) << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _cpu_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """The coordinator's CPU seconds at wall time ``t``, between two samples."""
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


def _measure(sim: Simulation, result: RunResult, events_path: Path) -> None:
    """The run's numbers, from the stubs' stamps and the coordinator's event log."""
    result.profiles = dict(sim.profiles)
    start, end = sim.steady.get("start"), sim.steady.get("end")
    if start and end:
        result.steady_s = end["t"] - start["t"]
        result.steady_msgs = dict(end["sent"] - start["sent"])
        result.steady_bytes = sum(sim.sent_bytes.values())
        result.cpu_steady = (end["cpu"] - start["cpu"]) / result.steady_s
    t_fault = sim.t_fault_sent
    if t_fault is not None and sim.first_round:
        result.decide_park_s = max(sim.first_round.values()) - t_fault
    if sim.t_last_parked_sent is not None and len(sim.plan_received) == sim.cfg.nodes:
        result.decide_plan_s = max(sim.plan_received.values()) - sim.t_last_parked_sent
    try:
        events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    except OSError:
        events = []

    def first(pred: Callable[[dict[str, Any]], bool]) -> float | None:
        return next((e["t"] for e in events if pred(e)), None)

    def phase(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e["event"] == "recovery" and e.get("phase") == name

    noted = first(lambda e: e["event"] == "fault")
    parking = first(phase("parking"))
    restoring = first(phase("restoring"))
    done = first(phase("done"))
    parked = [e["t"] for e in events if e["event"] == "recovery" and e.get("what") == "parked"]
    last_sent = sim.t_last_parked_sent
    marks = {
        "fault intake (sent → noted)": (t_fault, noted),
        "settle + decide (noted → park orders out)": (noted, parking),
        "park delivery (orders out → last received)": (
            parking,
            max(sim.first_round.values()) if sim.first_round else None,
        ),
        "parked burst (first → last sent)": (sim.t_first_parked_sent, last_sent),
        # the next-to-last ``parked`` noted: the events before the last one are done
        "parked backlog (last sent → next-to-last noted)": (
            last_sent,
            max(last_sent, parked[-2]) if last_sent is not None and len(parked) > 1 else None,
        ),
        "last parked + plan (→ plan out)": (
            max(last_sent, parked[-2]) if last_sent is not None and len(parked) > 1 else None,
            restoring,
        ),
        "plan delivery (plan out → last received)": (
            restoring,
            max(sim.plan_received.values()) if sim.plan_received else None,
        ),
        "recovery (fault sent → done)": (t_fault, done),
    }
    result.breakdown = {k: b - a for k, (a, b) in marks.items() if a is not None and b is not None}
    if t_fault is not None and done is not None:
        before, after = _cpu_at(sim.samples, t_fault), _cpu_at(sim.samples, done)
        if before is not None and after is not None and done > t_fault:
            result.recovery_window_s = done - t_fault
            result.cpu_recovery_s = after - before
            result.cpu_recovery = result.cpu_recovery_s / result.recovery_window_s


# ---- profiles ------------------------------------------------------------------------------
def _thread_of(frames: list[str]) -> str:
    text = ";".join(frames)
    if "Coordinator.run " in text:
        return "decision thread"
    if "Server._serve " in text:
        return "connection threads"
    return "other"


def summarize_profile(path: Path, top: int = 12) -> list[str]:
    """py-spy's raw stacks: samples by thread, and the functions most often on top of the
    decision thread's and the connection threads' stacks (self) and within them (total)."""
    by_thread: collections.Counter[str] = collections.Counter()
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")[1:]]
        thread = _thread_of(frames)
        n = int(count)
        by_thread[thread] += n
        if frames:
            own[thread][frames[-1]] += n
        for frame in set(frames):
            total[thread][frame] += n
    lines = [
        "samples of the thread holding the GIL (1 ms each): "
        + ", ".join(f"{t} {n}" for t, n in by_thread.most_common())
    ]
    for thread in ("decision thread", "connection threads"):
        n = by_thread[thread]
        if not n:
            continue
        lines.append(
            f"- {thread}, self: "
            + "; ".join(f"`{f}` {c / n:.0%}" for f, c in own[thread].most_common(top))
        )
        inner = [
            (f, c)
            for f, c in total[thread].most_common(40)
            if "xmig/" in f or "json/" in f or "queue" in f
        ][:top]
        lines.append(f"- {thread}, total: " + "; ".join(f"`{f}` {c / n:.0%}" for f, c in inner))
    return lines


# ---- the report ----------------------------------------------------------------------------
def others_running() -> list[str]:
    """Other benchmarks on this machine (their load skews every number here)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != os.getpid() and OTHER_BENCHES.search(cmd):
            found.append(f"{p.info['pid']}: {cmd[:80]}")
    return found


def code_version() -> str:
    """Which xmig ran (the stubs and the coordinator import the same one): this checkout's
    commit, and whether its src/ had changes not committed; or the folder it came from."""
    import xmig

    where = Path(xmig.__file__).resolve().parent.parent
    if where != REPO / "src":
        return f"xmig from `{where}`"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = git("status", "--porcelain", "--", "src").strip()
    return f"{head} (src/ with uncommitted changes)" if changed else head


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    med = statistics.median(values) * 1000
    return f"**{med:.1f}** ({min(values) * 1000:.1f}–{max(values) * 1000:.1f})"


def _med(values: list[float], fmt: str) -> str:
    return format(statistics.median(values), fmt) if values else "n/a"


def report(
    results: list[RunResult],
    command: str,
    date: str,
    wall_s: float,
    profile: list[str],
    busy: list[str],
) -> list[str]:
    """The results file, as Markdown lines."""
    sizes = sorted({(r.ranks, r.nodes) for r in results})
    lines = [
        "# Control plane at scale: the coordinator against simulated agents",
        "",
        f"Measured {date} with `{command}` ({wall_s:.0f} s in all).",
        "",
        f"Machine: {machine()}. Code: {code_version()}.",
        "",
        "Other benchmarks running meanwhile: " + ("; ".join(busy) if busy else "none") + ".",
        "",
        "The real coordinator process (`python -m xmig.coord`, started as `xmig run` starts "
        "it) against stub agents and workers in one process (`bench/control_scale.py`: one "
        "`wire.Client` per agent, one driver thread for all of them and their workers), on "
        "the same 2 cores. Steps of 0.25 s in lockstep, the job's intervals (heartbeats and "
        "`agent_alive` every 0.5 s), 16 all-reduces logged a step; rank 1 SIGKILLed mid-step "
        "after a 5 s steady window, respawned from a hot spare, replayed; then 4 more steps "
        "and the end. Decision times are from the stubs' stamps: to the park orders, from "
        "just before the `fault` is sent to the last of the first orders (`park` to every "
        "agent, `respawn`) received; to the plan, from the last `parked` sent (the survivors "
        "park in one burst, 5 ms after their agent's park) to the last `rebuild` received. "
        "Median over the repeats, range in brackets.",
        "",
        "| ranks | nodes | runs ok | to park orders (ms) | to plan orders (ms) | steady msgs/s "
        "| steady bytes/s | coordinator CPU s/s steady | CPU s/s in recovery (window s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ranks, nodes in sizes:
        runs = [r for r in results if (r.ranks, r.nodes) == (ranks, nodes)]
        ok = [r for r in runs if r.completed and r.recoveries == 1]
        park = [r.decide_park_s for r in ok if r.decide_park_s is not None]
        plan = [r.decide_plan_s for r in ok if r.decide_plan_s is not None]
        msgs = [r.msgs_per_s for r in ok if r.steady_s]
        rate = [r.bytes_per_s for r in ok if r.steady_s]
        steady = [r.cpu_steady for r in ok if r.cpu_steady is not None]
        rec = [r.cpu_recovery for r in ok if r.cpu_recovery is not None]
        window = [r.recovery_window_s for r in ok if r.recovery_window_s is not None]
        lines.append(
            f"| {ranks} | {nodes} | {len(ok)}/{len(runs)} | {_ms(park)} | {_ms(plan)} "
            f"| {_med(msgs, '.0f')} | {_med(rate, ',.0f')} | {_med(steady, '.3f')} "
            f"| {_med(rec, '.2f')} ({_med(window, '.2f')}) |"
        )
    by_op = []
    for ranks, nodes in sizes:
        ok = [r for r in results if (r.ranks, r.nodes) == (ranks, nodes) and r.steady_s]
        ops = sorted({o for r in ok for o in r.steady_msgs})
        rates = [
            f"`{op}` {_med([r.steady_msgs.get(op, 0) / r.steady_s for r in ok], '.0f')}"
            for op in ops
        ]
        by_op.append(f"{ranks} ranks: " + ", ".join(rates))
    lines += [
        "",
        "Steady traffic into the coordinator by message (median msgs/s): " + "; ".join(by_op) + ".",
        "",
        "Where the decision time goes (median ms, from the coordinator's event log against "
        "the stubs' stamps):",
        "",
        "| ranks | " + " | ".join(BREAKDOWN) + " |",
        "|---|" + "---|" * len(BREAKDOWN),
    ]
    for ranks, _nodes in sizes:
        ok = [r for r in results if r.ranks == ranks and r.completed]
        cells = [
            _med([r.breakdown[k] * 1000 for r in ok if k in r.breakdown], ".1f") for k in BREAKDOWN
        ]
        lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
    failed = [r for r in results if not (r.completed and r.recoveries == 1)]
    if failed:
        lines += [
            "",
            "Runs that did not complete with one recovery: "
            + "; ".join(
                f"{r.ranks} ranks: {r.status} ({r.error or (r.summary or {}).get('message')})"
                for r in failed
            )
            + ".",
        ]
    left = [r for r in results if r.left_running]
    lines += [
        "",
        "Every process a run started had ended when it returned: "
        + ("yes." if not left else f"no ({[r.left_running for r in left]})."),
    ]
    if profile:
        lines += ["", "## Profile", "", *profile]
    return lines


BREAKDOWN = [
    "fault intake (sent → noted)",
    "settle + decide (noted → park orders out)",
    "park delivery (orders out → last received)",
    "parked burst (first → last sent)",
    "parked backlog (last sent → next-to-last noted)",
    "last parked + plan (→ plan out)",
    "plan delivery (plan out → last received)",
    "recovery (fault sent → done)",
]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        ranks, _, nodes = part.partition("x")
        sizes.append((int(ranks), int(nodes)))
    return sizes


def find_py_spy() -> str | None:
    found = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if found is None and Path("/tmp/pyspy-venv/bin/py-spy").exists():
        found = "/tmp/pyspy-venv/bin/py-spy"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default=",".join(f"{r}x{n}" for r, n in SIZES),
        help="RANKSxNODES,... (default: %(default)s)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more run of the largest size with py-spy attached",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="a folder for each run's event log and coordinator stderr",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.monotonic()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    busy = others_running()
    if busy:
        log.warning("other benchmarks are running, the numbers will show it: %s", busy)
    results: list[RunResult] = []
    sizes = parse_sizes(args.sizes)
    for ranks, nodes in sizes:
        for i in range(args.repeat):
            keep = args.keep / f"{ranks}x{nodes}-{i}" if args.keep else None
            result = run_simulation(Config(ranks, nodes), keep)
            results.append(result)
            print(
                f"{ranks} ranks on {nodes} nodes, run {i + 1}: {result.status}, "
                f"park {fmt_ms(result.decide_park_s)}, plan {fmt_ms(result.decide_plan_s)}, "
                f"{result.msgs_per_s:.0f} msgs/s, {result.bytes_per_s:,.0f} B/s, CPU "
                f"{result.cpu_steady or 0:.3f} / {result.cpu_recovery or 0:.2f} s/s, "
                f"{result.wall_s:.1f} s",
                flush=True,
            )
    profile: list[str] = []
    if args.profile:
        spy = find_py_spy()
        ranks, nodes = max(sizes)
        if spy is None:
            log.error("no py-spy (set PY_SPY): no profile")
        else:
            folder = Path(tempfile.mkdtemp(prefix="xmig-scale-profile-"))
            result = run_simulation(Config(ranks, nodes, profile=folder, py_spy=spy))
            profile = [
                f"py-spy ({spy}) attached to the coordinator in one more run of {ranks} "
                f"ranks on {nodes} nodes ({result.status}; park "
                f"{fmt_ms(result.decide_park_s)}, plan {fmt_ms(result.decide_plan_s)}), "
                "--rate 1000 --nonblocking --gil (the thread holding the GIL), raw stacks "
                "aggregated by function (the profiled run is slower: py-spy takes CPU too):",
                "",
            ]
            for name, path in result.profiles.items():
                if path.exists():
                    window = {
                        "steady": "2 s of the steady window",
                        "recovery": "0.6 s before the fault to 0.3 s after the recovery",
                        "end": "from the last boundary (every rank's `done`) to the result",
                    }[name]
                    profile += [
                        f"**{name}** ({window}, `{path}`):",
                        "",
                        *summarize_profile(path),
                        "",
                    ]
    wall = time.monotonic() - started
    command = "python bench/control_scale.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    lines = report(results, command.strip(), date, wall, profile, busy)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} ({wall:.0f} s)")
    return 0 if all(r.completed and r.recoveries == 1 for r in results) else 1


def fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
