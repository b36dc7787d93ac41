"""The node agent: spawns this node's workers and watches them (exit, heartbeat, errors)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import queue
import select
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmig.agent.containers import NodeContainers
from xmig.agent.spares import Spare, SparePool
from xmig.agent.zygote import Zygote
from xmig.agent.zygote import enabled as zygote_enabled
from xmig.container import runc
from xmig.container.process import ContainerProcess
from xmig.jobenv import COORD_ADDR, JOB_ID, JOIN_REFUSED_EXIT_CODE, TOKEN, WorkerEnv
from xmig.jobspec import HostLaunch, JobSpec
from xmig.migrate import criu, cuda, netif, stream
from xmig.migrate.mover import MigrationError, ProcessMover
from xmig.migrate.warm import MemoryWarmer, wanted_bytes
from xmig.paths import is_parking_file, machine_id
from xmig.procs import AdoptedProcess, die_with_parent, group_members, kill_group
from xmig.protocol import (
    CATALOGUE,
    AgentAlive,
    AgentHello,
    CommError,
    CriuStatus,
    Done,
    Dump,
    Dumped,
    EndRank,
    Fault,
    FaultRecord,
    Heartbeat,
    Hello,
    InjectFault,
    Injecting,
    Message,
    NodeDying,
    Party,
    Progress,
    ProtocolError,
    ReadyForDump,
    Relay,
    Resize,
    Respawn,
    Restore,
    Restored,
    SaveState,
    Shutdown,
    Spares,
    StateSaved,
    StepStarted,
    Stopped,
    StopWorkers,
    WorkerDone,
    WorkerError,
    WorkerExited,
    WorkerJoined,
    WorkerStarted,
    decode,
    encode,
    fields_of,
)
from xmig.state.checkpoint import lost_coordinator_folder
from xmig.wire import (
    AuthError,
    Client,
    Peer,
    RemoteError,
    Server,
    WireError,
    connect_retrying,
    format_address,
    parse_address,
)

log = logging.getLogger(__name__)


CONNECT_TIMEOUT_S = 10.0  # the coordinator is up before one launcher starts its agents
# (HA control plane) a leader etcd names that does not take the connection within this long
# has died too: etcd is asked again for its successor
LEADER_CONNECT_S = 3.0


class JoinRefused(Exception):
    """The job will not have this node (the message is the line to say)."""


@dataclass
class Worker:
    """One local rank's current process, as the agent sees it."""

    rank: int
    local_rank: int
    proc: subprocess.Popen | AdoptedProcess | ContainerProcess
    pidfd: int
    attempt: int
    # starting, running, done, faulted, stopping, migrating, leaving (a resize let it go), exited
    state: str = "starting"
    peer: Peer | None = None
    last_beat: float | None = None  # monotonic time of the last sign of life
    last_beat_wall: float | None = None
    step: int | None = None
    announced: dict[str, Any] | None = None  # the injected fault it said it is carrying out
    gpu: str | None = None  # the UUID of the GPU it holds state on, when it is moving
    gpu_bytes: int = 0  # how much of that GPU's memory it holds
    ready: ReadyForDump | None = None  # what it said when it was ready to be moved
    done: WorkerDone | None = None  # what it said when it finished (a new coordinator hears it)
    exited: WorkerExited | None = None  # and that it exited cleanly

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def container(self) -> str | None:
        """The ID of the container it runs in (container mode)."""
        return self.proc.container_id if isinstance(self.proc, ContainerProcess) else None

    @property
    def own_pid(self) -> int | None:
        """Its PID as it sees it (``getpid()``): in a container, its PID in the container's
        namespace (1, its init), else the same as ``pid``."""
        return self.proc.inner_pid if isinstance(self.proc, ContainerProcess) else self.pid


_PR_SET_CHILD_SUBREAPER = 36
NO_PID = -1  # a rank whose process could not be started


# ---- the agent's own events (besides the coordinator's orders) -----------------------------
@dataclass(frozen=True)
class ToCoordinator:
    """A message for the coordinator, sent from the main loop."""

    msg: Message


@dataclass(frozen=True)
class WorkerTrouble:
    """A live worker reported an error (``error``) or a failed collective (``comm_error``)."""

    rank: int
    pid: int
    kind: str
    detail: str
    wall: float
    step: int | None
    generation: int | None
    announced: dict[str, Any] | None = None  # the injected fault this report is (a raise)
    group: list[int] | None = None  # (comm_error) the ranks of the group it failed in


@dataclass(frozen=True)
class NodeLoss:
    """An injected node loss is about to happen."""

    fault: dict[str, Any]
    t: float


@dataclass(frozen=True)
class DumpNow:
    """The moving rank is quiet: checkpoint it."""

    rank: int


@dataclass(frozen=True)
class DumpFinished:
    result: Dumped


@dataclass(frozen=True)
class CoordLost:
    """The connection to the coordinator ended."""


@dataclass(frozen=True)
class CoordBack:
    """A coordinator answers at the job's address again (its launcher restarted it)."""

    client: Client


@dataclass(frozen=True)
class CoordGone:
    """No coordinator came back within the rejoin timeout."""

    why: str


def stdio_resources(fds: dict[str, str]) -> dict[int, str]:
    """For a worker's stdout/stderr on its old node (``/proc/PID/fd`` link targets), the CRIU
    resource each stands for: a pipe, a socket or a log file there; /dev/null and the like
    exist everywhere and need nothing."""
    resources: dict[int, str] = {}
    for fd, target in sorted(fds.items()):
        if target.startswith(("pipe:", "socket:")):
            resource = target
        elif target.startswith("/") and not target.startswith("/dev/"):
            resource = target.lstrip("/")  # CRIU names files by their path from the root
        else:
            continue
        if resource not in resources.values():
            resources[int(fd)] = resource
    return resources


