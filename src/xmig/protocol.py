"""Every message between xmig's processes, in one catalogue.

A message is a frozen dataclass registered with its ``op`` (its name on the wire), who may
send it and who receives it. On the wire (``xmig.wire``: authenticated, length-prefixed JSON
frames) a message is ``{"op": ..., **fields}``; ``decode`` turns a frame back into its class,
checking every field's type, and raises ``ProtocolError`` (never anything else) for a frame it
does not know: an unknown op, a wrong direction, a missing, extra or mistyped field. Every
receiver rejects and logs what does not decode.

Messages relayed by an agent: a worker's reports to the coordinator (the agent adds the rank,
known from the worker's authenticated connection) and the coordinator's orders to workers
(``relay`` says to which of the node's workers: all of them, or the rank the order names).

The channels between processes, all of them:
- control connections (``xmig.wire``), launcher/CLI → coordinator (which pushes the outcome,
  and a node to start for ``xmig scale --add-node``, to the launcher), agent → coordinator,
  worker → its node's agent: the messages below, authenticated with the job's token;
- the environment a worker starts with (``xmig.jobenv.WorkerEnv``: torchrun's variables and
  ``XMIG_*``), the launcher's to the coordinator and agents (``XMIG_TOKEN``, ``XMIG_JOB_ID``);
- the job spec, as JSON: on the coordinator's stdin at start, and in the reply to
  ``agent_hello``; the coordinator's first stdout line (its address and store port);
- a hot spare's start line on its stdin (``xmig.agent.spare``: environment, script, args)
  and the one byte it writes to ``XMIG_SPARE_READY_FD`` when warm;
- a migrated worker's rejoin file (``Dump.rejoin_file``, written by the target agent once
  the process and its GPU state are back: its address, node and PID), and the CRIU images,
  read in place on one machine, in a shared folder or streamed between agents
  (``xmig.migrate.stream``, token-authenticated), with the moving rank's parking file
  (``xmig.worker.parking``, in ``xmig.paths.park_dir()``) where the target's machine lacks it;
- the job's c10d store (hosted by the coordinator), used only to build communicators, under
  the prefix ``xmig.ccl.store_namespace(token)``; the state pulled over a pair communicator
  is checked against the digest its sender announced here (``StateSent``/``StateAnnounced``);
- the job file (``~/.xmig/jobs/ID.json``, owner-only: coordinator address and token) that
  ``xmig status|inject|migrate|scale|stop`` read, and the job's folder (its event log, and the
  coordinator's snapshot that a restarted one reads: ``xmig.coord.snapshot``);
- with one launcher per host, a host's own launch from its launcher to its agent
  (``XMIG_HOST_LAUNCH``); a restarted coordinator's count (``XMIG_COORD_RESTART``);
- with an HA control plane, the etcd keys ``/xmig/JOB/leader`` (who leads, on its lease),
  ``/xmig/JOB/snapshot`` and, once the job has ended, ``/xmig/JOB/outcome``
  (``xmig.coord.etcd``), and the run's launch time to its coordinators (``XMIG_LAUNCHED_AT``).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


class Party(enum.Enum):
    """Who sends or receives a message."""

    LAUNCHER = "launcher"  # ``xmig run`` and the other commands of the CLI
    COORDINATOR = "coordinator"
    AGENT = "agent"
    WORKER = "worker"


class Relay(enum.Enum):
    """To which of its workers an agent hands a coordinator's order."""

    ALL = "all"
    RANK = "rank"


class ProtocolError(ValueError):
    """A frame that is not a message this receiver knows."""


# a message class: frozen, its equality and repr the base's (a dataclass's own cost half
# its making, and this module is imported by every process, a replacement's too, at its start)
wire = dataclass(frozen=True, eq=False, repr=False)


