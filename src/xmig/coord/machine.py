"""The job as the coordinator decides it: a state machine over the catalogue's messages.

``Job.on(event, now)`` applies one event and returns the orders it calls for; it holds no
socket, thread or clock (``now`` is the wall-clock time of the event). The ``Coordinator``
feeds it events in order on one thread and carries the orders out.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xmig.bitwise import replay_divergence
from xmig.coord import decide, summary
from xmig.coord.checkpoint import Checkpoint, Sealed
from xmig.coord.migration import (
    Migration,
    MigrationPhase,
    images_dir,
    shared_images,
    stream_forced,
)
from xmig.coord.orders import (
    AgentLost,
    DropRanks,
    Finish,
    GiveUp,
    Note,
    Order,
    Refused,
    Renumber,
    Reply,
    Retry,
    Saved,
    Say,
    Settled,
    StartRanks,
    Tick,
    ToAll,
    ToLaunchers,
    ToNode,
)
from xmig.coord.recovery import Recovery
from xmig.coord.resize import (
    OnNoSpare,
    Refusal,
    ResizeCause,
    ResizePlan,
    free_slots,
    plan_grow,
    plan_planned,
    plan_shrink,
)
from xmig.coord.resizing import ResizePhase, Resizing
from xmig.faults.spec import FaultSpec, FaultSpecError, parse_fault
from xmig.jobspec import HostLaunch, JobSpec, JobSpecError
from xmig.protocol import (
    Abort,
    AgentHello,
    CannotRecover,
    CheckpointWritten,
    CriuStatus,
    Dumped,
    EndRank,
    Fault,
    FaultRecord,
    InjectFault,
    InjectRequest,
    MigrateRequest,
    NodeDying,
    NotBitIdentical,
    Park,
    Parked,
    Paused,
    PauseRefused,
    Prepared,
    Progress,
    Recovered,
    RecoveryFailed,
    Rejoined,
    Release,
    ReplayMismatched,
    Respawn,
    Restored,
    Resume,
    Resumed,
    ScaleRequest,
    Spares,
    StartNode,
    StateSent,
    StatusRequest,
    StopJob,
    Stopped,
    StopWorkers,
    StoreRestarted,
    UnreachableFaults,
    Verify,
    WorkerDone,
    WorkerExited,
    WorkerJoined,
    WorkerStarted,
)

# faults detected close together are weighed together: the earliest death is the cause, the
# rest (peers failing because it died) its consequences. A death closes the weighing once no
# other death has come for SETTLE_QUIET_S (processes that die together are seen within a
# millisecond or two: agents watch pidfds); communication errors alone wait up to
# SETTLE_WINDOW_S for the death that explains them. A death that comes later still, while the
# survivors park, widens the recovery (``Job._widen``).
SETTLE_WINDOW_S = 0.1
SETTLE_QUIET_S = 0.01
STOP_SLACK_S = 10.0  # beyond the stop grace, how long agents may take to confirm a stop


class JobState(enum.Enum):
    STARTING = "starting"  # agents connect
    REJOINING = "rejoining"  # a restarted coordinator: its predecessor's agents reconnect
    RUNNING = "running"
    SETTLING = "settling"  # a fault: its consequences arrive before the cause is chosen
    RECOVERING = "recovering"
    MIGRATING = "migrating"
    RESIZING = "resizing"  # the world changes size at a step boundary (no fault)
    # a fault that cannot be recovered: the ranks that hold state save it before the stop
    CHECKPOINTING = "checkpointing"
    STOPPING = "stopping"  # agents stop their workers
    COMPLETED = "completed"
    FAILED = "failed"


S = JobState
# JobState -> the states it may go to; ``Job._enter`` enforces it
TRANSITIONS: dict[JobState, set[JobState]] = {
    S.STARTING: {S.RUNNING, S.SETTLING, S.STOPPING},
    S.REJOINING: {
        S.RUNNING,
        S.SETTLING,
        S.RECOVERING,
        S.CHECKPOINTING,
        S.STOPPING,
        S.COMPLETED,
        S.FAILED,
    },  # fmt: skip
    S.RUNNING: {S.SETTLING, S.MIGRATING, S.RESIZING, S.STOPPING, S.COMPLETED},
    S.SETTLING: {S.RECOVERING, S.RESIZING, S.CHECKPOINTING, S.STOPPING},
    S.RECOVERING: {S.RUNNING, S.RECOVERING, S.CHECKPOINTING, S.STOPPING},  # again: a retry
    S.MIGRATING: {S.RUNNING, S.CHECKPOINTING, S.STOPPING},  # a migration given up saves
    S.RESIZING: {S.RUNNING, S.CHECKPOINTING, S.STOPPING},  # a shrink given up saves
    S.CHECKPOINTING: {S.STOPPING},
    S.STOPPING: {S.FAILED},
    S.COMPLETED: set(),
    S.FAILED: set(),
}
LIVE = (S.STARTING, S.REJOINING, S.RUNNING, S.SETTLING, S.RECOVERING, S.MIGRATING,
        S.RESIZING, S.CHECKPOINTING)  # fmt: skip
# what a restarted coordinator handles while its agents rejoin; every other event waits
REJOIN_EVENTS = (AgentHello, AgentLost, Tick, StatusRequest, StopJob)
RECOVERY_EVENTS = (Parked, Recovered, StateSent, WorkerStarted, WorkerJoined, ReplayMismatched)
MIGRATION_EVENTS = (Prepared, Paused, PauseRefused, Dumped, Restored, Rejoined, Resumed)
CHECKPOINT_EVENTS = (Parked, CheckpointWritten, Sealed)
RESIZE_EVENTS = (Parked, Paused, PauseRefused, Resumed, StateSent, WorkerJoined, WorkerStarted)


class IllegalTransition(AssertionError):
    """A decision that the transition table forbids: a bug, never a user error."""


@dataclass
class Rejoin:
    """A restarted coordinator waiting for the agents of its predecessor (``expected``)."""

    before: JobState  # the job's state when the snapshot was written
    busy: dict[str, Any] | None  # what it was in the middle of (``snapshot.busy_with``)
    expected: set[int]
    started: float
    deadline: float
    how: str = "restarted"  # by its launcher; "took over": a standby coordinator (etcd)
    lost_at: float | None = None  # the earliest an agent saw the previous coordinator go
    deferred: list[Any] = field(default_factory=list)  # events that came meanwhile


@dataclass
class Member:
    """A rank's current process, as its agent reported it."""

    node: int
    pid: int
    attempt: int
    from_spare: bool = False