def describe_exit(returncode: int) -> tuple[str, str]:
    """(kind, detail) for a worker's exit status: a signal or an exit code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return "signal", name
    return "exit", f"exit code {returncode}"


def workers_starting(workers: Iterable[Worker]) -> bool:
    """Whether a worker of these is still starting: it is up once it has begun a step.
    Before that it loads torch, builds its model and meets its peers, all of which a spare's
    warm-up would slow on a small node (``spares.spare_may_start``)."""
    return any(w.state == "starting" or (w.state == "running" and w.step is None)
               for w in workers)  # fmt: skip


class Agent:
    """Spawns and watches the workers of one node; reports every fault to the coordinator.

    All spawning and reaping happens on the thread that runs ``run()`` (the workers' death
    signal is tied to it); other threads only post events to it.
    """

    def __init__(self, coord_addr: tuple[str, int] | None, token: str, node_rank: int,
                 launch: HostLaunch | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 control_plane: str | None = None) -> None:  # fmt: skip
        # where the coordinator is; with an HA control plane, etcd says which one leads
        self.coord_addr = coord_addr or ("", 0)
        self.control_plane = control_plane
        self._leader: int | None = None  # the leadership (etcd revision) last joined
        self.token = token
        self.node_rank = node_rank
        self.launch = launch  # what this host's own launcher was given, if it has its own
        self.connect_timeout = connect_timeout
        self.workers: dict[int, Worker] = {}
        # processes of replaced workers that have not exited yet (still watched, then reaped)
        self.retired: list[Worker] = []
        # what dead workers had started, adopted by this agent (child subreaper): reaped here
        self._orphans: set[int] = set()
        self.fired: dict[int, list[dict[str, Any]]] = {}  # injected faults already carried out
        self._dump_orders: dict[int, tuple[Dump, float]] = {}  # and when it came
        self._job: JobSpec | None = None
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        # wants none until the job's spec says how many (then none again once stopping)
        self.spares = SparePool(self._selector, self._base_environ)
        self.mover = ProcessMover()
        self.containers: NodeContainers | None = None  # container mode: this node's
        # bare processes: forks this node's workers (``agent/zygote.py``); None in container
        # mode, with XMIG_ZYGOTE=0, and on a spare node until it has ranks to start
        self.zygote: Zygote | None = None
        self.server: Server | None = None
        self.coord: Client | None = None
        # the coordinator is lost: the ranks still saving their state, and until when
        self._saving: set[int] | None = None
        self._saving_until = 0.0
        # while the coordinator is away: what is for it, sent once one is back
        self._outbox: list[Message] | None = None
        self._reconnecting = False
        self._lost_at: float | None = None
        self._rejoin_deadline = 0.0  # (monotonic) until when a lost coordinator is waited for
        self._criu_status: CriuStatus | None = None
        # XMIG_WARM_MEMORY_GB: this host's memory written once, so that a move's is backed
        self.warmer: MemoryWarmer | None = None

    @property
    def job(self) -> JobSpec:
        """The job's spec, from the coordinator (known once ``run`` has said hello)."""
        if self._job is None:
            raise RuntimeError("the agent has no job spec before it said hello")
        return self._job

    # ---- events from other threads -------------------------------------------------------
    def _post(self, event: Any) -> None:
        self._events.put(event)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _on_coord_push(self, frame: dict[str, Any]) -> None:
        try:
            self._post(decode(frame, Party.AGENT, Party.COORDINATOR))
        except ProtocolError as exc:
            log.warning("warning: agent %d rejected a message from the coordinator: %s",
                        self.node_rank, exc)  # fmt: skip

    def _on_coord_lost(self) -> None:
        self._post(CoordLost())

    def _on_worker_message(self, peer: Peer, frame: dict[str, Any]) -> dict[str, Any] | None:
        rank = int(peer.info.get("rank", -1))
        try:
            msg = decode(frame, Party.AGENT, Party.WORKER)
        except ProtocolError as exc:
            log.warning("warning: agent %d rejected a message from rank %d: %s",
                        self.node_rank, rank, exc)  # fmt: skip
            raise ValueError(f"rejected: {exc}") from None
        now, wall = time.monotonic(), time.time()
        with self._lock:
            worker = self.workers.get(rank)
            if worker is None or worker.own_pid != int(peer.info.get("pid", -1)):
                # a worker renumbered by a resize keeps its connection, which says the rank
                # it had when it connected
                worker = next((w for w in self.workers.values() if w.peer is peer), None)
            if worker is None:
                raise ValueError(f"no worker with rank {rank} and that pid on this node")
            worker.last_beat, worker.last_beat_wall = now, wall
            if msg.FORWARD:  # a report for the coordinator: who sent it, its connection says
                self._post(ToCoordinator(dataclasses.replace(msg, rank=worker.rank)))  # type: ignore[call-arg]
                return {}
            WORKER_HANDLERS[type(msg)](self, worker, peer, msg, wall)
        return {}

    def _worker_hello(self, worker: Worker, peer: Peer, msg: Hello, wall: float) -> None:
        worker.peer = peer
        worker.state = "running"
        self._post(ToCoordinator(WorkerJoined(rank=worker.rank, pid=worker.pid,
                                              attempt=worker.attempt, t=wall)))  # fmt: skip

    def _worker_step(self, worker: Worker, peer: Peer, msg: Heartbeat | StepStarted,
                     wall: float) -> None:  # fmt: skip
        if msg.step is not None and msg.step != worker.step:
            worker.step = msg.step
            self._post(ToCoordinator(Progress(rank=worker.rank, step=msg.step)))

    def _worker_injecting(self, worker: Worker, peer: Peer, msg: Injecting, wall: float) -> None:
        worker.announced = {"fault": msg.fault, "t": msg.t, "step": msg.step}
        self.fired.setdefault(worker.rank, []).append(msg.fault)
        kind = msg.fault.get("kind")
        if kind == "node":
            self._post(NodeLoss(msg.fault, msg.t))
        elif kind in ("kill", "hang") and worker.container is not None:
            # a container's init cannot signal itself: this agent does it, from outside,
            # before the rank hears back (it waits for it where its fault is)
            kill_group(worker.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    def _worker_trouble(self, worker: Worker, peer: Peer, msg: CommError | WorkerError,
                        wall: float) -> None:  # fmt: skip
        kind = "comm_error" if isinstance(msg, CommError) else "error"
        generation = msg.generation if isinstance(msg, CommError) else None
        group = msg.group if isinstance(msg, CommError) else None
        # taken here, in the order the rank said things: a report the main loop reads only
        # after the rank announced a kill must not take that kill's announcement from its death
        announced = worker.announced
        if announced is not None and announced["fault"].get("kind") == "raise":
            worker.announced = None
        else:
            announced = None
        self._post(WorkerTrouble(worker.rank, worker.pid, kind, msg.error, wall, msg.step,
                                 generation, announced, group))  # fmt: skip

    def _worker_ready_for_dump(self, worker: Worker, peer: Peer, msg: ReadyForDump,
                               wall: float) -> None:  # fmt: skip
        worker.state = "migrating"  # its link closes next; that is not a fault
        worker.gpu = cuda.canonical_uuid(msg.gpu) if msg.gpu is not None else None
        worker.gpu_bytes = msg.gpu_bytes
        worker.ready = msg
        self._post(DumpNow(worker.rank))

    def _worker_done(self, worker: Worker, peer: Peer, msg: Done, wall: float) -> None:
        worker.state = "done"
        worker.done = WorkerDone(rank=worker.rank, steps=msg.steps,
                                 params_sha256=msg.params_sha256, checksum=msg.checksum,
                                 replicas=msg.replicas)  # fmt: skip
        self._post(ToCoordinator(worker.done))

    # ---- main loop ------------------------------------------------------------------------
    def _join(self) -> JobSpec:
        """Connect to the coordinator and say hello; the job's spec, as this host runs it.
        Raises ``JoinRefused`` with the one line to say when the job will not have this
        node."""
        if self.control_plane is not None:
            self._find_leader(self.connect_timeout)
        where = format_address(self.coord_addr)
        try:
            self.coord = connect_retrying(
                self.coord_addr, self.token, self.connect_timeout,
                info={"role": "agent", "node": self.node_rank, "pid": os.getpid()},
                on_push=self._on_coord_push, on_close=self._on_coord_lost,
            )  # fmt: skip
        except AuthError:
            raise JoinRefused(f"the coordinator at {where} refused node rank {self.node_rank}: "
                              "it does not hold this job's token") from None  # fmt: skip
        except WireError as exc:
            raise JoinRefused(f"cannot reach the coordinator at {where}: {exc}") from None
        netns = os.stat("/proc/self/ns/net").st_ino
        launch = self.launch.to_json() if self.launch is not None else None
        hello = AgentHello(node=self.node_rank, pid=os.getpid(), netns=netns, launch=launch,
                           machine=machine_id())  # fmt: skip
        try:
            reply = self.coord.call(hello.OP, **fields_of(hello))
        except RemoteError as exc:
            raise JoinRefused(f"the job refused this host: {exc}") from None
        job = JobSpec.from_json(reply["job"])
        if self.launch is not None:  # this host's own path to the script, and its folder
            job = dataclasses.replace(job, script=self.launch.script, cwd=self.launch.cwd)
        return job

    def run(self) -> int:
        self.server = Server("127.0.0.1", 0, self.token, self._on_worker_message, name="agent")
        self.server.start()
        # a restored (migrated) worker's restorer exits at once: the worker becomes ours
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
        self._start_warming()
        try:
            self._job = self._join()
        except (JoinRefused, WireError) as exc:
            log.error("node rank %d: %s", self.node_rank, exc)
            return JOIN_REFUSED_EXIT_CODE
        self.heartbeat_timeout = self.job.heartbeat_timeout
        self.spares.wanted = self.job.hot_spares
        if self.job.container is not None:
            self.containers = NodeContainers(self.job, self.node_rank)
            self.spares.in_container = self.containers.start_spare
        try:
            # a spare node's once it has ranks to start: a zygote warming up beside the
            # workers costs their start its CPU where nodes share a machine (simulated hosts)
            if self.node_rank < self.job.nnodes:
                self._start_zygote()
            return self._serve()
        finally:
            if self.warmer is not None:
                self.warmer.halt()
            if self.zygote is not None:
                self.zygote.stop()
            if self.containers is not None:
                left = self.containers.remove_all()
                if left:
                    log.info("agent %d removed containers %s", self.node_rank, left)

    def _start_warming(self) -> None:
        """Write this host's memory once in the background (``XMIG_WARM_MEMORY_GB``)."""
        try:
            wanted = wanted_bytes()
        except ValueError as exc:  # only a move's speed depends on it: the node still serves
            log.error("agent %d: %s; its memory is not warmed", self.node_rank, exc)
            return
        if wanted:
            self.warmer = MemoryWarmer(wanted, f"agent {self.node_rank}")
            self.warmer.start()

    def _serve(self) -> int:
        """The main loop: the workers started, then events until one ends the agent."""
        threading.Thread(target=self._keep_alive, name="xmig-alive", daemon=True).start()
        threading.Thread(target=self._report_criu, name="xmig-criu", daemon=True).start()
        nproc = self.job.nproc_per_node
        if self.node_rank < self.job.nnodes:  # a spare node starts idle
            for local_rank in range(nproc):
                self._spawn(self.node_rank * nproc + local_rank, local_rank, attempt=0)
        while True:
            timeout = 0.05
            for key, _ in self._selector.select(timeout):
                if key.fileobj == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif isinstance(key.data, Spare):
                    if self.spares.on_ready(key.data):
                        self._notify_spares()
                else:
                    self._reap(key.data)
            if self._orphans:
                self._reap_orphans()
            while True:
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    break
                result = EVENT_HANDLERS[type(event)](self, event)
                if result is not None:
                    return result
            if self._saving is not None:
                if self._saved_all():
                    return 1
                continue  # no heartbeat kills a rank that writes its state, no spare starts
            self._check_heartbeats()
            starting = workers_starting(self.workers.values())
            self.spares.keep(self.job.cwd, len(self.workers), starting)

    def _keep_alive(self) -> None:
        """Tell the coordinator this node lives, on a thread of its own (the main loop may
        be busy stopping workers)."""
        interval = self.job.heartbeat_interval
        while True:
            time.sleep(interval)
            try:
                assert self.coord is not None
                self.coord.notify(AgentAlive.OP)
            except WireError:
                continue  # a restarted coordinator takes the next one

    def _report_criu(self) -> None:
        usable, detail = criu.criu_status()
        if usable:
            log.debug("CRIU's kernel cache: %s", criu.keep_kdat_cache())
        gpus = cuda.node_gpus()
        self._post(ToCoordinator(CriuStatus(node=self.node_rank, usable=usable, detail=detail,
                                            gpus=gpus)))  # fmt: skip
        if gpus and usable:
            cuda.warm_nvml()  # a move asks NVML what its rank holds

    # ---- migration ----------------------------------------------------------------------------
    def _dump(self, rank: int, order: Dump, order_to_ready: float) -> None:
        """Checkpoint a paused worker that closed its connections (on a thread of its own);
        ``order_to_ready``: seconds from the order to the worker's word that it is ready."""
        worker = self.workers[rank]
        fds = {}
        for fd in (1, 2):  # pipes shared with the launcher: the target hands its own on
            with contextlib.suppress(OSError):
                fds[str(fd)] = os.readlink(f"/proc/{worker.pid}/fd/{fd}")
        failed = Dumped(rank=rank, node=self.node_rank, generation=order.generation, ok=False,
                        pid=worker.pid)  # fmt: skip
        try:
            # GPU memory first, then CRIU; its own interface is for the target node to take
            done = self.mover.checkpoint(worker.pid, order.images, worker.gpu,
                                         gpu_bytes=worker.gpu_bytes,
                                         interface=netif.rank_interface(rank),
                                         container=worker.container)  # fmt: skip
        except MigrationError as exc:
            self._post(DumpFinished(dataclasses.replace(failed, error=str(exc))))
            return
        worker.gpu_bytes = done.gpu_bytes
        ready = worker.ready
        host_files = list(ready.host_files) if ready is not None else []
        result = dataclasses.replace(
            failed, ok=True, dump_s=done.dump_s, image_bytes=done.image_bytes, fds=fds,
            criu_stats=done.criu_stats, steps={"wait_ready": order_to_ready, **done.steps},
            gpu=worker.gpu, gpu_bytes=done.gpu_bytes, gpu_checkpoint_s=done.gpu_checkpoint_s,
            gpu_times=done.gpu_times, gpus_before=list(done.gpus_before),
            interface=done.interface, host_files=host_files, container=worker.container,
            own_pid=worker.own_pid,
            held_bytes=ready.held_bytes if ready is not None else 0,
            parked_bytes=ready.parked_bytes if ready is not None else 0,
            dropped_bytes=ready.dropped_bytes if ready is not None else 0,
            serve=self._serve_images(order.images, host_files) if order.serve else None,
        )  # fmt: skip
        self._post(DumpFinished(result))

    def _serve_images(self, folder: str, host_files: list[Any]) -> list[Any]:
        """Offer the images (and the files the process maps, for a target that lacks them)
        to the target node's agent (once); remove the images when sent."""
        assert self.coord is not None
        host = self.coord.conn.sock.getsockname()[0]  # this node's address, as others see it
        limit = self.job.recovery_timeout
        server = stream.ImageServer(folder, self.token, host, timeout=limit,
                                    host_files=[str(path) for path, _ in host_files])  # fmt: skip

        def clean_up() -> None:
            server.sent.wait()
            shutil.rmtree(folder, ignore_errors=True)

        threading.Thread(target=clean_up, name="xmig-images-cleanup", daemon=True).start()
        return list(server.address)

    def _dump_finished(self, event: DumpFinished) -> None:
        result = event.result
        worker = self.workers[result.rank]
        if result.ok and worker.container is not None and self.containers is not None:
            self.containers.moved_away(worker.container)
        if result.ok:
            if worker.state != "exited":
                started = time.monotonic()
                self._reap(worker)  # CRIU ended it; its PID must be free for the restore
                result = dataclasses.replace(
                    result, steps={**result.steps, "reap": time.monotonic() - started}
                )
            del self.workers[result.rank]
        self._send(result)

    def _restore(self, order: Restore) -> None:
        """Bring a migrated worker back in this node (its network namespace) and adopt it."""
        rank, pid = order.rank, order.pid
        failed = Restored(rank=rank, node=self.node_rank, generation=order.generation, ok=False)
        if self.warmer is not None:
            self.warmer.halt()
        rejoin = Path(order.rejoin_file)
        transfer_s = 0.0
        if order.fetch:
            try:
                limit = self.job.recovery_timeout
                _, transfer_s = stream.fetch_images(tuple(order.fetch), self.token,
                                                    order.images, limit,
                                                    accept=is_parking_file)  # fmt: skip
            except stream.StreamError as exc:
                self._send(dataclasses.replace(failed, error=str(exc)))
                return
        assert self.server is not None
        worker = Worker(rank=rank, local_rank=order.local_rank, proc=AdoptedProcess(pid),
                        pidfd=-1, attempt=order.attempt)  # fmt: skip
        restore_tree = None
        if order.container is not None:  # its container, under the same ID, in this node
            containers = self.containers
            assert containers is not None, "a container moved to a node not in container mode"
            container = order.container

            def restore_tree() -> int:
                worker.proc, _ = containers.restore(container, order.images)
                return worker.pid

        with self._lock:
            self.workers[rank] = worker  # before it says hello (after its rejoin file, below)
        # the worker's output goes where this agent's goes (duplicates handed to criu)
        inherit = {os.dup(fd): res for fd, res in stdio_resources(order.fds).items()}
        try:
            # its interface taken over, CRIU, then its GPU memory onto this node's GPU
            done = self.mover.restore(order.images, pid, order.local_rank, gpu=order.gpu,
                                      gpus_before=order.gpus_before, interface=order.interface,
                                      inherit_fds=inherit, restore_tree=restore_tree)  # fmt: skip
        except MigrationError as exc:
            with self._lock:
                del self.workers[rank]
            self._send(dataclasses.replace(failed, error=str(exc)))
            return
        finally:
            for fd in inherit:
                os.close(fd)
        pid = worker.pid
        # only now, its GPU state back and its CUDA calls unlocked, may it go on: it waits
        # for this file (its first CUDA call takes its parked tensors back)
        partial = rejoin.with_suffix(".partial")
        where = {"agent_addr": format_address(self.server.address), "node": self.node_rank,
                 "agent_pid": os.getpid()}  # fmt: skip
        partial.write_text(json.dumps(where))
        os.replace(partial, rejoin)
        worker.pidfd = os.pidfd_open(pid)
        self._selector.register(worker.pidfd, selectors.EVENT_READ, worker)
        self._send(dataclasses.replace(
            failed, ok=True, pid=pid, restore_s=done.restore_s, gpu_restore_s=done.gpu_restore_s,
            transfer_s=transfer_s, gpu_times=done.gpu_times, to_gpu=done.to_gpu,
            own_pid=worker.own_pid, criu_stats=done.criu_stats, steps=done.steps,
        ))  # fmt: skip
        if not done.lazy:  # (a lazy restore's go once its pages are all handed over)
            # on a thread: removing a GPU rank's 1.9 GB of images from ext4's page cache took
            # 0.1 s, which this loop then did not spend on the rejoining worker (H100); what a
            # job's end cuts short, the launcher's cleanup removes. (The worker removes the
            # rejoin file.)
            threading.Thread(target=shutil.rmtree, args=(order.images,),
                             kwargs={"ignore_errors": True}, name="xmig-images-cleanup",
                             daemon=True).start()  # fmt: skip

    def _lose_node(self, event: NodeLoss) -> None:
        """An injected node loss: every process of this node dies at once, this agent too."""
        with contextlib.suppress(WireError):
            assert self.coord is not None
            dying = NodeDying(node=self.node_rank, fault=event.fault, t=event.t)
            self.coord.call(dying.OP, timeout=5.0, **fields_of(dying))
        log.warning("node %d going down (injected %s fault)", self.node_rank,
                    event.fault.get("kind"))  # fmt: skip
        for worker in [*self.workers.values(), *self.retired]:
            kill_group(worker.pid, signal.SIGKILL)
        self.spares.kill_groups()
        if self.zygote is not None and self.zygote.pid is not None:
            kill_group(self.zygote.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    # ---- the main loop's events, by type -------------------------------------------------------
    def _to_coordinator(self, event: ToCoordinator) -> None:
        self._send(event.msg)

    def _trouble(self, event: WorkerTrouble) -> None:
        worker = self.workers.get(event.rank)
        if worker is None or worker.pid != event.pid:
            return
        if event.kind == "error":
            if worker.state == "stopping":
                return
            worker.state = "faulted"
        self._report_fault(worker, event.kind, event.detail, event.wall, step=event.step,
                           generation=event.generation, announced=event.announced,
                           group=event.group)  # fmt: skip

    def _relay(self, order: Message) -> None:
        """A coordinator's order for every worker of this node that can hear it."""
        frame = encode(order)
        for worker in self.workers.values():
            if worker.peer is not None and worker.state in ("running", "done"):
                worker.peer.push(frame)

    def _resize(self, order: Resize) -> None:
        """The world changes size: this node's workers take their new ranks (their reports
        name those from now on), those that leave are let go (their exit is no news), and
        then every one of them hears it. A rank the resize adds (started for it: its rank is
        past the old world's) is already numbered in the new world, and needs no telling."""
        frame = encode(order)
        old_world = len(order.ranks)
        with self._lock:
            told = [w for w in self.workers.values() if w.rank < old_world
                    and w.peer is not None and w.state in ("running", "done")]  # fmt: skip
            staying: dict[int, Worker] = {}
            for rank, worker in self.workers.items():
                if old_world <= rank < order.world_size:
                    staying[rank] = worker
                    continue
                new = order.ranks[rank] if 0 <= rank < old_world else -1
                if new < 0:
                    if worker.state != "exited":
                        worker.state = "leaving"
                        self.retired.append(worker)
                    continue
                worker.rank = new
                staying[new] = worker
            self.fired = {order.ranks[r]: f for r, f in self.fired.items()
                          if 0 <= r < len(order.ranks) and order.ranks[r] >= 0}  # fmt: skip
            self.workers = staying
        log.info("agent %d: world of %d ranks from step %d; this node's ranks now %s",
                 self.node_rank, order.world_size, order.step, sorted(staying))  # fmt: skip
        for worker in told:
            assert worker.peer is not None
            worker.peer.push(frame)

    def _dump_order(self, order: Dump) -> None:
        if self.warmer is not None:  # the move needs the memory it holds now
            self.warmer.halt()
        worker = self.workers.get(order.rank)
        self._dump_orders[order.rank] = (order, time.monotonic())
        if worker is None or worker.peer is None or not worker.peer.push(encode(order)):
            self._send(Dumped(rank=order.rank, node=self.node_rank,
                              generation=order.generation, ok=False,
                              error="the rank is not connected to its agent"))  # fmt: skip

    def _dump_now(self, event: DumpNow) -> None:
        order, ordered = self._dump_orders.pop(event.rank)
        threading.Thread(target=self._dump, args=(event.rank, order, time.monotonic() - ordered),
                         name="xmig-dump", daemon=True).start()  # fmt: skip

    def _respawn(self, order: Respawn) -> None:
        old = self.workers.get(order.rank)
        if old is not None and old.state != "exited":
            # a replaced process must be gone (one that reported an error may still be
            # exiting); it stays watched until it is reaped
            old.state = "faulted"
            kill_group(old.pid, signal.SIGKILL)
            self.retired.append(old)
        known = self.fired.setdefault(order.rank, [])
        known.extend(f for f in order.fired if f not in known)
        self._spawn(order.rank, order.local_rank, attempt=order.attempt,
                    generation=order.generation, world_size=order.world_size or None,
                    launched_as=order.launched_as)  # fmt: skip

    def _end_rank(self, order: EndRank) -> None:
        worker = self.workers.get(order.rank)
        if worker is not None and worker.pid == order.pid and worker.state != "exited":
            worker.state = "faulted"  # its exit is no news
            kill_group(worker.pid, signal.SIGKILL)

    def _inject(self, order: InjectFault) -> None:
        worker = self.workers.get(order.rank)
        if worker is None or worker.peer is None or not worker.peer.push(encode(order)):
            log.warning("agent %d: could not deliver fault %s (the rank is not connected)",
                        self.node_rank, order.fault)  # fmt: skip

    def _stop_order(self, order: StopWorkers) -> None:
        self._stop_workers(order.grace)
        self._send(Stopped(node=self.node_rank))

    def _shutdown(self, order: Shutdown) -> int:
        self._stop_workers(0.0)
        return 0

    def _coord_lost(self, event: CoordLost) -> int | None:
        """The coordinator went away: wait for its launcher to start it again (the workers
        go on; what is for the coordinator waits), or, if the job restarts none, save."""
        if self._saving is not None or self._reconnecting:
            return None  # saving or waiting already
        if self._job is not None and self._job.coordinator_restarts > 0:
            self._reconnecting = True
            self._lost_at = time.time()
            self._rejoin_deadline = time.monotonic() + self._job.rejoin_timeout
            if self._outbox is None:
                self._outbox = []
            log.warning("agent %d lost the coordinator; waiting up to %.0f s for it to be "
                        "restarted", self.node_rank, self._job.rejoin_timeout)  # fmt: skip
            threading.Thread(target=self._reconnect, name="xmig-rejoin", daemon=True).start()
            return None
        return self._save_states(CoordGone("the job restarts no coordinator"))

    def _find_leader(self, within: float) -> None:
        """Which coordinator leads the job now (another one than last time), from etcd."""
        from xmig.coord.etcd import ControlPlane, ControlPlaneError

        assert self.control_plane is not None
        plane = ControlPlane(self.control_plane, os.environ.get(JOB_ID, ""))
        try:
            leader = plane.wait_leader(within, other_than=self._leader)
        except ControlPlaneError as exc:
            raise WireError(str(exc)) from None
        finally:
            plane.close()
        self.coord_addr, self._leader = parse_address(leader.address), leader.revision

    def _reconnect(self) -> None:
        """(On a thread of its own.) Reach the coordinator again within the rejoin timeout.
        With an HA control plane, etcd names the leader; one that dies before this agent is
        back with it is passed over for its successor."""
        while True:
            left = self._rejoin_deadline - time.monotonic()
            try:
                within = left
                if self.control_plane is not None:  # a standby takes over: etcd says which
                    self._find_leader(max(0.1, left))
                    within = min(max(0.1, self._rejoin_deadline - time.monotonic()),
                                 LEADER_CONNECT_S)  # fmt: skip
                client = connect_retrying(
                    self.coord_addr, self.token, within,
                    info={"role": "agent", "node": self.node_rank, "pid": os.getpid()},
                    on_push=self._on_coord_push, on_close=self._on_coord_lost,
                )  # fmt: skip
            except WireError as exc:
                if self.control_plane is None or time.monotonic() >= self._rejoin_deadline:
                    self._post(CoordGone(str(exc)))
                    return
                log.info("agent %d: the leader etcd named is gone too (%s): asking for its "
                         "successor", self.node_rank, exc)  # fmt: skip
                continue
            self._post(CoordBack(client))
            return

    def _coord_back(self, event: CoordBack) -> int | None:
        """Say hello again with the workers this node holds, then what waited for it."""
        self.coord = event.client
        held = [{"rank": w.rank, "pid": w.pid, "attempt": w.attempt, "step": w.step,
                 "state": w.state} for w in self.workers.values()]  # fmt: skip
        launch = self.launch.to_json() if self.launch is not None else None
        hello = AgentHello(node=self.node_rank, pid=os.getpid(),
                           netns=os.stat("/proc/self/ns/net").st_ino, launch=launch,
                           workers=held, lost_at=self._lost_at,
                           machine=machine_id())  # fmt: skip
        try:
            reply = self.coord.call(hello.OP, timeout=30.0, **fields_of(hello))
        except (RemoteError, WireError) as exc:
            self.coord.close()
            if self.control_plane is not None and time.monotonic() < self._rejoin_deadline:
                # the leader died before it answered (or no longer leads): its successor
                log.info("agent %d: the leader did not take it back (%s): asking etcd again",
                         self.node_rank, exc)  # fmt: skip
                threading.Thread(target=self._reconnect, name="xmig-rejoin",
                                 daemon=True).start()  # fmt: skip
                return None
            return self._coord_gone(CoordGone(f"the restarted coordinator refused it: {exc}"))
        # another coordinator may host the job's store elsewhere: where later workers find it
        job = JobSpec.from_json(reply["job"])
        self._job = dataclasses.replace(self.job, master_addr=job.master_addr,
                                        master_port=job.master_port)  # fmt: skip
        log.warning("agent %d rejoined the restarted coordinator", self.node_rank)
        outbox, self._outbox, self._reconnecting = self._outbox or [], None, False
        if self._criu_status is not None and not any(isinstance(m, CriuStatus) for m in outbox):
            outbox.insert(0, self._criu_status)
        outbox.append(Spares(node=self.node_rank, ready=self.spares.ready_count))
        # what finished ranks said went to the coordinator that died (not kept in its snapshot)
        for worker in self.workers.values():
            outbox += [m for m in (worker.done, worker.exited)
                       if m is not None and not any(m is k for k in outbox)]  # fmt: skip
        for msg in outbox:
            self._send(msg)
        return None

    def _coord_gone(self, event: CoordGone) -> int | None:
        log.error("agent %d: no coordinator came back: %s", self.node_rank, event.why)
        self._reconnecting = False
        return self._save_states(event)

    def _save_states(self, event: CoordGone) -> int | None:
        """No coordinator can decide any more: this node's ranks save their own state (the
        launcher makes one checkpoint of what every node's saved), then they stop."""
        if self._saving is not None:
            return None  # saving already
        job = self._job
        live = [w for w in self.workers.values()
                if w.peer is not None and w.state in ("running", "done")]  # fmt: skip
        if job is None or job.checkpoint_dir is None or not live:
            log.error("agent %d lost the coordinator; stopping its workers", self.node_rank)
            self._stop_workers(0.0)
            return 1
        ranks = sorted(w.rank for w in live)
        log.error("agent %d lost the coordinator; ranks %s save their state", self.node_rank,
                  ranks)  # fmt: skip
        self.spares.wanted = 0
        order = encode(SaveState(folder=lost_coordinator_folder(job.checkpoint_dir,
                                                                job.job_id)))  # fmt: skip
        with self._lock:
            self._saving = set(ranks)
        self._saving_until = time.monotonic() + job.recovery_timeout
        for worker in live:
            worker.peer.push(order)  # type: ignore[union-attr]
        return None

    def _worker_saved(self, worker: Worker, peer: Peer, msg: StateSaved, wall: float) -> None:
        # (the connection's thread holds the agent's lock while it hands a message on)
        if self._saving is not None:
            self._saving.discard(worker.rank)
        if msg.error:
            log.error("rank %d could not save its state: %s", worker.rank, msg.error)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")  # the main loop looks again

    def _saved_all(self) -> bool:
        """Every rank saved (or ended, or the time is up): the workers are stopped."""
        with self._lock:
            saving = set(self._saving or ())
        waiting = {r for r in saving
                   if (w := self.workers.get(r)) is not None and w.state != "exited"}  # fmt: skip
        late = time.monotonic() > self._saving_until
        if waiting and not late:
            return False
        if waiting:
            log.error("agent %d: ranks %s did not save their state in time", self.node_rank,
                      sorted(waiting))  # fmt: skip
        self._stop_workers(0.0)
        return True

    def _send(self, msg: Message) -> None:
        if isinstance(msg, CriuStatus):
            self._criu_status = msg
        if self._outbox is not None:  # the coordinator is away: it gets this when back
            self._outbox.append(msg)
            return
        assert self.coord is not None
        try:
            self.coord.notify(msg.OP, **fields_of(msg))
        except WireError:
            self._outbox = [msg]
            self._post(CoordLost())

    # ---- workers --------------------------------------------------------------------------
    def _spawn(self, rank: int, local_rank: int, attempt: int, generation: int = 0,
               world_size: int | None = None,
               launched_as: int | None = None) -> Worker | None:  # fmt: skip
        job = self.job
        assert self.server is not None
        env = WorkerEnv.for_rank(job, rank, local_rank, node_rank=self.node_rank,
                                 token=self.token, agent_addr=format_address(self.server.address),
                                 attempt=attempt, generation=generation,
                                 fired=self.fired.get(rank, []), world_size=world_size,
                                 launched_as=launched_as)  # fmt: skip
        environ = self._base_environ()
        environ.update(env.to_environ())
        interface = netif.rank_interface(rank)
        if netif.exists(interface):  # the rank's own, which moves with it (simulated hosts)
            environ["NCCL_SOCKET_IFNAME"] = f"={interface}"
        if self.containers is not None:
            environ = self.containers.env(environ)
        proc = self.spares.take(environ, job) if attempt > 0 else None
        from_spare = proc is not None
        if from_spare:
            self._notify_spares()
        elif self.containers is not None:
            try:
                proc = self.containers.start_worker(rank, attempt, environ)
            except runc.RuncError as exc:
                self._not_started(rank, local_rank, attempt, f"its container did not start: {exc}")
                return None
        else:
            proc = self._fork_worker(environ)
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, job.script, *job.args],
                cwd=job.cwd,
                env=environ,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        pidfd = os.pidfd_open(proc.pid)
        worker = Worker(rank=rank, local_rank=local_rank, proc=proc, pidfd=pidfd, attempt=attempt)
        with self._lock:
            self.workers[rank] = worker
        self._selector.register(pidfd, selectors.EVENT_READ, worker)
        self._send(WorkerStarted(rank=rank, node=self.node_rank, pid=proc.pid, attempt=attempt,
                                 t=time.time(), from_spare=from_spare,
                                 container=worker.container))  # fmt: skip
        return worker

    def _start_zygote(self) -> None:
        if self.zygote is None and self.containers is None and zygote_enabled():
            self.zygote = Zygote(self._base_environ(), self.job.cwd)

    def _fork_worker(self, environ: dict[str, str]) -> AdoptedProcess | None:
        """A worker forked from this node's zygote (started now on a spare node's first
        rank: one interpreter's imports for all the ranks of a lost node), or None."""
        self._start_zygote()
        if self.zygote is None:
            return None
        job = self.job
        forked = self.zygote.fork(environ, job.script, job.args, job.cwd)
        self._orphans.update(self.zygote.abandoned)  # reaped by the main loop
        self.zygote.abandoned.clear()
        return forked

    def _not_started(self, rank: int, local_rank: int, attempt: int, why: str) -> None:
        """A rank's process could not even be started: to the coordinator, a process that
        ended at once (it is recovered, or stops the job, as a rank that dies does)."""
        log.error("agent %d: rank %d %s", self.node_rank, rank, why)
        now = time.time()
        never = Worker(rank=rank, local_rank=local_rank, proc=AdoptedProcess(NO_PID), pidfd=-1,
                       attempt=attempt, state="exited")  # fmt: skip
        self._send(WorkerStarted(rank=rank, node=self.node_rank, pid=NO_PID, attempt=attempt,
                                 t=now, from_spare=False))  # fmt: skip
        self._report_fault(never, "exit", why, now)

    def _base_environ(self) -> dict[str, str]:
        """What every worker of this node (and every spare) starts with."""
        job = self.job
        environ = dict(os.environ)
        environ["LOCAL_WORLD_SIZE"] = str(job.nproc_per_node)
        environ[COORD_ADDR] = format_address(self.coord_addr)
        environ[JOB_ID] = job.job_id
        environ[TOKEN] = self.token
        set_worker_defaults(environ, job.world_size, gpu_gate=job.gpu_gate)
        return environ

    # ---- hot spares ---------------------------------------------------------------------------
    def _notify_spares(self) -> None:
        self._send(Spares(node=self.node_rank, ready=self.spares.ready_count))

    def _reap(self, worker: Worker) -> None:
        """A worker's process has exited (its pidfd is readable): end what it started, reap
        it, and report how it ended unless that is already known."""
        rank = worker.rank
        if worker.state != "migrating":  # CRIU ended a moving one: its group moves with it
            self._end_group(worker)
        returncode = worker.proc.wait()
        detected = time.time()
        self._selector.unregister(worker.pidfd)
        os.close(worker.pidfd)
        if worker in self.retired:
            self.retired.remove(worker)
        previous, worker.state = worker.state, "exited"
        if previous in ("stopping", "faulted", "migrating", "leaving") \
                or self.workers.get(rank) is not worker:  # fmt: skip
            return
        if returncode != 0 and previous == "done":
            kind, detail = describe_exit(returncode)
            log.warning("rank %d finished its steps, then exited with %s", rank, detail)
            returncode = 0
        if returncode == 0:
            worker.exited = WorkerExited(rank=rank, pid=worker.pid, t=detected)
            self._send(worker.exited)
            return
        kind, detail = describe_exit(returncode)
        self._report_fault(worker, kind, detail, detected)

    def _report_fault(
        self,
        worker: Worker,
        kind: str,
        detail: str,
        detected: float,
        step: int | None = None,
        generation: int | None = None,
        announced: dict[str, Any] | None = None,
        group: list[int] | None = None,
    ) -> None:
        """To the coordinator: the worker's fault. A report it sent carries the announcement
        it followed (``announced``); a death or a hang takes the one the worker left."""
        if announced is None and kind not in ("error", "comm_error"):
            announced, worker.announced = worker.announced, None
        if announced is not None:
            t_fault, source = announced["t"], "injection"
        elif kind == "hang" and worker.last_beat_wall is not None:
            t_fault, source = worker.last_beat_wall, "last_heartbeat"
        else:
            t_fault, source = detected, "detection"
        if step is None:
            step = announced["step"] if announced is not None else worker.step
        record = FaultRecord(
            rank=worker.rank, node=self.node_rank, pid=worker.pid, attempt=worker.attempt,
            kind=kind, detail=detail, step=step,
            injected=announced["fault"] if announced is not None else None,
            t_fault=t_fault, t_detected=detected, fault_time_source=source,
            detected_after_s=round(max(0.0, detected - t_fault), 6), generation=generation,
            group=group,
        )  # fmt: skip
        self._send(Fault(record=record))

    def _end_group(self, worker: Worker) -> None:
        """Kill every process the worker started that is still in its process group (before
        the worker is reaped: its PID then still names the group); they come to this agent
        as orphans and are reaped in the main loop."""
        self._orphans.update(p for p in group_members(worker.pid) if p != worker.pid)
        kill_group(worker.pid, signal.SIGKILL)

    def _reap_orphans(self) -> None:
        for pid in list(self._orphans):
            try:
                reaped, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not (yet) this agent's child: wait until it is gone
                reaped = 0 if os.path.exists(f"/proc/{pid}") else pid
            if reaped:
                self._orphans.discard(pid)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if worker.state != "running" or worker.last_beat is None:
                continue
            if now - worker.last_beat > self.heartbeat_timeout:
                detected = time.time()
                worker.state = "faulted"
                silent = now - worker.last_beat
                # a hung rank is killed so that its peers' collectives fail fast
                self._kill(worker, signal.SIGKILL)
                self._report_fault(worker, "hang", f"no heartbeat for {silent:.2f} s", detected)

    @staticmethod
    def _kill(worker: Worker, sig: int) -> None:
        """Signal the worker and the processes it started (its process group)."""
        kill_group(worker.pid, sig)
        if sig != signal.SIGKILL:
            kill_group(worker.pid, signal.SIGCONT)  # a stopped process must run to die

    def _stop_workers(self, grace: float) -> None:
        """Stop every worker of this node and what they started: SIGTERM to each process
        group, SIGKILL after ``grace``; every worker is reaped before this returns."""
        self.spares.stop()  # and it starts no more: a stopping job needs none
        if self.zygote is not None:
            self.zygote.stop()
        live = [w for w in [*self.workers.values(), *self.retired] if w.state != "exited"]
        for worker in live:
            worker.state = "stopping"
            self._kill(worker, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for worker in live:  # until it has exited (not reaped: its PID still names its group)
            if worker.pidfd >= 0:
                select.select([worker.pidfd], [], [], max(0.0, deadline - time.monotonic()))
        for worker in live:
            self._end_group(worker)  # the worker too, if it outlived the grace
        for worker in live:
            try:
                worker.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", worker.pid)
                continue
            try:
                self._selector.unregister(worker.pidfd)
                os.close(worker.pidfd)
            except (KeyError, ValueError, OSError):
                pass
            worker.state = "exited"
        self.retired.clear()


# a worker's message type -> the agent's handler (a report for the coordinator is forwarded)
WORKER_HANDLERS: dict[type[Message], Callable[..., None]] = {
    Hello: Agent._worker_hello,
    Heartbeat: Agent._worker_step,
    StepStarted: Agent._worker_step,
    Injecting: Agent._worker_injecting,
    CommError: Agent._worker_trouble,
    WorkerError: Agent._worker_trouble,
    ReadyForDump: Agent._worker_ready_for_dump,
    Done: Agent._worker_done,
    StateSaved: Agent._worker_saved,
}
# an event of the main loop (a coordinator's order or the agent's own) -> its handler; a
# handler that returns an int ends the agent with that exit code
EVENT_HANDLERS: dict[type, Callable[..., int | None]] = {
    **{cls: Agent._relay for cls in CATALOGUE.values() if cls.RELAY is Relay.ALL},
    Dump: Agent._dump_order,
    Resize: Agent._resize,
    InjectFault: Agent._inject,
    EndRank: Agent._end_rank,
    Respawn: Agent._respawn,
    Restore: Agent._restore,
    StopWorkers: Agent._stop_order,
    Shutdown: Agent._shutdown,
    ToCoordinator: Agent._to_coordinator,
    WorkerTrouble: Agent._trouble,
    NodeLoss: Agent._lose_node,
    DumpNow: Agent._dump_now,
    DumpFinished: Agent._dump_finished,
    CoordLost: Agent._coord_lost,
    CoordBack: Agent._coord_back,
    CoordGone: Agent._coord_gone,
}


def set_worker_defaults(environ: dict[str, str], world_size: int, gpu_gate: bool = False
                        ) -> None:  # fmt: skip
    """The settings every worker gets unless the job's environment has its own."""
    environ.setdefault("PYTHONUNBUFFERED", "1")
    if gpu_gate:
        # CUDA loads a kernel's module at its first launch (lazy loading, CUDA's default),
        # and that load waits for the whole device, which waits for a shut gate: measured
        # on an H200, the replay's first comparison kernel never launched, and with every
        # module loaded at start the same recovery ended in 0.18 s, bit-identical
        environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    if world_size > 1:
        # as torchrun does, but for every multi-rank job: all simulated nodes share this
        # machine, and a rank's numerics must not depend on how ranks map to nodes
        environ.setdefault("OMP_NUM_THREADS", "1")
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        # a moving GPU rank frees its parked tensors' memory for good only where no live
        # block shares a segment with them: measured at 18 GB, the driver's checkpoint
        # carries 1.0 GB instead of 1.6 GB, and no steady-state cost was seen
        # (bench/results/gpu-speed.md)
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