@wire
class Message:
    """Base of every message; subclasses are registered with ``@message``."""

    OP: ClassVar[str]
    SENDERS: ClassVar[frozenset[Party]]
    RECEIVER: ClassVar[Party]
    REQUEST: ClassVar[bool]  # the sender waits for a reply
    RELAY: ClassVar[Relay | None]  # a coordinator's order an agent hands to workers
    FORWARD: ClassVar[bool]  # a worker's report an agent hands to the coordinator

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values() == self._values()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # fields hold lists and dicts

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"


CATALOGUE: dict[str, type[Message]] = {}

L, C, A, W = Party.LAUNCHER, Party.COORDINATOR, Party.AGENT, Party.WORKER


def message(
    op: str,
    sender: Party | tuple[Party, ...],
    receiver: Party,
    *,
    request: bool = False,
    relay: Relay | None = None,
    forward: bool = False,
) -> Any:
    """Register a message class under ``op`` with its direction."""

    def register(cls: type[Message]) -> type[Message]:
        if op in CATALOGUE:
            raise ValueError(f"two messages named {op!r}")
        cls.OP = op
        cls.SENDERS = frozenset(sender if isinstance(sender, tuple) else (sender,))
        cls.RECEIVER = receiver
        cls.REQUEST = request
        cls.RELAY = relay
        cls.FORWARD = forward
        CATALOGUE[op] = cls
        return cls

    return register


# ---- records carried inside messages -------------------------------------------------------
@dataclass(frozen=True)
class FaultRecord:
    """A fault as detected: which rank, how, when, and whether it was injected."""

    rank: int
    node: int
    pid: int
    attempt: int
    kind: str  # signal, exit, hang, error, comm_error, agent_lost
    detail: str
    step: int | None
    t_fault: float
    t_detected: float
    fault_time_source: str  # injection, last_heartbeat or detection
    detected_after_s: float
    injected: dict[str, Any] | None = None
    generation: int | None = None  # the communicator generation a comm_error was seen in
    ranks: list[int] | None = None  # every rank lost with a node
    secondary: bool = False  # a consequence of another fault, not a cause
    # (comm_error) the ranks of the group whose collective failed, None where not known
    group: list[int] | None = None

    @property
    def lost_ranks(self) -> list[int]:
        return list(self.ranks) if self.ranks else [self.rank]


@dataclass(frozen=True)
class Position:
    """Where a parked survivor stands, for the coordinator's choice of step, source, mode."""

    step: int | None
    state_step: int | None  # the step whose start its state is
    log_from: int | None  # the first step it still holds the log of
    keep_log: bool
    signatures: dict[str, list[str]]  # step -> its logged ops' signatures
    pending: int = 0
    optimizer_waiting: bool = False
    ddp_layout: str | None = None  # digest of DDP's bucket layout
    ddp_layout_source: str = "root"  # how it came by it (xmig.state.ddp)
    # group -> step -> its logged ops' signatures, for each group but the world
    group_signatures: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    replicas: list[int] | None = None  # the ranks whose state is this rank's (None: all)
    # why this rank's world could not change size (a shrink is then impossible)
    cannot_resize: str | None = None


# ---- worker → agent ------------------------------------------------------------------------
@message("hello", W, A, request=True)
@wire
class Hello(Message):
    rank: int
    pid: int
    attempt: int


@message("hb", W, A)
@wire
class Heartbeat(Message):
    step: int | None
    t: float


@message("step", W, A)
@wire
class StepStarted(Message):
    step: int
    t: float


@message("injecting", W, A, request=True)
@wire
class Injecting(Message):
    """An injected fault is about to happen (its time is the fault's time)."""

    fault: dict[str, Any]
    step: int | None
    t: float


@message("error", W, A, request=True)
@wire
class WorkerError(Message):
    """An exception is about to end the worker."""

    error: str
    step: int | None
    t: float


@message("comm_error", W, A)
@wire
class CommError(Message):
    """A collective failed in a live worker; its proxy holds the framework. ``group``: the
    ranks of the group it failed in."""

    error: str
    step: int | None
    generation: int
    t: float
    group: list[int] | None = None