@dataclass
class Job:
    """Membership, generations, the fault log and the outcome of one job."""

    spec: JobSpec
    started: float
    # the job's own launch, which each host's must equal (hosts started by launchers of their
    # own); None when one launcher started every agent
    launch: HostLaunch | None = None
    state: JobState = JobState.STARTING
    generation: int = 0
    agents: set[int] = field(default_factory=set)  # live nodes
    agent_pids: dict[int, int] = field(default_factory=dict)
    agent_netns: dict[int, int] = field(default_factory=dict)
    agent_machines: dict[int, str] = field(default_factory=dict)  # xmig.paths.machine_id
    members: dict[int, Member] = field(default_factory=dict)
    worker_pids: dict[int, list[int]] = field(default_factory=dict)
    # container mode: rank -> the containers its processes ran in, in order
    worker_containers: dict[int, list[str]] = field(default_factory=dict)
    joined: set[int] = field(default_factory=set)
    progress: dict[int, int] = field(default_factory=dict)
    done: dict[int, WorkerDone] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)
    released: bool = False  # every rank finished: finished ranks were let go
    faults: list[FaultRecord] = field(default_factory=list)
    primary: FaultRecord | None = None
    batch: list[FaultRecord] = field(default_factory=list)  # faults being settled
    # deaths of ranks that had recovered and gone on while others still recovered: settled
    # once the recovery ends
    held: list[FaultRecord] = field(default_factory=list)
    settle_started: float = 0.0
    settle_until: float = 0.0
    # rank -> the attempt its latest respawn was ordered as: reports of an earlier one, whose
    # recovery was widened, are of a process being ended
    ordered_attempt: dict[int, int] = field(default_factory=dict)
    recovery: Recovery | None = None
    migration: Migration | None = None
    resizing: Resizing | None = None
    checkpoint: Checkpoint | None = None
    jit_checkpoint: dict[str, Any] | None = None  # the just-in-time checkpoint's record
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)
    # the ranks that left the world at a resize: their rank then, process, node
    left_ranks: list[dict[str, Any]] = field(default_factory=list)
    # the ranks there are now (the launch's, until a resize changes it)
    world_size: int = 0
    # what the ranks said of each recovery's outcome: generation -> its checks
    checks: dict[int, dict[str, Any]] = field(default_factory=dict)
    verdict: str | None = None  # why the job's result cannot be trusted, if it cannot
    reason: str | None = None
    stopped_nodes: set[int] = field(default_factory=set)
    stop_started: float = 0.0
    stop_s: float | None = None
    spares_ready: dict[int, int] = field(default_factory=dict)
    node_announced: dict[int, NodeDying] = field(default_factory=dict)  # injected node losses
    lost_nodes: list[int] = field(default_factory=list)
    fired: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> injected
    criu: dict[int, CriuStatus] = field(default_factory=dict)
    scheduled: list[dict[str, Any]] = field(default_factory=list)  # injected migrations
    scheduled_resizes: list[dict[str, Any]] = field(default_factory=list)  # injected resizes
    scheduled_nodes: list[dict[str, Any]] = field(default_factory=list)  # injected add-node
    # the size the world is to have: the launch's, until a planned resize changes it; a world
    # shrunk below it by a lost node grows back when a node joins
    wanted_world: int = 0
    added_nodes: list[int] = field(default_factory=list)  # nodes started for the job later
    # nodes that joined the running job, to grow the world onto: node -> the earliest step
    joining: dict[int, int] = field(default_factory=dict)
    # rank -> the rank it was launched as, whose injected faults its processes carry (-1:
    # none, a rank a grow added): a resize renumbers ranks
    launched_as: dict[int, int] = field(default_factory=dict)
    # rank -> its local rank on its node (the GPU it uses there)
    local_ranks: dict[int, int] = field(default_factory=dict)
    total_steps: int | None = None  # as the script's step loop said
    warned: set[str] = field(default_factory=set)
    retiring: set[int] = field(default_factory=set)  # processes whose end is expected
    spawned: int = 0  # worker processes started (a change a snapshot must keep)
    restarts: int = 0  # how many coordinators ran this job before this one
    coordinator_restarts: list[dict[str, Any]] = field(default_factory=list)
    rejoin: Rejoin | None = None  # set while a restarted coordinator waits for its agents

    def __post_init__(self) -> None:
        self.world_size = self.world_size or self.spec.world_size
        self.worker_pids = {r: [] for r in range(self.world_size)}
        self.scheduled = [f for f in self.spec.faults if f["kind"] == "migrate"]
        self.scheduled_resizes = sorted((f for f in self.spec.faults if f["kind"] == "resize"),
                                        key=lambda f: int(f["step"]))  # fmt: skip
        self.scheduled_nodes = sorted((f for f in self.spec.faults if f["kind"] == "add-node"),
                                      key=lambda f: int(f["step"]))  # fmt: skip
        self.wanted_world = self.wanted_world or self.world_size
        self.launched_as = self.launched_as or {r: r for r in range(self.world_size)}
        nproc = self.spec.nproc_per_node
        self.local_ranks = self.local_ranks or {r: r % nproc for r in range(self.world_size)}

    # ---- the one entry -----------------------------------------------------------------------
    def on(self, event: Any, now: float) -> list[Order]:
        """Apply ``event``; the orders it calls for. Raises ``Refused`` for a request that
        cannot be carried out."""
        orders: list[Order] = []
        if self.rejoin is not None and not isinstance(event, REJOIN_EVENTS):
            self.rejoin.deferred.append(event)
            return []
        if isinstance(event, (WorkerStarted, WorkerJoined)) and (
            event.pid in self.retiring or event.attempt < self.ordered_attempt.get(event.rank, 0)
        ):
            return []  # a process of a plan given up: it is being ended
        handler = HANDLERS.get(type(event))
        if handler is not None:
            orders += handler(self, event, now)
        if self.recovery is not None and isinstance(event, (*RECOVERY_EVENTS, Tick)):
            orders += self._follow(self.recovery.on(event, now), now)
        if self.migration is not None and isinstance(event, (*MIGRATION_EVENTS, WorkerDone, Tick)):
            orders += self._follow(self.migration.on(event, now), now)
            if self.migration is not None and self.migration.phase is MigrationPhase.DROPPED:
                self.migration = None
                orders += [*self._enter(S.RUNNING, now), *self._maybe_release(now)]
        if self.resizing is not None and isinstance(event, (*RESIZE_EVENTS, WorkerDone, Tick)):
            orders += self._follow(self.resizing.on(event, now), now)
            if self.resizing is not None and self.resizing.phase is ResizePhase.DROPPED:
                self.resizing = None
                orders += [*self._enter(S.RUNNING, now), *self._maybe_release(now)]
        if self.checkpoint is not None and isinstance(event, (*CHECKPOINT_EVENTS, Tick)):
            orders += self._follow(self.checkpoint.on(event, now), now)
        if isinstance(event, Tick):
            orders += self._deadlines(now)
        return orders

    def next_deadline(self) -> float | None:
        """When a ``Tick`` is next due for a decision (None: no timer beyond the usual)."""
        return self.settle_until if self.state is S.SETTLING else None

    def _enter(self, state: JobState, now: float) -> list[Order]:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"the job cannot go from {self.state.name} to {state.name}")
        before, self.state = self.state, state
        return [Note("job", {"from": before.value, "to": state.value})]

    def _follow(self, orders: list[Order], now: float, lost: list[int] | None = None
                ) -> list[Order]:  # fmt: skip
        """Carry a recovery's or migration's verdict into the job's own state (``lost``: the
        ranks a fault that ended it took)."""
        out: list[Order] = []
        for order in orders:
            if isinstance(order, GiveUp):
                out += self._give_up(order.what, order.reason, now, lost or [])
            elif isinstance(order, Saved):
                out += self._saved(order.record, now)
            elif isinstance(order, Retry):
                out += self._retry(order.why, now)
            elif isinstance(order, Settled):
                out += self._settled(order, now)
            elif isinstance(order, Renumber):
                self._renumber(order)
            elif isinstance(order, StartRanks):
                out += self._start_ranks(order)
            elif isinstance(order, DropRanks):
                out += self._drop_ranks(order)
            else:
                out.append(order)
        return out

    # ---- agents and workers ------------------------------------------------------------------
    def _agent_hello(self, msg: AgentHello, now: float) -> list[Order]:
        if self.rejoin is not None:
            return self._agent_rejoined(msg, now)
        self._check_host(msg)
        self.agents.add(msg.node)
        self.agent_pids[msg.node] = msg.pid
        self.agent_machines[msg.node] = msg.machine
        if msg.netns is not None:
            self.agent_netns[msg.node] = msg.netns
        orders: list[Order] = [Note("agent", {"node": msg.node, "pid": msg.pid})]
        # spare nodes may come later: a job needs them only once a node is lost
        if set(range(self.spec.nnodes)) <= self.agents and self.state is S.STARTING:
            orders += self._enter(S.RUNNING, now)
        elif self.state is not S.STARTING and self.progress:
            # a node that joins the training job (added, a spare come late, a repaired one
            # back): the world grows onto it if a lost node left it smaller than wanted
            self.joining.setdefault(msg.node, 0)
            orders.append(Say(f"node {msg.node} joined the job"))
            orders += self._maybe_grow(now)
        return [*orders, Reply({"job": self.spec.to_json(), "generation": self.generation})]

    # ---- a restarted coordinator --------------------------------------------------------------
    def _agent_rejoined(self, msg: AgentHello, now: float) -> list[Order]:
        """An agent of the job's nodes reconnected to this (restarted) coordinator and said
        which workers it holds."""
        assert self.rejoin is not None
        if msg.node in self.lost_nodes:
            raise Refused(f"node {msg.node} was given up before the coordinator restarted")
        self._check_host(msg)
        self.agents.add(msg.node)
        self.agent_pids[msg.node] = msg.pid
        self.agent_machines[msg.node] = msg.machine
        if msg.netns is not None:
            self.agent_netns[msg.node] = msg.netns
        if msg.lost_at is not None:
            self.rejoin.lost_at = min(msg.lost_at, self.rejoin.lost_at or msg.lost_at)
        for held in msg.workers or []:
            rank = int(held["rank"])
            before = self.members.get(rank)
            self.members[rank] = Member(msg.node, int(held["pid"]), int(held["attempt"]),
                                        before.from_spare if before else False)  # fmt: skip
            if int(held["pid"]) not in self.worker_pids.setdefault(rank, []):
                self.worker_pids[rank].append(int(held["pid"]))
            if held.get("step") is not None:
                self.progress[rank] = int(held["step"])
            if held.get("state") in ("running", "done"):  # it said hello: xmig.init() ran
                self.joined.add(rank)
        orders: list[Order] = [Note("agent", {"node": msg.node, "pid": msg.pid,
                                              "rejoined": True})]  # fmt: skip
        reply = Reply({"job": self.spec.to_json(), "generation": self.generation})
        if self.rejoin.expected <= self.agents:
            orders += self._rejoined(now)
        return [*orders, reply]

    def _rejoined(self, now: float) -> list[Order]:
        """Every agent is back (or the wait is over): go on where the previous coordinator
        was, or, if it was in the middle of something that cannot be taken up again, save the
        state and stop."""
        rejoin, self.rejoin = self.rejoin, None
        assert rejoin is not None
        missing = sorted(rejoin.expected - self.agents)
        busy = rejoin.busy["what"] if rejoin.busy else None
        record = {"restart": self.restarts, "how": rejoin.how, "t": now,
                  "state_before": rejoin.before.value,
                  "busy": busy, "missing_nodes": missing, "generation": self.generation,
                  "rejoin_s": round(now - rejoin.started, 4),
                  # from the first agent that saw the coordinator go to the job going on
                  "down_s": round(now - rejoin.lost_at, 4) if rejoin.lost_at else None}  # fmt: skip
        self.coordinator_restarts.append(record)
        orders: list[Order] = [Note("rejoined", record), ToAll(StoreRestarted(
            master_addr=self.spec.master_addr, master_port=self.spec.master_port))]  # fmt: skip
        gone = f"; nodes {missing} did not come back" if missing else ""
        before = rejoin.before
        if before in (S.COMPLETED, S.FAILED):
            return [*orders, *self._enter(before, now), self._finish(now)]
        if before is S.STOPPING:
            return [*orders, *self._stop(self.reason or "stopping", now)]
        if busy is None and before in (S.STARTING, S.RUNNING):
            orders += self._enter(S.RUNNING, now)
            orders.append(Say(f"coordinator restarted (restart {self.restarts}): the job goes "
                              f"on at generation {self.generation}{gone}"))  # fmt: skip
            for node in missing:
                self.agents.add(node)  # lost now, as any node whose agent goes
                orders += self._agent_lost(AgentLost(node), now)
        elif busy == "fault" and self.batch:  # the fault is settled now
            orders += [*self._enter(S.SETTLING, now), Say(
                f"coordinator restarted (restart {self.restarts}) while a fault was settled"
                f"{gone}")]  # fmt: skip
            orders += self._settle(now)
        elif busy == "recovery" and self.primary is not None and not missing:
            # the recovery starts over: where each process stood in the old plan is not
            # known, so its replacements end and every rank rolls the step back
            assert rejoin.busy is not None
            # with the deaths it held: their ranks are replaced too
            held, self.held = self.held, []
            for record in held:
                self._count(record)
            replaced = sorted({*rejoin.busy["ranks"], *(r for f in held for r in f.lost_ranks)})
            for rank in replaced:
                member = self.members.get(rank)
                if member is not None and member.attempt > 0 and member.node in self.agents:
                    self.retiring.add(member.pid)
                    orders.append(ToNode(member.node, EndRank(rank=rank, pid=member.pid)))
            orders.append(Say(f"coordinator restarted (restart {self.restarts}) during the "
                              "recovery: it starts over"))  # fmt: skip
            orders += self._start_recovery(self.primary, replaced, now,
                                           no_replay="the coordinator was restarted during "
                                           "the recovery")  # fmt: skip
        else:
            # a plan half carried out cannot be taken up again from here (the processes'
            # places in it are unknown): what is held is saved and the job stops
            what = busy or before.value
            self.reason = f"the coordinator was restarted during a {what}"
            skip = set(rejoin.busy["ranks"]) if rejoin.busy else set()
            skip |= {r for f in self.held for r in f.lost_ranks}
            holders = [r for r, m in sorted(self.members.items())
                       if r not in skip and m.node in self.agents]  # fmt: skip
            ending = [ToNode(m.node, EndRank(rank=r, pid=m.pid)) for r, m in self.members.items()
                      if r in skip and m.attempt > 0 and m.node in self.agents]  # fmt: skip
            orders += [Say(f"coordinator restarted (restart {self.restarts}) during a {what}"
                           f"{gone}: the job saves its state and stops"), *ending,
                       *self._save(holders, now)]  # fmt: skip
        for event in rejoin.deferred:
            orders += self.on(event, now)
        return orders

    def _check_host(self, msg: AgentHello) -> None:
        """Refuse an agent of a node that does not exist or has joined, or a host whose
        launcher was given another command line than the job's."""
        spec = self.spec
        if not 0 <= msg.node < spec.all_nodes and msg.node not in self.added_nodes:
            spares = f" and {spec.spare_nodes} spare" if spec.spare_nodes else ""
            raise Refused(f"node rank {msg.node} is not expected: the job has {spec.nnodes} "
                          f"node(s){spares}, node ranks 0..{spec.all_nodes - 1}")  # fmt: skip
        if msg.node in self.agents:
            raise Refused(f"node rank {msg.node} has already joined (agent pid "
                          f"{self.agent_pids.get(msg.node)}): each host needs its own "
                          "--node-rank")  # fmt: skip
        if self.launch is None:
            return
        if msg.launch is None:
            raise Refused(f"node rank {msg.node}: this job's hosts are each started by "
                          "`xmig run --rdzv-endpoint ...`")  # fmt: skip
        try:
            theirs = HostLaunch.from_json(msg.launch)
        except JobSpecError as exc:
            raise Refused(f"node rank {msg.node}: {exc}") from None
        differ = self.launch.differences(theirs)
        if differ:
            raise Refused(f"node rank {msg.node} was started with another command line than "
                          f"node 0's: {'; '.join(differ)}")  # fmt: skip

    def _worker_started(self, msg: WorkerStarted, now: float) -> list[Order]:
        self.spawned += 1
        self.worker_pids.setdefault(msg.rank, []).append(msg.pid)
        if msg.container is not None:
            self.worker_containers.setdefault(msg.rank, []).append(msg.container)
        self.members[msg.rank] = Member(msg.node, msg.pid, msg.attempt, msg.from_spare)
        return []

    def _worker_joined(self, msg: WorkerJoined, now: float) -> list[Order]:
        self.joined.add(msg.rank)
        return []

    def _progress(self, msg: Progress, now: float) -> list[Order]:
        self.progress[msg.rank] = msg.step
        orders: list[Order] = []
        for fault in list(self.scheduled):
            if fault["rank"] == msg.rank and msg.step >= int(fault["step"]) - 1:
                self.scheduled.remove(fault)
                try:
                    text, started = self._start_migration(msg.rank, fault.get("to"), "injected",
                                                          now)  # fmt: skip
                    orders += started
                except Refused as exc:
                    orders.append(Say(f"injected migration of rank {msg.rank} not done: {exc}"))
        # two steps ahead, so that the pause reaches every rank before it begins that step
        while self.scheduled_resizes and msg.step >= int(self.scheduled_resizes[0]["step"]) - 2:
            fault = self.scheduled_resizes.pop(0)
            spec = str(FaultSpec.from_json(fault))
            try:
                orders += self._start_resize(int(fault["world"]), spec, now,
                                             at_step=int(fault["step"]))[1]  # fmt: skip
            except Refused as exc:
                orders.append(Say(f"injected {spec} not done: {exc}"))
        while self.scheduled_nodes and msg.step >= int(self.scheduled_nodes[0]["step"]) - 2:
            fault = self.scheduled_nodes.pop(0)
            spec = str(FaultSpec.from_json(fault))
            try:
                orders += self._add_node(spec, now, at_step=int(fault["step"]))[1]
            except Refused as exc:
                orders.append(Say(f"injected {spec} not done: {exc}"))
        return orders + self._maybe_grow(now)

    def _worker_done(self, msg: WorkerDone, now: float) -> list[Order]:
        self.done[msg.rank] = msg
        return self._maybe_release(now)

    def _worker_exited(self, msg: WorkerExited, now: float) -> list[Order]:
        self.exited.add(msg.rank)
        if self.checkpoint is not None:
            return self._follow(self.checkpoint.lost([msg.rank], now), now)
        if self.recovery is not None and msg.rank in self.recovery.survivors:
            return self._follow(self.recovery.fail(
                f"rank {msg.rank} finished and exited during the recovery, so it cannot replay "
                "the last step", now), now)  # fmt: skip
        if self.state is S.RUNNING and len(self.exited) == self.world_size:
            return [*self._enter(S.COMPLETED, now), self._finish(now)]
        return []

    def _bookkeeping(self, msg: Any, now: float) -> list[Order]:
        if isinstance(msg, Spares):
            self.spares_ready[msg.node] = msg.ready
        elif isinstance(msg, CriuStatus):
            self.criu[msg.node] = msg
        elif isinstance(msg, NodeDying):
            self.node_announced[msg.node] = msg
        return []

    def _unreachable(self, msg: UnreachableFaults, now: float) -> list[Order]:
        """A rank's step loop is shorter than its injected faults: say so at once (the end
        counts them as an error)."""
        self.total_steps = msg.total
        late = [f for f in self.scheduled if int(f["step"]) >= msg.total]
        orders: list[Order] = []
        for fault in [*msg.faults, *late]:
            name = str(FaultSpec.from_json(fault))
            if name not in self.warned:
                self.warned.add(name)
                orders.append(Say(f"warning: fault {name} will never fire: the script runs "
                                  f"{msg.total} steps", logging.WARNING))  # fmt: skip
        return orders

    # ---- faults ------------------------------------------------------------------------------
    def _count(self, record: FaultRecord) -> None:
        """Keep ``record`` among the run's faults; an injected one has fired, whatever the
        state it hit (a completed run whose injected fault is not counted fails as a test
        that tested nothing)."""
        self.faults.append(record)
        if record.injected:
            self.fired.setdefault(int(record.injected["rank"]), []).append(record.injected)

    def _fault(self, msg: Fault, now: float) -> list[Order]:
        record = msg.record
        if record.pid in self.retiring:
            self.retiring.discard(record.pid)
            return [Note("expected_exit", {"rank": record.rank, "pid": record.pid})]
        stale = record.generation is not None and record.generation < self.generation
        busy = (S.RECOVERING, S.CHECKPOINTING)
        shrinking = self.resizing is not None and bool(self.resizing.lost)
        if record.kind == "comm_error" and self.state is S.RECOVERING:
            started_over = self._unexplained_during_recovery(record, now)
            if started_over is not None:
                return started_over
        if record.kind == "comm_error" and (self.state in busy or stale or shrinking):
            if record.injected:  # it fired, and the fault it met explains it
                self._count(dataclasses.replace(record, secondary=True))
            return []  # a survivor noticing the fault that is being recovered from
        if self.state in (S.STARTING, S.RUNNING):
            self.batch, self.settle_started = [record], now
            self.settle_until = now + SETTLE_WINDOW_S
            self._settle_after(record, now)
            return [Note("fault", dataclasses.asdict(record)), *self._enter(S.SETTLING, now)]
        if self.state is S.SETTLING:
            self.batch.append(record)
            self._settle_after(record, now)
            return [Note("fault", dataclasses.asdict(record))]
        if self.state is S.RECOVERING:
            held = self._hold(record, now)
            if held is not None:
                return held
            widened = self._widen(record, now)
            if widened is not None:
                return [Note("fault", dataclasses.asdict(record)), *widened]
        self._count(dataclasses.replace(record, secondary=self.state not in LIVE))
        if self.state is S.CHECKPOINTING:
            assert self.checkpoint is not None
            return [Note("fault", dataclasses.asdict(record)),
                    Say(f"fault while saving the checkpoint: {summary.describe(record)}"),
                    *self._follow(self.checkpoint.lost(record.lost_ranks, now), now)]  # fmt: skip
        if self.state is S.RECOVERING:
            assert self.recovery is not None
            self.recovery.lost.update(record.lost_ranks)
            return [Note("fault", dataclasses.asdict(record)),
                    Say(f"fault during recovery: {summary.describe(record)}"),
                    *self._follow(self.recovery.fail("a second fault hit during recovery", now),
                                  now)]  # fmt: skip
        resizing = self.resizing
        if self.state is S.RESIZING and resizing is not None and self._starting(record):
            # a rank the grow started failed before it joined: the world stays as it is
            why = f"did not start: {record.detail}"
            return [
                Note("fault", dataclasses.asdict(record)),
                *self._follow(resizing.not_started(record.lost_ranks, why, now), now),
            ]
        if self.state in (S.RESIZING, S.MIGRATING):
            moving = self.resizing if self.state is S.RESIZING else self.migration
            what = "resize" if self.state is S.RESIZING else "migration"
            assert moving is not None
            self.primary = record
            return [
                Note("fault", dataclasses.asdict(record)),
                Say(f"fault during a {what}: {summary.describe(record)}"),
                *self._follow(
                    moving.fail(f"a fault hit during the {what}", now), now, lost=record.lost_ranks
                ),
            ]
        return [Note("fault", dataclasses.asdict(record))]

    def _starting(self, record: FaultRecord) -> bool:
        """Whether ``record`` is of ranks a grow started that have not joined the new world
        yet (it goes on without them, at the old size)."""
        resizing = self.resizing
        return (resizing is not None
                and resizing.phase in (ResizePhase.PAUSING, ResizePhase.STARTING)
                and set(record.lost_ranks) <= set(resizing.plan.added))  # fmt: skip

    def _settle_after(self, record: FaultRecord, now: float) -> None:
        """A death settles the batch once no other has come for ``SETTLE_QUIET_S``
        (communication errors wait for their death, up to ``SETTLE_WINDOW_S``)."""
        if record.kind != "comm_error":
            self.settle_until = min(self.settle_started + SETTLE_WINDOW_S, now + SETTLE_QUIET_S)

    def _widen(self, record: FaultRecord, now: float) -> list[Order] | None:
        """A death of survivors while the recovery waits for them to park (no plan is out):
        it starts over at once with them replaced too, as if the fault had been settled
        with this death in it. None when the recovery cannot be widened (its plan is out,
        or the record is an error, or names no survivor): then the fault ends it."""
        recovery = self.recovery
        if recovery is None or recovery.plan is not None or record.kind == "comm_error":
            return None
        lost = set(record.lost_ranks)
        new = lost - set(recovery.replaced)
        if not new or not new <= set(recovery.survivors):
            return None  # (each widening replaces more ranks: they cannot go on forever)
        self._count(dataclasses.replace(record, secondary=False))
        for rank in recovery.replaced:
            member = self.members.get(rank)
            if member is not None and member.attempt == self.ordered_attempt.get(rank):
                self.retiring.add(member.pid)  # its replacement, started already
        self.recovery = None
        replaced = sorted(lost | set(recovery.replaced))
        return [Say(f"  also: {summary.describe(record)}"),
                Note("recovery", {"generation": recovery.generation, "what": "widened",
                                  "after_s": round(now - recovery.started, 6),
                                  "replaced": replaced}),
                *self._start_recovery(recovery.primary, replaced, now,
                                      no_replay=recovery.no_replay)]  # fmt: skip

    def _hold(self, record: FaultRecord, now: float) -> list[Order] | None:
        """A death of ranks that had recovered already and gone on past the recovery's step
        (a rank whose groups do not hold the ranks still recovering runs ahead of them,
        under HSDP or tensor parallel): held, and recovered from once the recovery ends.
        Ending the recovery for it would leave the state at two steps, the ranks behind
        still in the recovery's step and those ahead past it, which no checkpoint can join.
        None where the record is not such a death."""
        recovery = self.recovery
        if recovery is None or recovery.plan is None or record.kind == "comm_error":
            return None
        if not set(record.lost_ranks) <= set(recovery.recovered):
            return None
        if record.step is None or record.step <= recovery.plan.step:
            return None  # not past the recovery's step: it did not go on (its rollback, say)
        self.held.append(record)
        recovery.lost.update(record.lost_ranks)  # (not a holder, should the recovery fail)
        return [Note("fault", dataclasses.asdict(record)),
                Say(f"fault after its rank had recovered: {summary.describe(record)}; "
                    f"recovered from once the recovery to generation {recovery.generation} "
                    "has ended")]  # fmt: skip

    def _release_held(self, now: float) -> list[Order]:
        """The recovery ended: the deaths held meanwhile are settled now, as one batch (or
        kept among the run's faults where the job no longer runs)."""
        held, self.held = self.held, []
        if not held:
            return []
        if self.state is not S.RUNNING:
            for record in held:
                self._count(dataclasses.replace(record, secondary=True))
            return []
        self.batch, self.settle_started, self.settle_until = held, now, now
        return self._enter(S.SETTLING, now)

    def _agent_lost(self, event: AgentLost, now: float) -> list[Order]:
        node = event.node
        if node not in self.agents:
            return []  # already handled (its connection closed and it went silent)
        if self.rejoin is not None:  # counted as not back when every other one is
            self.agents.discard(node)
            return [Note("agent_lost", {"node": node, "rejoining": True})]
        self.agents.discard(node)
        if self.state not in LIVE:
            self.stopped_nodes.add(node)
            return self._maybe_finish_stop(now)
        self.lost_nodes.append(node)
        record = self._lost_record(node, now)
        orders: list[Order] = [Note("agent_lost", {"node": node})]
        if record is None:
            orders.append(Say(f"spare node {node} was lost"))
        moving = self.migration is not None and node in (self.migration.source,
                                                          self.migration.target)  # fmt: skip
        if self.state is S.MIGRATING and (record is not None or moving):
            assert self.migration is not None
            if record is not None:
                self._count(record)
            lost = record.lost_ranks if record is not None else []
            return [*orders, *self._follow(self.migration.fail(
                f"the agent of node {node} was lost", now), now, lost=lost)]  # fmt: skip
        if self.state is S.RESIZING and record is not None and self._starting(record):
            return [*orders, *self._fault(Fault(record=record), now)]  # a grow's new node
        if self.state is S.RESIZING and record is not None:
            assert self.resizing is not None
            self._count(record)
            return [*orders, *self._follow(self.resizing.fail(
                f"the agent of node {node} was lost", now), now,
                lost=record.lost_ranks)]  # fmt: skip
        if record is None or self.state is S.MIGRATING:
            return orders
        if self.state is S.CHECKPOINTING:
            assert self.checkpoint is not None
            self._count(record)
            return [*orders, *self._follow(self.checkpoint.lost(record.lost_ranks, now), now)]
        if self.state is S.RECOVERING:
            assert self.recovery is not None
            widened = self._widen(record, now)
            if widened is not None:
                return [*orders, *widened]
            self._count(record)
            self.recovery.lost.update(record.lost_ranks)
            return [*orders, *self._follow(self.recovery.fail(
                f"the agent of node {node} was lost during recovery", now), now)]  # fmt: skip
        return [*orders, *self._fault(Fault(record=record), now)]

    def _lost_record(self, node: int, now: float) -> FaultRecord | None:
        """The fault record for a lost node's ranks, or None when it had none."""
        ranks = sorted(r for r, m in self.members.items() if m.node == node)
        if not ranks:
            return None
        announced = self.node_announced.pop(node, None)
        t_fault = announced.t if announced else now
        return FaultRecord(
            rank=ranks[0], ranks=ranks, node=node, pid=self.agent_pids.get(node, -1), attempt=0,
            kind="agent_lost", detail=f"agent of node {node} and its ranks {ranks} gone",
            step=min((self.progress.get(r, 0) for r in ranks), default=None),
            injected=announced.fault if announced else None, t_fault=t_fault, t_detected=now,
            fault_time_source="injection" if announced else "detection",
            detected_after_s=round(max(0.0, now - t_fault), 6),
        )  # fmt: skip

    def _settle(self, now: float) -> list[Order]:
        """The settle window closed: the earliest death is the cause; a death explains the
        communication errors its peers saw; without one, the first error is the fault."""
        batch, self.batch = self.batch, []
        deaths = sorted((r for r in batch if r.kind != "comm_error"), key=lambda r: r.t_fault)
        errors = sorted((r for r in batch if r.kind == "comm_error"), key=lambda r: r.t_fault)
        dead = sorted({rank for r in deaths for rank in r.lost_ranks})
        # an error that the deaths do not explain is a fault of its own
        unexplained = [r for r in errors if decide.unexplained_error([r], dead)]
        ordered = [
            dataclasses.replace(r, secondary=i > 0 and r not in unexplained
                                and (r.kind == "comm_error" or not deaths))
            for i, r in enumerate(deaths + errors)
        ]  # fmt: skip
        for record in ordered:
            self._count(record)
        self.primary = ordered[0]
        orders: list[Order] = [Say(f"fault: {summary.describe(ordered[0])}")]
        orders += [Say(f"  also: {summary.describe(r)}") for r in ordered[1:] if not r.secondary]
        return orders + self._start_recovery(
            ordered[0], dead, now, no_replay=decide.unexplained_error(errors, dead)
        )

    # ---- recovery ----------------------------------------------------------------------------
    def _retry(self, why: str, now: float, no_replay: str | None = None) -> list[Order]:
        """The replay of a recovery failed (a replacement issued an op its survivors had not
        logged; it ends itself), or cannot be (``no_replay``): start the recovery over,
        every rank rolling the step back."""
        failed = self.recovery
        assert failed is not None
        self.recovery = None
        for rank in failed.replaced:
            member = self.members.get(rank)
            if member is not None:
                self.retiring.add(member.pid)
        held, self.held = self.held, []  # deaths it held: replaced in the new one too
        for record in held:
            self._count(record)
        replaced = sorted({*failed.replaced, *(r for f in held for r in f.lost_ranks)})
        no_replay = no_replay or f"replaying it failed: {why}"
        return [Say(f"replay impossible: {why}; rolling the step back instead"),
                *self._start_recovery(failed.primary, replaced, now,
                                      no_replay=no_replay)]  # fmt: skip

    def _unexplained_during_recovery(self, record: FaultRecord, now: float) -> list[Order] | None:
        """A collective failed, during a recovery that replays, in a group that holds none of
        the replaced ranks: a fault of its own, in a group the replay would keep as it is.
        The recovery starts over as a rollback, which rebuilds every group. None where the
        recovery's faults explain the error, or where its rank had recovered already (a
        held death's echo, or a fault after the recovery, which its trouble watchdog ends
        if no recovery follows)."""
        recovery = self.recovery
        if recovery is None or recovery.no_replay is not None or record.rank in recovery.recovered:
            return None
        if recovery.plan is not None and recovery.plan.mode != "replay":
            return None
        why = decide.unexplained_error([record], recovery.replaced)
        if why is None:
            return None
        self._count(record)
        return [Note("fault", dataclasses.asdict(record)),
                Say(f"  also: {summary.describe(record)}"),
                *self._retry(why, now, no_replay=why)]  # fmt: skip

    def _start_recovery(self, primary: FaultRecord, replaced: list[int], now: float,
                        no_replay: str | None = None) -> list[Order]:  # fmt: skip
        if self.spec.on_no_spare == "shrink" and decide.nodes_without_spare(self, replaced):
            return self._start_shrink(primary, replaced, now)
        why_not = decide.why_no_recovery(self, primary, replaced)
        if why_not is not None:
            self.reason = why_not
            holders = [r for r in range(self.world_size) if r not in replaced]
            return [Say(f"no in-place recovery: {why_not}"), *self._save(holders, now)]
        self.generation += 1
        survivors = [r for r in range(self.world_size) if r not in replaced]
        placement = decide.placement(self, replaced)
        self.recovery = Recovery(self.generation, primary, replaced, survivors, started=now,
                                 deadline=now + self.spec.recovery_timeout,
                                 placement=placement, no_replay=no_replay)  # fmt: skip
        self.joined -= set(replaced)
        for rank in replaced:
            self.done.pop(rank, None)
        orders: list[Order] = [
            *self._enter(S.RECOVERING, now),
            Note("generation", {"generation": self.generation, "why": "recovery",
                                "replaced": replaced}),
            *self.recovery.start(now),
            ToAll(Park(generation=self.generation, replaced=replaced)),
        ]  # fmt: skip
        for rank in replaced:
            attempt = max(self.members[rank].attempt, self.ordered_attempt.get(rank, 0)) + 1
            self.ordered_attempt[rank] = attempt
            orders.append(ToNode(placement[rank], Respawn(
                rank=rank, generation=self.generation,
                local_rank=self.local_ranks.get(rank, rank % self.spec.nproc_per_node),
                attempt=attempt,
                fired=self.fired.get(rank, []),  # on another node: not to be fired again
                world_size=self.world_size,
                launched_as=self.launched_as.get(rank, rank),
            )))  # fmt: skip
        moved = sorted({n for r, n in placement.items() if n != self.members[r].node})
        what = f"respawning rank {replaced}" if replaced else "rebuilding in place"
        if moved:
            what += f" on spare node {', '.join(map(str, moved))}"
        return [*orders, Say(f"recovery to generation {self.generation}: {what}")]

    def _recovery_failed(self, msg: RecoveryFailed, now: float) -> list[Order]:
        if self.recovery is None:
            return []
        if msg.generation is not None and msg.generation != self.recovery.generation:
            return [Note("ignored", {"why": f"rank {msg.rank}'s failure of generation "
                                            f"{msg.generation}: {msg.error}"})]  # fmt: skip
        return self._follow(
            self.recovery.fail(f"rank {msg.rank} could not recover: {msg.error}", now), now
        )

    def _cannot_recover(self, msg: CannotRecover, now: float) -> list[Order]:
        """A layout no fault could be recovered in, found before training: stop now rather
        than lose the state at the first fault."""
        if self.state not in LIVE or self.verdict is not None:
            return []
        return self._distrust(msg.why, now)

    def _settled(self, settled: Settled, now: float) -> list[Order]:
        """A recovery or migration has finished: keep its record, run on, say so (and that
        its replay came out different, which with ``--strict`` stops the job)."""
        record, why = settled.record, None
        if self.recovery is not None:
            self.recoveries.append(record)
            differ = (record.get("replay") or {}).get("differ")
            why = replay_divergence(differ[0], record["ranks"]) if differ else None
        elif self.resizing is not None:
            self.resizes.append(record)
            if record["cause"] == ResizeCause.PLANNED.value and not record.get("refused"):
                self.wanted_world = record["new_world"]
        else:
            self.migrations.append(record)
        self.recovery = self.migration = self.resizing = None
        orders = [*self._enter(S.RUNNING, now), Say(settled.line)]
        if why is not None:
            orders += self._not_bit_identical(record["generation"], why)
            if self.spec.strict:
                orders += self._distrust(f"--strict: {why}", now)
        if self.held:
            return [*orders, *self._release_held(now)]
        return [*orders, *self._maybe_release(now)]

    def _not_bit_identical(self, generation: int, why: str) -> list[Order]:
        """Record why the recovery of ``generation`` cannot be the fault-free run; the
        warning for the user."""
        checks = self.checks.setdefault(generation, {"verified": None, "sums": {}})
        checks.setdefault("not_bit_identical", why)
        return [Say(f"warning: the recovery of generation {generation} is not bit-identical "
                    f"to a run without the fault: {why}", logging.WARNING)]  # fmt: skip

    def _give_up(self, what: str, reason: str, now: float, lost: list[int]) -> list[Order]:
        """End a recovery, resize or migration that cannot finish, with ``reason``: the ranks
        that hold the state save it first (a recovery's survivors, a shrink's; every rank not
        lost, but a moving rank in flight, when a migration or a resize ended before any rank
        renumbered); otherwise every worker is told and the job stops."""
        recovery, resizing, migration = self.recovery, self.resizing, self.migration
        self.recovery = self.migration = self.resizing = None
        self.reason = reason
        if resizing is not None and resizing.lost:  # a shrink: the survivors hold the state
            return [Say(f"{what}: {reason}"), *self._save(resizing.survivors, now)]
        if resizing is not None and ResizePhase.RESIZING.value not in resizing.times:
            # it ended before any rank renumbered for the new world: every rank of the world
            # not lost holds the state, paused at the boundary or on its way there
            holders = [r for r in range(self.world_size) if r not in lost]
            return [Say(f"{what}: {reason}"), *self._save(holders, now)]
        if migration is not None:
            # every rank not lost holds the state (paused, or on its way to the pause), but
            # the moving one while it is being checkpointed, restored or reconnected
            times = migration.times
            moving = (MigrationPhase.DUMPING.value in times
                      and MigrationPhase.RESUMING.value not in times)  # fmt: skip
            holders = [r for r in range(self.world_size)
                       if r not in lost and not (moving and r == migration.rank)]  # fmt: skip
            return [Say(f"{what}: {reason}"), *self._save(holders, now)]
        if recovery is not None:
            for record in self.held:  # deaths it held: among the run's faults, not holders
                self._count(dataclasses.replace(record, secondary=True))
            self.held = []
            holders = [r for r in recovery.survivors if r not in recovery.lost]
            # the replacements have no state to save, and a survivor may wait for one of
            # them inside a collective (gloo's cannot be aborted): they end first
            ending = [ToNode(m.node, EndRank(rank=r, pid=m.pid)) for r in recovery.replaced
                      if (m := self.members.get(r)) is not None and m.attempt > 0]  # fmt: skip
            return [Say(f"{what}: {reason}"), *ending, *self._save(holders, now)]
        return [ToAll(Abort(reason=reason)), Say(f"{what}: {reason}"), *self._stop("fault", now)]

    # ---- just-in-time checkpoint -----------------------------------------------------------
    def _save(self, holders: list[int], now: float) -> list[Order]:
        """The fault cannot be recovered: ``holders`` (the ranks whose state can be trusted)
        save it before the job stops, where they can."""
        holders = [r for r in holders if r not in self.exited]
        why_not = decide.why_no_checkpoint(self, holders)
        if why_not is not None:
            self.jit_checkpoint = {"path": None, "step": None, "why": why_not}
            return [
                ToAll(Abort(reason=self.reason or why_not)),
                Say(f"no just-in-time checkpoint: {why_not}"),
                *self._stop("fault", now),
            ]
        self.generation += 1
        self.checkpoint = Checkpoint(
            self.spec, self.generation, self.reason or "fault", holders, started=now,
            deadline=now + self.spec.recovery_timeout,
        )  # fmt: skip
        return [*self._enter(S.CHECKPOINTING, now),
                Note("generation", {"generation": self.generation, "why": "checkpoint"}),
                Say(f"saving a just-in-time checkpoint from ranks {holders}"),
                *self.checkpoint.start(now)]  # fmt: skip

    def _saved(self, record: dict[str, Any], now: float) -> list[Order]:
        """The checkpoint is written, or could not be: the job stops, saying which."""
        self.checkpoint = None
        self.jit_checkpoint = record
        if record["path"] is not None:
            size = record["bytes"] / 2**20
            line = (f"just-in-time checkpoint of step {record['step']} written to "
                    f"{record['path']} ({record['shards']} shard(s), {size:.1f} MiB, "
                    f"{record['seconds']:.2f} s)")  # fmt: skip
            if record["why"]:
                line += f"; incomplete: {record['why']}"
        else:
            line = f"no just-in-time checkpoint: {record['why']}"
        return [Say(line), *self._stop("fault", now)]

    # ---- checks after a recovery -------------------------------------------------------------
    def _check(self, msg: Verify | NotBitIdentical, now: float) -> list[Order]:
        """What the ranks say after a recovery: their replicas' checksums (all equal, or the
        job stops) and whether the recovered run can still be the fault-free run's."""
        checks = self.checks.setdefault(msg.generation, {"verified": None, "sums": {}})
        if isinstance(msg, NotBitIdentical):
            if "not_bit_identical" in checks:
                return []  # one warning a recovery
            orders = self._not_bit_identical(msg.generation, msg.why)
            if self.spec.strict and self.state in LIVE:
                orders += self._distrust(f"--strict: {msg.why}", now)
            return orders
        checks["sums"][msg.rank] = msg.checksum
        checks.setdefault("replicas", {})[msg.rank] = msg.replicas
        if len(checks["sums"]) < self.world_size:
            return []
        sums = {r: c for r, c in checks["sums"].items() if c}
        differ = decide.differing_replicas(sums, checks["replicas"])
        checks["verified"] = differ is None if sums else None
        if differ is None:
            return []
        sums = differ
        return self._distrust(
            f"after the recovery of generation {msg.generation} the ranks' parameters differ at "
            f"step {msg.step} ({summary.by_rank(sums)}): the state was corrupted in transit or "
            "the script does not recompute a step the same way", now)  # fmt: skip

    def _maybe_release(self, now: float) -> list[Order]:
        """Once every rank has finished its steps, nobody can need a finished rank's state
        any more: let them all exit. Replicas that end different fail the job instead."""
        if self.released or self.state is not S.RUNNING:
            return []
        if len(self.done) < self.world_size:  # (cheap: one WorkerDone a rank)
            return []
        if not set(self.done) >= set(range(self.world_size)):
            return []
        sums = {r: d.checksum for r, d in self.done.items() if d.checksum}
        differ = decide.differing_replicas(sums, {r: d.replicas for r, d in self.done.items()})
        if differ is not None:
            sums = differ
            return self._distrust(
                f"the ranks' parameters differ at the end ({summary.by_rank(sums)}): DDP's "
                "replicas must be equal; the result is not trustworthy", now)  # fmt: skip
        self.released = True
        return [ToAll(Release())]

    def _distrust(self, reason: str, now: float) -> list[Order]:
        """Stop a job whose result cannot be trusted, saying why."""
        self.verdict = reason
        orders: list[Order] = [Say(f"stopping: {reason}")]
        if self.recovery is not None or self.migration is not None or self.resizing is not None:
            self.recovery = self.migration = self.resizing = None
            orders.append(ToAll(Abort(reason=reason)))
        return orders + self._stop(reason, now)

    # ---- requests ------------------------------------------------------------------------------
    def _status(self, msg: StatusRequest, now: float) -> list[Order]:
        return [Reply({"status": summary.status(self)})]

    def _inject(self, msg: InjectRequest, now: float) -> list[Order]:
        try:
            fault = parse_fault(msg.spec, require_step=False)
        except FaultSpecError as exc:
            raise Refused(str(exc)) from None
        if fault.kind == "resize":
            raise Refused("a resize is asked for with `xmig scale --world-size N`")
        if fault.kind == "add-node":
            raise Refused("a node is added with `xmig scale --add-node`")
        if fault.rank >= self.world_size:
            raise Refused(f"rank {fault.rank} does not exist (world size {self.world_size})")
        if self.state is not S.RUNNING:
            raise Refused(f"the job is {self.state.value}, not running")
        current = self.progress.get(fault.rank)
        # without a step the rank itself takes its next step: progress seen here may lag
        if fault.step is not None and current is not None and fault.step <= current:
            raise Refused(f"rank {fault.rank} is already at step {current}")
        member = self.members.get(fault.rank)
        if member is None or member.node not in self.agents:
            raise Refused(f"rank {fault.rank} has no live agent")
        return [ToNode(member.node, InjectFault(fault=fault.to_json())),
                Say(f"fault {fault} queued by request"), Reply({"fault": str(fault)})]  # fmt: skip

    def _migrate(self, msg: MigrateRequest, now: float) -> list[Order]:
        text, orders = self._start_migration(msg.rank, msg.to, "request", now)
        return [*orders, Reply({"migration": text})]

    def _start_migration(self, rank: int, target: int | None, why: str,
                         now: float) -> tuple[str, list[Order]]:  # fmt: skip
        problem, target = decide.migration_problem(self, rank, target)
        if problem is not None:
            raise Refused(problem)
        self.generation += 1
        member = self.members[rank]
        step = max(self.progress.values()) + 1  # a boundary no rank has passed yet
        name = f"rank{rank}-g{self.generation}"
        source_images = images_dir(self.spec.job_id, member.node, name)
        # on one machine the target reads the images where the source wrote them
        machine = self.agent_machines.get(member.node, "")
        local = bool(machine) and machine == self.agent_machines.get(target) and not stream_forced()
        self.migration = Migration(
            self.generation, rank, member.pid, member.node, target, step, source_images,
            source_images if local else images_dir(self.spec.job_id, target, name), why,
            world_size=self.world_size, local_rank=rank % self.spec.nproc_per_node,
            attempt=member.attempt, started=now, deadline=now + self.spec.recovery_timeout,
            serve_images=not (shared_images() or local),
        )  # fmt: skip
        text = (f"moving rank {rank} from node {member.node} to node {target} at the start of "
                f"step {step} (generation {self.generation})")  # fmt: skip
        orders = [*self._enter(S.MIGRATING, now),
                  Note("generation", {"generation": self.generation, "why": "migration"}),
                  *self.migration.start(now), Say(text)]  # fmt: skip
        return text, orders

    def _scale(self, msg: ScaleRequest, now: float) -> list[Order]:
        if msg.add_node:
            if msg.world_size:
                raise Refused("ask for either --world-size or --add-node")
            text, orders = self._add_node("request", now)
        else:
            text, orders = self._start_resize(msg.world_size, "request", now)
        return [*orders, Reply({"resize": text})]

    def _start_resize(self, world_size: int, why: str, now: float,
                      at_step: int = 0) -> tuple[str, list[Order]]:  # fmt: skip
        """Start changing the world to ``world_size`` ranks at the start of ``at_step``, or
        of the first step no rank has begun if that is later (new ranks on idle nodes);
        raises ``Refused`` with why it cannot."""
        self._check_can_resize()
        step = max(at_step, max(self.progress.values()) + 1)
        nodes = {r: m.node for r, m in self.members.items()}
        free = free_slots(nodes, sorted(self.agents), self.spec.nproc_per_node)
        plan = plan_planned(nodes, world_size, step, min_world_size=1, free=free)
        if isinstance(plan, Refusal):
            raise Refused(plan.reason)
        return self._begin_resize(plan, why, now)

    def _check_can_resize(self) -> None:
        if self.state is not S.RUNNING:
            what = "handling a fault" if self.state is S.SETTLING else self.state.value
            raise Refused(f"the job is {what}, not running")
        if not self.progress:
            raise Refused("no rank has started training yet")

    def _begin_resize(self, plan: ResizePlan, why: str, now: float) -> tuple[str, list[Order]]:
        self.generation += 1
        self.resizing = Resizing(self.generation, plan, why, started=now,
                                 deadline=now + self.spec.recovery_timeout)  # fmt: skip
        verb = "growing" if plan.new_world > plan.old_world else "resizing"
        text = (f"{verb} the world from {plan.old_world} to {plan.new_world} ranks at the "
                f"start of step {plan.step} (generation {self.generation})")  # fmt: skip
        if plan.added:
            nodes = sorted(set(plan.added.values()))
            text += f": ranks {sorted(plan.added)} start on node(s) {nodes}"
        orders = [*self._enter(S.RESIZING, now),
                  Note("generation", {"generation": self.generation, "why": "resize"}),
                  *self._follow(self.resizing.start(now), now), Say(text)]  # fmt: skip
        return text, orders

    def _add_node(self, why: str, now: float, at_step: int = 0) -> tuple[str, list[Order]]:
        """Have the launcher start one more node for the job (its agent joins as any
        node's does; ``_agent_hello`` grows the world onto it, from ``at_step`` on at the
        earliest, if a lost node left the world smaller than wanted)."""
        if self.spec.multi_host:
            raise Refused("each host of this job runs a launcher of its own: start `xmig run "
                          "--rdzv-endpoint ... --node-rank N` on the new host, N a spare node "
                          "rank or a lost node's")  # fmt: skip
        if self.state not in LIVE or self.state is S.CHECKPOINTING:
            raise Refused(f"the job is {self.state.value}")
        node = self.spec.all_nodes + len(self.added_nodes)
        self.added_nodes.append(node)
        if at_step:
            self.joining[node] = at_step
        if self.world_size < self.wanted_world:
            then = (f"the world grows from {self.world_size} ranks toward {self.wanted_world} "
                    "at the first step boundary after it joins")  # fmt: skip
        else:
            then = f"it waits as a spare node (the world has its {self.wanted_world} ranks)"
        text = f"starting node {node} ({why}): {then}"
        return text, [Note("add_node", {"node": node, "why": why}),
                      ToLaunchers(StartNode(node=node)), Say(text)]  # fmt: skip

    def _maybe_grow(self, now: float) -> list[Order]:
        """The world is smaller than wanted (a lost node shrank it) and a node is idle (one
        that joined the running job, or a spare node the shrink did not use): grow onto it
        at the next step boundary (an injected ``add-node``'s at its step at the earliest)."""
        if self.state is not S.RUNNING or self.world_size >= self.wanted_world:
            return []
        if not self.progress:
            return []
        idle = decide.idle_nodes(self)
        if not idle:
            return []
        node = idle[0]
        joined = node in self.joining
        earliest = self.joining.pop(node, 0)
        step = max(earliest, max(self.progress.values()) + 1)
        nodes = {r: m.node for r, m in self.members.items()}
        plan = plan_grow(nodes, node, step, idle, self.spec.nproc_per_node,
                         max_world_size=self.wanted_world)  # fmt: skip
        if isinstance(plan, Refusal):
            return [Say(f"node {node} stays a spare: {plan.reason}")]
        why = f"node {node} joined" if joined else f"node {node} is idle"
        return self._begin_resize(plan, why, now)[1]

    def _drop_ranks(self, order: DropRanks) -> list[Order]:
        """A grow given up before its new ranks joined: their processes end, the job forgets
        them (``left_ranks`` keeps them), and the paused ranks go on at the old size on
        communicators of a new generation (a new rank that did join may be waiting to meet
        under the pause's)."""
        orders: list[Order] = [Say(f"the world stays at {self.world_size} ranks: {order.why}")]
        for rank in order.ranks:
            member = self.members.pop(rank, None)
            pids = self.worker_pids.pop(rank, [])
            if member is not None:
                self.retiring.add(member.pid)
                if member.node in self.agents:
                    orders.append(ToNode(member.node, EndRank(rank=rank, pid=member.pid)))
                self.left_ranks.append({"rank": rank, "pid": member.pid, "node": member.node,
                                        "pids": pids, "world_size": self.world_size,
                                        "fired": [], "joined": False})  # fmt: skip
            for table in (self.progress, self.local_ranks, self.launched_as, self.done):
                table.pop(rank, None)
            self.joined.discard(rank)
        if not order.resume:
            return orders
        self.generation += 1
        return [
            *orders,
            Note("generation", {"generation": self.generation, "why": "grow given up"}),
            ToAll(Resume(generation=order.generation, communicators=self.generation)),
        ]

    def _start_ranks(self, order: StartRanks) -> list[Order]:
        """The ranks a grow adds: each started by its node's agent as a process that pulls
        its state (an attempt after any earlier process of that rank number)."""
        orders: list[Order] = []
        used = {(m.node, self.local_ranks.get(r)) for r, m in self.members.items()}
        for rank, node in sorted(order.added.items()):
            local_rank = next(i for i in range(len(used) + 1) if (node, i) not in used)
            used.add((node, local_rank))
            self.local_ranks[rank] = local_rank
            before = len(self.worker_pids.get(rank, []))
            attempt = max(self.ordered_attempt.get(rank, 0), before) + 1
            self.ordered_attempt[rank] = attempt
            self.launched_as[rank] = -1
            orders.append(ToNode(node, Respawn(
                rank=rank, generation=order.generation, local_rank=local_rank, attempt=attempt,
                fired=[], world_size=order.world_size, launched_as=-1)))  # fmt: skip
        return orders

    def _start_shrink(self, primary: FaultRecord, replaced: list[int],
                      now: float) -> list[Order]:  # fmt: skip
        """A lost node's ranks have no spare (``--on-no-spare shrink``): go on without them,
        from the step the survivors are parked in, rolled back; or stop, saving the state."""
        holders = [r for r in range(self.world_size) if r not in replaced]
        why_not = decide.why_no_recovery(self, primary, replaced, shrinking=True)
        nodes = {r: m.node for r, m in self.members.items()}
        lost = {self.members[r].node for r in replaced if r in self.members} - self.agents
        plan = (Refusal(why_not, stop=True) if why_not is not None else
                plan_shrink(nodes, lost, primary.step or 0, self.spec.min_world_size,
                            OnNoSpare.SHRINK))  # fmt: skip
        if isinstance(plan, Refusal):
            self.reason = plan.reason
            return [Say(f"no shrink: {plan.reason}"), *self._save(holders, now)]
        gone = sorted(set(range(self.world_size)) - set(plan.ranks))
        self.generation += 1
        self.resizing = Resizing(self.generation, plan, summary.describe(primary), started=now,
                                 deadline=now + self.spec.recovery_timeout, lost=gone,
                                 t_fault=primary.t_fault)  # fmt: skip
        return [*self._enter(S.RESIZING, now),
                Note("generation", {"generation": self.generation, "why": "shrink",
                                    "lost": gone}),
                *self.resizing.start(now),
                Say(f"no spare node for ranks {gone}: shrinking the world from "
                    f"{plan.old_world} to {plan.new_world} ranks (generation "
                    f"{self.generation})")]  # fmt: skip

    def _renumber(self, order: Renumber) -> None:
        """The world's ranks from now on: those that stay under their new numbers."""
        ranks = order.ranks

        def moved(table: dict[int, Any]) -> dict[int, Any]:
            return {ranks[r]: v for r, v in table.items() if r in ranks}

        left = {r: self.members[r].pid for r in self.members if r not in ranks}
        self.retiring.update(left.values())  # their ends are expected
        self.left_ranks += [{"rank": r, "pid": pid, "node": self.members[r].node,
                             "pids": self.worker_pids.get(r, []), "world_size": order.world_size,
                             "fired": self.fired.get(r, [])}
                            for r, pid in sorted(left.items())]  # fmt: skip
        self.members = moved(self.members)
        self.worker_pids = moved(self.worker_pids)
        self.worker_containers = moved(self.worker_containers)
        self.progress = moved(self.progress)
        self.done = moved(self.done)
        self.fired = moved(self.fired)
        self.ordered_attempt = moved(self.ordered_attempt)
        self.launched_as = moved(self.launched_as)
        self.local_ranks = moved(self.local_ranks)
        self.joined = {ranks[r] for r in self.joined if r in ranks}
        self.exited = {ranks[r] for r in self.exited if r in ranks}
        self.world_size = order.world_size

    def _restored(self, msg: Restored, now: float) -> list[Order]:
        if msg.ok and self.migration is not None and msg.rank == self.migration.rank:
            member = self.members[msg.rank]
            member.node = msg.node
            if msg.pid is not None and msg.pid != member.pid:  # a container's init: the host's
                member.pid = msg.pid  # PID changes, its own does not
                self.worker_pids[msg.rank].append(msg.pid)
        return []

    # ---- stopping ------------------------------------------------------------------------------
    def _stop_request(self, msg: StopJob, now: float) -> list[Order]:
        if self.state not in LIVE:
            return [Reply({"stopping": False})]
        orders: list[Order] = []
        if self.recovery is not None or self.migration is not None or self.resizing is not None:
            self.recovery = self.migration = self.resizing = None
            orders.append(ToAll(Abort(reason=msg.reason)))
        return [*orders, *self._stop(msg.reason, now), Reply({"stopping": True})]

    def _stop(self, reason: str, now: float) -> list[Order]:
        """Every agent stops its workers; the job fails once all have (or at a deadline)."""
        if reason != "fault" or self.reason is None:
            self.reason = reason
        orders = self._enter(S.STOPPING, now)
        if reason != "fault":
            orders.append(Say(f"stopping the job: {reason}"))
        self.stop_started = now
        orders += [ToNode(n, StopWorkers(grace=self.spec.stop_grace)) for n in sorted(self.agents)]
        return orders + self._maybe_finish_stop(now)

    def _stopped(self, msg: Stopped, now: float) -> list[Order]:
        self.stopped_nodes.add(msg.node)
        return self._maybe_finish_stop(now)

    def _maybe_finish_stop(self, now: float) -> list[Order]:
        if self.state is S.STOPPING and self.stopped_nodes >= self.agents:
            self.stop_s = now - self.stop_started
            return [*self._enter(S.FAILED, now), self._finish(now)]
        return []

    def _finish(self, now: float) -> Finish:
        return Finish(summary.summary(self, now))

    def _deadlines(self, now: float) -> list[Order]:
        if self.rejoin is not None:
            return self._rejoined(now) if now >= self.rejoin.deadline else []
        if self.state is S.SETTLING and now >= self.settle_until:
            return self._settle(now)
        joining = self.started + self.spec.agent_connect_timeout
        if self.state is S.STARTING and now > joining:
            missing = sorted(set(range(self.spec.nnodes)) - self.agents)
            what = "hosts of node ranks" if self.spec.multi_host else "agents of nodes"
            option = " (--join-timeout)" if self.spec.multi_host else ""
            return self._stop(f"{what} {missing} did not connect within "
                              f"{self.spec.agent_connect_timeout:.0f} s{option}", now)  # fmt: skip
        spares = sorted(set(range(self.spec.all_nodes)) - self.agents - set(self.lost_nodes))
        if now > joining and spares and "spares" not in self.warned and self.state in LIVE:
            self.warned.add("spares")
            return [Say(f"warning: spare nodes {spares} have not joined "
                        f"{self.spec.agent_connect_timeout:.0f} s after the start: a lost node "
                        "is not replaced until one does", logging.WARNING)]  # fmt: skip
        stop_deadline = self.stop_started + self.spec.stop_grace + STOP_SLACK_S
        if self.state is S.STOPPING and now > stop_deadline:
            missing = sorted(set(range(self.spec.nnodes)) - self.stopped_nodes)
            self.stop_s = now - self.stop_started
            return [Say(f"agents of nodes {missing} did not confirm the stop in time"),
                    *self._enter(S.FAILED, now), self._finish(now)]  # fmt: skip
        return []