@message("ready_for_dump", W, A, request=True)
@wire
class ReadyForDump(Message):
    """The moving rank is ready to be checkpointed. ``gpu_bytes``: what its GPU holds now;
    ``held_bytes``: what it held before it parked ``parked_bytes`` of its tensors in
    ``host_files`` (``[path, size]`` each: files a restore elsewhere needs beside the images);
    ``dropped_bytes``: its replay log's copies of the steps before the pause, dropped."""

    gpu: str | None
    gpu_bytes: int
    t: float
    held_bytes: int = 0
    parked_bytes: int = 0
    host_files: list[Any] = field(default_factory=list)
    dropped_bytes: int = 0


@message("state_saved", W, A, request=True)
@wire
class StateSaved(Message):
    """After a ``SaveState``: this rank's state is in ``file`` (of ``step``), or ``error``."""

    file: str | None
    step: int | None
    error: str | None = None


@message("done", W, A, request=True)
@wire
class Done(Message):
    steps: int
    params_sha256: str | None
    checksum: str | None
    replicas: list[int] | None = None  # the ranks whose parameters must equal its (None: all)


# ---- worker → coordinator, forwarded by its agent (which sets ``rank``) ----------------------
@message("parked", W, C, forward=True)
@wire
class Parked(Message):
    generation: int
    position: Position
    rank: int = -1
    t: float = 0.0


@message("recovered", W, C, forward=True)
@wire
class Recovered(Message):
    """``replay_check``: a survivor's replay, as ``ReplayCheck.to_json()`` (how many of the
    done ops it re-issued came out with their first result, how many did not and which)."""

    generation: int
    role: str  # survivor or replacement
    phases: dict[str, float]
    pull: dict[str, Any] | None
    t_resumed: float
    replay_check: dict[str, Any] | None = None
    groups: dict[str, list[str]] | None = None  # a survivor's groups: rebuilt, kept
    rank: int = -1
    t: float = 0.0


@message("recovery_failed", W, C, forward=True)
@wire
class RecoveryFailed(Message):
    error: str
    rank: int = -1
    t: float = 0.0
    generation: int | None = None  # the recovery it failed (None: whatever is under way)


@message("replay_mismatched", W, C, forward=True)
@wire
class ReplayMismatched(Message):
    """A replacement's op differs from what its survivors logged: the step cannot be
    replayed (the replacement ends once the coordinator has answered)."""

    generation: int
    why: str
    rank: int = -1
    t: float = 0.0


@message("checkpoint_written", W, C, forward=True)
@wire
class CheckpointWritten(Message):
    """A writer's shard of a just-in-time checkpoint is on disk (``error``: it is not)."""

    generation: int
    shard: int
    file: str
    bytes: int
    sha256: str
    seconds: float
    objects: list[str]  # the registered objects' names
    first_step: int | None
    error: str | None = None
    rank: int = -1
    t: float = 0.0


@message("cannot_recover", W, C, forward=True)
@wire
class CannotRecover(Message):
    """Found before the first step: a layout no fault of this rank could be recovered in
    (no other rank holds its state). The job stops with ``why``."""

    why: str
    rank: int = -1
    t: float = 0.0


@message("prepared", W, C, forward=True)
@wire
class Prepared(Message):
    """After a ``Prepare``: the moving rank has room for ``room_bytes`` of its tensors outside
    its process (``ok``), or will move without (``error`` says why); it had begun ``step``."""

    generation: int
    ok: bool
    room_bytes: int = 0
    prepare_s: float = 0.0
    step: int | None = None
    error: str | None = None
    rank: int = -1
    t: float = 0.0


@message("paused", W, C, forward=True)
@wire
class Paused(Message):
    """The rank stopped at the start of ``step``, ``stop_s`` ago (its communicator aborted;
    the rank that moves has parked its tensors meanwhile, in ``park_s``)."""

    generation: int
    step: int
    rank: int = -1
    t: float = 0.0
    stop_s: float = 0.0
    park_s: float = 0.0
    # why this rank's world could not change size here (None: it could; see worker/resize.py)
    cannot_resize: str | None = None


@message("pause_refused", W, C, forward=True)
@wire
class PauseRefused(Message):
    """The rank has already begun the step it was to pause at: ``step`` is where it is."""

    generation: int
    step: int
    rank: int = -1
    t: float = 0.0


@message("rejoined", W, C, forward=True)
@wire
class Rejoined(Message):
    generation: int
    netns: int
    rank: int = -1
    t: float = 0.0
    unpark_s: float = 0.0  # its parked tensors copied back


@message("resumed", W, C, forward=True)
@wire
class Resumed(Message):
    generation: int
    rank: int = -1
    t: float = 0.0


@message("unreachable_faults", W, C, forward=True)
@wire
class UnreachableFaults(Message):
    total: int
    faults: list[dict[str, Any]]
    rank: int = -1
    t: float = 0.0


@message("state_sent", W, C, forward=True)
@wire
class StateSent(Message):
    """The serving rank's digest of the state it sent to ``target``."""

    generation: int
    target: int
    digest: str
    rank: int = -1
    t: float = 0.0


@message("verify", W, C, forward=True)
@wire
class Verify(Message):
    """A checksum of the rank's replica after a recovery (None: no replica to compare)."""

    generation: int
    step: int
    checksum: str | None
    replicas: list[int] | None = None  # the ranks whose parameters must equal its
    rank: int = -1
    t: float = 0.0


@message("not_bit_identical", W, C, forward=True)
@wire
class NotBitIdentical(Message):
    generation: int
    why: str
    rank: int = -1
    t: float = 0.0


# ---- agent → coordinator -------------------------------------------------------------------
@message("agent_hello", A, C, request=True)
@wire
class AgentHello(Message):
    """Reply: ``{"job": JobSpec JSON, "generation": int}``. ``launch``: what the agent's own
    launcher was given (``xmig.jobspec.HostLaunch`` JSON), on a host started by a launcher of
    its own; the coordinator refuses a host whose launch differs from the job's."""

    node: int
    pid: int
    netns: int | None
    launch: dict[str, Any] | None = None
    # an agent reconnecting to a restarted coordinator: the workers it holds, each
    # ``{"rank", "pid", "attempt", "step", "state"}`` (None: its first hello)
    workers: list[dict[str, Any]] | None = None
    lost_at: float | None = None  # when it saw the coordinator go (wall clock)
    machine: str = ""  # ``xmig.paths.machine_id``: agents that share it share their files


@message("agent_alive", A, C)
@wire
class AgentAlive(Message):
    pass


@message("node_dying", A, C, request=True)
@wire
class NodeDying(Message):
    """An injected node loss: the node's processes die right after the reply."""

    node: int
    fault: dict[str, Any]
    t: float


@message("worker_started", A, C)
@wire
class WorkerStarted(Message):
    rank: int
    node: int
    pid: int
    attempt: int
    t: float
    from_spare: bool
    container: str | None = None  # container mode: the ID of the container it runs in


@message("worker_joined", A, C)
@wire
class WorkerJoined(Message):
    """The worker connected to its agent (``xmig.init()``)."""

    rank: int
    pid: int
    attempt: int
    t: float


@message("spares", A, C)
@wire
class Spares(Message):
    node: int
    ready: int


@message("progress", A, C)
@wire
class Progress(Message):
    rank: int
    step: int


@message("worker_done", A, C)
@wire
class WorkerDone(Message):
    rank: int
    steps: int
    params_sha256: str | None
    checksum: str | None
    replicas: list[int] | None = None


@message("criu", A, C)
@wire
class CriuStatus(Message):
    node: int
    usable: bool
    detail: str
    gpus: list[str]


@message("worker_exited", A, C)
@wire
class WorkerExited(Message):
    """The worker exited with code 0 (a failure is a ``Fault``)."""

    rank: int
    pid: int
    t: float