def _ignore(job: Job, msg: Any, now: float) -> list[Order]:
    return []


# message type -> the Job's handler; the recovery and migration get theirs in ``Job.on``
HANDLERS: dict[type, Callable[[Job, Any, float], list[Order]]] = {
    AgentHello: Job._agent_hello,
    AgentLost: Job._agent_lost,
    WorkerStarted: Job._worker_started,
    WorkerJoined: Job._worker_joined,
    Progress: Job._progress,
    WorkerDone: Job._worker_done,
    WorkerExited: Job._worker_exited,
    Spares: Job._bookkeeping,
    CriuStatus: Job._bookkeeping,
    NodeDying: Job._bookkeeping,
    UnreachableFaults: Job._unreachable,
    Fault: Job._fault,
    RecoveryFailed: Job._recovery_failed,
    CannotRecover: Job._cannot_recover,
    Verify: Job._check,
    NotBitIdentical: Job._check,
    StatusRequest: Job._status,
    InjectRequest: Job._inject,
    MigrateRequest: Job._migrate,
    ScaleRequest: Job._scale,
    Restored: Job._restored,
    StopJob: Job._stop_request,
    Stopped: Job._stopped,
    Tick: _ignore,
}
for _cls in (*RECOVERY_EVENTS, *MIGRATION_EVENTS, *RESIZE_EVENTS):
    HANDLERS.setdefault(_cls, _ignore)