@message("fault", A, C)
@wire
class Fault(Message):
    record: FaultRecord


@message("stopped", A, C)
@wire
class Stopped(Message):
    """Every worker of the node has been stopped and reaped."""

    node: int


@message("dumped", A, C)
@wire
class Dumped(Message):
    rank: int
    node: int
    generation: int
    ok: bool
    error: str | None = None
    pid: int | None = None
    dump_s: float = 0.0
    image_bytes: int = 0
    criu_stats: dict[str, float] = field(default_factory=dict)  # CRIU's account of the dump
    fds: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None
    gpu_bytes: int = 0
    gpu_checkpoint_s: float = 0.0
    gpu_times: dict[str, float] = field(default_factory=dict)
    gpus_before: list[str] = field(default_factory=list)
    interface: dict[str, Any] | None = None
    serve: list[Any] | None = None  # where the target agent fetches the images
    held_bytes: int = 0  # the worker's ReadyForDump's
    parked_bytes: int = 0
    dropped_bytes: int = 0
    host_files: list[Any] = field(default_factory=list)
    container: str | None = None  # container mode: the rank's container, checkpointed whole
    own_pid: int | None = None  # its PID as it saw it (in its container: its namespace's)
    steps: dict[str, float] = field(default_factory=dict)  # the agent's steps, seconds


@message("restored", A, C)
@wire
class Restored(Message):
    rank: int
    node: int
    generation: int
    ok: bool
    error: str | None = None
    pid: int | None = None
    restore_s: float = 0.0
    gpu_restore_s: float = 0.0
    transfer_s: float = 0.0
    gpu_times: dict[str, float] = field(default_factory=dict)
    to_gpu: str | None = None
    criu_stats: dict[str, float] = field(default_factory=dict)  # CRIU's account of the restore
    own_pid: int | None = None  # its PID as it sees it now (in its container: its namespace's)
    steps: dict[str, float] = field(default_factory=dict)  # the agent's steps, seconds


# ---- launcher / CLI → coordinator ----------------------------------------------------------
@message("wait_result", L, C, request=True)
@wire
class WaitResult(Message):
    """Subscribe to the job's outcome (a ``Result`` push). Reply: ``{"store_port": int}``
    (the c10d store's, which a host's launcher did not choose)."""


@message("stop", L, C, request=True)
@wire
class StopJob(Message):
    """Reply: ``{"stopping": bool}`` (False: the job was already ending)."""

    reason: str = "stopped by request"


@message("status", L, C, request=True)
@wire
class StatusRequest(Message):
    """Reply: ``{"status": {...}}``."""


@message("inject", L, C, request=True)
@wire
class InjectRequest(Message):
    """Reply: ``{"fault": str}``, or refused with why."""

    spec: str


@message("scale", L, C, request=True)
@wire
class ScaleRequest(Message):
    """Change the world size at a step boundary to ``world_size`` ranks, or (``add_node``)
    start one more node, whose ranks grow the world back toward its size (or which waits as
    a spare node). Reply: ``{"resize": str}``, or refused with why."""

    world_size: int = 0
    add_node: bool = False


@message("migrate", L, C, request=True)
@wire
class MigrateRequest(Message):
    """Reply: ``{"migration": str}``, or refused with why."""

    rank: int
    to: int | None = None


# ---- coordinator → launcher ----------------------------------------------------------------
@message("result", C, L)
@wire
class Result(Message):
    summary: dict[str, Any]


@message("start_node", C, L)
@wire
class StartNode(Message):
    """Start an agent for node ``node``, which joins the job (``xmig scale --add-node``,
    ``--inject add-node:``): the launcher that started every node's agent does it."""

    node: int


# ---- coordinator → agents ------------------------------------------------------------------
@message("respawn", C, A)
@wire
class Respawn(Message):
    rank: int
    generation: int
    local_rank: int
    attempt: int
    fired: list[dict[str, Any]]  # injected faults already carried out: not to fire again
    world_size: int = 0  # the world's size now (0: the launch's)
    # the launch rank whose injected faults the process carries (None: ``rank``; -1: none, a
    # rank a resize added): a resize renumbers ranks, and a fault names the rank it was
    # launched as
    launched_as: int | None = None


@message("restore", C, A)
@wire
class Restore(Message):
    generation: int
    rank: int
    pid: int
    images: str
    rejoin_file: str
    fetch: list[Any] | None
    local_rank: int
    attempt: int
    fds: dict[str, str]
    gpu: str | None
    gpus_before: list[str]
    interface: dict[str, Any] | None
    host_files: list[Any] = field(default_factory=list)  # [path, size]: fetched if missing
    container: str | None = None  # restore this container (its ID kept), not a bare process


@message("stop_workers", C, A)
@wire
class StopWorkers(Message):
    grace: float


@message("shutdown", C, A)
@wire
class Shutdown(Message):
    pass


# ---- agent → its workers ---------------------------------------------------------------------
@message("save_state", A, W)
@wire
class SaveState(Message):
    """The coordinator is lost: park, and write this rank's state into ``folder``."""

    folder: str


# ---- coordinator → workers, through their agents --------------------------------------------
@message("park", C, A, relay=Relay.ALL)
@wire
class Park(Message):
    generation: int
    replaced: list[int]
    shrink: bool = False  # the lost ranks are not replaced: each says if its world can shrink


@message("rebuild", C, A, relay=Relay.ALL)
@wire
class Rebuild(Message):
    """The recovery plan: resume at ``step`` by ``mode`` (replay or rollback), the state
    served to each rank in ``pulls`` by its entry in ``sources`` (a replica of its state),
    or by ``source``; a replay re-issues the logged ops from ``replay_from`` on."""

    generation: int
    mode: str
    step: int
    source: int
    pulls: list[int]
    why: str | None = None  # why not a replay
    verify_ready_order: bool = False
    sources: dict[str, int] = field(default_factory=dict)  # pulled rank -> its server
    # every rank reports its replica checksum at the boundary after this step: the latest any
    # survivor is in (ranks of other groups may be a step ahead of the resume step)
    check_after: int | None = None
    # a replay re-issues the logged ops from this step on (None: from ``step``): the step
    # before it when the survivors, past its update, wait in a collective issued after it
    replay_from: int | None = None

    def source_of(self, rank: int) -> int:
        return self.sources.get(str(rank), self.source)

    def served_by(self, rank: int) -> list[int]:
        """The ranks ``rank`` serves the state to, in order."""
        return [r for r in self.pulls if self.source_of(r) == rank]


@message("write_checkpoint", C, A, relay=Relay.ALL)
@wire
class WriteCheckpoint(Message):
    """To parked survivors: the fault cannot be recovered; each rank in ``writers`` writes
    its state as of the start of ``step`` as the shard named there, into ``folder``."""

    generation: int
    folder: str
    step: int
    writers: dict[str, int]  # rank -> the shard it writes

    def shard_of(self, rank: int) -> int | None:
        return self.writers.get(str(rank))


@message("end_rank", C, A)
@wire
class EndRank(Message):
    """End ``rank``'s process on this node (a replacement whose recovery was given up: a
    survivor may be waiting for it in a collective, which its end lets go)."""

    rank: int
    pid: int


@message("abort", C, A, relay=Relay.ALL)
@wire
class Abort(Message):
    reason: str


@message("prepare", C, A, relay=Relay.ALL)
@wire
class Prepare(Message):
    """To the rank about to move (the others ignore it): make room outside the process for
    its tensors while it still trains, then say ``Prepared``."""

    generation: int
    rank: int


@message("pause", C, A, relay=Relay.ALL)
@wire
class Pause(Message):
    generation: int
    step: int


@message("dump", C, A, relay=Relay.RANK)
@wire
class Dump(Message):
    generation: int
    rank: int
    images: str
    rejoin_file: str
    serve: bool


@message("shrink", C, A, relay=Relay.ALL)
@wire
class Shrink(Message):
    """A lost node's ranks have nowhere to run: every parked survivor finishes the step it
    is parked in without the network or an optimizer update, and pauses at the start of
    ``step``, where the world changes size (``Resize``). ``sources``: a survivor still in
    the step before (its peers had ended that step's collectives) to the survivor that
    serves it the state of ``step``'s start."""

    generation: int
    step: int
    sources: dict[str, int] = field(default_factory=dict)

    def served_by(self, rank: int) -> list[int]:
        """The ranks ``rank`` serves the state to, in order."""
        return sorted(int(r) for r, source in self.sources.items() if source == rank)


@message("resize", C, A, relay=Relay.ALL)
@wire
class Resize(Message):
    """Every rank is paused at the start of ``step``: the world becomes ``world_size``
    ranks. ``ranks[r]``: old rank r's new rank, or -1 for a rank that leaves (it ends).
    Each agent renumbers its workers before it relays this to them."""

    generation: int
    step: int
    world_size: int
    ranks: list[int]
    # a grow: each new rank (started by its agent meanwhile) -> the rank that serves it the
    # state of ``step``'s start
    sources: dict[str, int] = field(default_factory=dict)

    def served_by(self, rank: int) -> list[int]:
        """The new ranks ``rank`` serves the state to, in order."""
        return sorted(int(r) for r, source in self.sources.items() if source == rank)


@message("resume", C, A, relay=Relay.ALL)
@wire
class Resume(Message):
    """Every paused rank goes on at the old size, on communicators of ``communicators``'s
    generation (0: the pause's own; a later one where ranks that were started for a grow
    given up may still meet under the pause's)."""

    generation: int
    communicators: int = 0


@message("store_restarted", C, A, relay=Relay.ALL)
@wire
class StoreRestarted(Message):
    """The job's c10d store was started anew (by a restarted coordinator): each worker
    connects to it again before it builds its next communicators."""

    master_addr: str
    master_port: int


@message("release", C, A, relay=Relay.ALL)
@wire
class Release(Message):
    """Every rank has finished: a finished rank may exit."""


@message("state_digest", C, A, relay=Relay.ALL)
@wire
class StateAnnounced(Message):
    """To the rank that received state: the digest its sender announced."""

    generation: int
    rank: int
    source: int
    digest: str


@message("inject_fault", C, A, relay=Relay.RANK)
@wire
class InjectFault(Message):
    fault: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.fault["rank"])


# ---- encoding and decoding -----------------------------------------------------------------
def encode(msg: Message) -> dict[str, Any]:
    """The wire form of ``msg``."""
    return {"op": msg.OP, **fields_of(msg)}


def fields_of(msg: Message) -> dict[str, Any]:
    return {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def decode(frame: dict[str, Any], receiver: Party, sender: Party | None = None) -> Message:
    """The message a frame carries, for ``receiver`` (from ``sender`` when known)."""
    if not isinstance(frame, dict):
        raise ProtocolError(f"a message is a JSON object, not {type(frame).__name__}")
    op = frame.get("op")
    cls = CATALOGUE.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message {str(op)[:40]!r}")
    hop = (
        receiver == cls.RECEIVER
        or (
            receiver is Party.AGENT and cls.FORWARD  # a worker's report on its way
        )
        or (receiver is Party.WORKER and cls.RELAY is not None)
    )  # an order handed on
    if not hop:
        raise ProtocolError(f"{op!r} is not a message for the {receiver.value}")
    relayed = cls.RELAY is not None or cls.FORWARD  # handed on by an agent
    if sender is not None and sender not in cls.SENDERS and not (sender is Party.AGENT and relayed):
        raise ProtocolError(f"{op!r} cannot come from the {sender.value}")
    body = {k: v for k, v in frame.items() if k not in ("op", "id")}
    return _build(cls, body, op)


def _build(cls: type, body: Any, where: str) -> Any:
    return _checker(cls)(body, where)


Checker = Callable[[Any, str], Any]
# hint -> the function that checks a value against it: built once per hint, since decoding
# runs for every message the coordinator gets (1,024 ``parked`` at once at scale)
_CHECKERS: dict[Any, Checker] = {}


def _checker(hint: Any) -> Checker:
    checker = _CHECKERS.get(hint)
    if checker is None:
        checker = _CHECKERS[hint] = _compile(hint)
    return checker


def _wrong(hint: Any, value: Any, where: str) -> ProtocolError:
    name = getattr(hint, "__name__", hint)
    return ProtocolError(f"{where}: {type(value).__name__} is not {name}")


def _check(hint: Any, value: Any, where: str) -> Any:
    """``value`` if it has the type ``hint`` names (JSON's types), else ProtocolError."""
    return _checker(hint)(value, where)


def _compile(hint: Any) -> Checker:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(option) for option in typing.get_args(hint)]
        optional = type(None) in typing.get_args(hint)

        def union(value: Any, where: str) -> Any:
            if value is None and optional:
                return None
            for option in options:
                try:
                    return option(value, where)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{where}: {type(value).__name__} is not {hint}")

        return union
    if hint is Any:
        return lambda value, where: value
    if dataclasses.is_dataclass(hint):
        return _compile_dataclass(hint)
    if hint in _SCALARS:
        accepts = _SCALARS[hint]
        convert = float if hint is float else None

        def scalar(value: Any, where: str) -> Any:
            if not accepts(value):
                raise _wrong(hint, value, where)
            return convert(value) if convert is not None else value

        return scalar
    if origin is list or hint is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        item = _checker(item_hint)
        plain = _PLAIN.get(item_hint)

        def array(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise _wrong(hint, value, where)
            if plain is not None and all(plain(v) for v in value):
                return list(value)  # a copy at C speed: nothing to convert
            inner = f"{where}[]"
            return [item(v, inner) for v in value]

        return array
    if origin is dict or hint is dict:
        key_hint, item_hint = typing.get_args(hint) or (str, Any)
        key, item = _checker(key_hint), _checker(item_hint)

        def mapping(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise _wrong(hint, value, where)
            inner = f"{where}."
            return {key(k, where): item(v, inner) for k, v in value.items()}

        return mapping
    raise TypeError(f"cannot check {hint}")  # a hint this decoder was not taught


def _compile_dataclass(cls: type) -> Checker:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _checker(hints[f.name]),
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]  # fmt: skip
    known = {name for name, _, _ in fields}

    def build(body: Any, where: str) -> Any:
        if not isinstance(body, dict):
            raise ProtocolError(f"{where}: expected an object")
        if not known.issuperset(body):
            extra = sorted(set(body) - known)
            raise ProtocolError(f"{where}: unknown field {str(extra[0])[:40]!r}")
        values = {}
        for name, check, required in fields:
            if name not in body:
                if required:
                    raise ProtocolError(f"{where}: field {name!r} is missing")
                continue
            values[name] = check(body[name], f"{where}.{name}")
        return cls(**values)

    return build


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SCALARS: dict[Any, Callable[[Any], bool]] = {
    type(None): lambda value: value is None,
    bool: lambda value: isinstance(value, bool),
    int: _is_int,
    float: lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    str: lambda value: isinstance(value, str),
}
# item types a list of which json.loads gives as they are (float is not: an int becomes one)
_PLAIN: dict[Any, Callable[[Any], bool]] = {str: _SCALARS[str], int: _is_int,
                                            bool: _SCALARS[bool]}  # fmt: skip


def for_receiver(receiver: Party) -> list[type[Message]]:
    """The messages ``receiver`` handles itself."""
    return [cls for cls in CATALOGUE.values() if cls.RECEIVER is receiver]


__all__ = [
    "CATALOGUE",
    "FaultRecord",
    "Message",
    "Party",
    "Position",
    "ProtocolError",
    "Relay",
    "decode",
    "encode",
]
