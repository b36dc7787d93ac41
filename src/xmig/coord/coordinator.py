"""The coordinator process's machinery: the job's c10d store, the control server, timers, the
event log, and ONE thread that feeds events to the ``Job`` state machine in order and carries
out its orders. Every decision is the ``Job``'s (``xmig.coord.machine``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from xmig.coord.checkpoint import Sealed
from xmig.coord.etcd import ControlPlane, ControlPlaneError, Leader, Leadership, LostLeadership
from xmig.coord.eventlog import EventLog
from xmig.coord.machine import LIVE, Job, JobState
from xmig.coord.orders import (
    AgentLost,
    Finish,
    Note,
    Order,
    Refused,
    Reply,
    Say,
    Seal,
    Tick,
    ToAll,
    ToLaunchers,
    ToNode,
)
from xmig.coord.snapshot import (
    BOOKKEEPING_LAG_S,
    read_snapshot,
    restore,
    revision,
    snapshot,
    snapshot_path,
    write_snapshot,
)
from xmig.jobenv import LAUNCHED_AT
from xmig.jobspec import HostLaunch, JobSpec
from xmig.paths import job_folder
from xmig.protocol import (
    AgentAlive,
    AgentHello,
    Message,
    Party,
    ProtocolError,
    Result,
    Shutdown,
    StopWorkers,
    WaitResult,
    decode,
    encode,
)
from xmig.wire import Peer, Server, format_address, listening_socket, pack

CHECK_INTERVAL_S = 0.1  # how often deadlines and agents' silence are checked
# the leader's lease: a leader that dies is succeeded within about this long
LEADER_TTL_S = 2
LOST_LEAD_EXIT_CODE = 4
STORE_FAILED_EXIT_CODE = 5  # the job's c10d store could not start
REPLY_TIMEOUT_S = 30.0  # how long a request waits for the decision thread
# an agent that reads nothing of an order for this long is cut off (its node is then lost):
# the decision thread, which sends every order, is never held longer by one peer
PUSH_TIMEOUT_S = 5.0
ROLES = {"agent": Party.AGENT, "launcher": Party.LAUNCHER, "client": Party.LAUNCHER}

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    """An event waiting for the decision thread; a request's connection waits for ``done``."""

    event: Any
    peer: Peer | None = None
    reply: dict[str, Any] | None = None
    refused: str | None = None
    # only a request's connection waits (an Event a message costs the connection threads
    # most of their time at 1,024 ranks)
    done: threading.Event | None = None


@dataclasses.dataclass(frozen=True)
class _Closed:
    peer: Peer


class Coordinator:
    """Hosts the job's store and control server; applies events to the ``Job`` in order."""

    def __init__(self, spec: JobSpec, token: str, restart: int = 0) -> None:
        # c10d's store listens on every interface unless handed a socket: bound to the job's
        # address only, so that only the job's hosts reach it
        self._store_socket = listening_socket(spec.master_addr, spec.master_port)
        self.spec = dataclasses.replace(spec, master_port=self._store_socket.getsockname()[1])
        self.store: Any = None
        self.store_ready = threading.Event()
        threading.Thread(target=self._host_store, name="xmig-store", daemon=True).start()
        self.token = token
        # when this run was launched (``LAUNCHED_AT``): an ended job's outcome in etcd is
        # this run's if it ended later (a standby started near the end is still this run's)
        self.started_wall = float(os.environ.get(LAUNCHED_AT) or time.time())
        self.server = Server(spec.master_addr, spec.coord_port, token, self._handle,
                             on_close=self._on_close, name="coord")  # fmt: skip
        self.launch = HostLaunch.of(spec) if spec.multi_host else None
        self.snapshot_path = snapshot_path(job_folder(spec.job_id))
        # with an HA control plane: the etcd cluster, and this coordinator's lead once it won
        self.plane: ControlPlane | None = None
        self.leadership: Leadership | None = None
        self.leading = threading.Event()
        if spec.control_plane is not None:
            self.plane = ControlPlane(spec.control_plane, spec.job_id)
            self.plane.check()
        if restart:  # a predecessor died: take the job up from its snapshot
            data = read_snapshot(self.snapshot_path)
            self.job = restore(self.spec, data, time.time(), self.launch)
        else:
            self.job = Job(self.spec, started=time.time(), launch=self.launch)
        if self.plane is None:
            self.leading.set()
        self._revision: tuple[Any, ...] | None = None
        self._written = 0.0  # monotonic time of the last snapshot
        self.events_path = job_folder(spec.job_id) / "events.jsonl"
        self.events = EventLog(self.events_path)
        self.peers: dict[int, Peer] = {}  # node -> its agent's connection
        self.agent_seen: dict[int, float] = {}  # node -> monotonic time of its last message
        self.launchers: list[Peer] = []
        self.summary: dict[str, Any] | None = None
        self._lock = threading.Lock()  # launchers and summary, read by connection threads
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self.finished = threading.Event()

    def _host_store(self) -> None:
        """Serve the job's c10d store on its socket. Loading torch for it takes the
        coordinator about 2 s: done here, the job's agents and workers start meanwhile (a
        worker needs the store only at its rendezvous; a connection made before the store
        serves waits in the socket's backlog). A store that cannot start ends the
        coordinator: no rank could meet the others."""
        try:
            import torch.distributed as dist  # only the coordinator and workers load torch

            self.store = dist.TCPStore(
                self.spec.master_addr,
                self._store_socket.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=300),
                master_listen_fd=self._store_socket.fileno(),
                use_libuv=True,
            )
        except Exception as exc:  # any failure: the job cannot run
            log.error("the job's store could not be started on %s:%d: %s",
                      self.spec.master_addr, self.spec.master_port, exc)  # fmt: skip
            logging.shutdown()
            os._exit(STORE_FAILED_EXIT_CODE)
        self.store_ready.set()

    @property
    def address(self) -> str:
        return format_address(self.server.address)

    def lead(self, stop: threading.Event) -> bool:
        """(With an HA control plane.) Campaign until this coordinator leads the job, then
        take it up from the snapshot in etcd, if a predecessor left one; False if ``stop``
        came first. A leader whose lease runs out stops at once: its successor leads."""
        assert self.plane is not None
        me = Leader(address=self.address,
                    store=format_address((self.spec.master_addr, self.spec.master_port)),
                    pid=os.getpid(), since=time.time())  # fmt: skip
        leadership = self.plane.campaign(me, LEADER_TTL_S, stop)
        if leadership is None:
            return False
        self.leadership = leadership  # held from here: a SIGTERM gives it back (``__main__``)
        ended = self.plane.outcome(since=self.started_wall)
        if ended is not None:  # a standby that won after the job's end: nothing to lead
            log.info("job %s has ended already (%s): this coordinator stops",
                     self.spec.job_id, ended.get("status"))  # fmt: skip
            self.leadership = None
            leadership.resign()
            return False
        data = self.plane.get_snapshot()
        if data is not None:
            self.job = restore(self.spec, data, time.time(), self.launch, how="took over")
        else:
            self.job = Job(self.spec, started=time.time(), launch=self.launch)
        log.info("coordinator %d leads job %s%s", os.getpid(), self.spec.job_id,
                 f" (restart {self.job.restarts})" if data else "")  # fmt: skip

        def watch() -> None:
            leadership.lost.wait()
            if not self.finished.is_set():
                log.error("this coordinator lost the lead of the job: it stops")
                os._exit(LOST_LEAD_EXIT_CODE)

        threading.Thread(target=watch, name="xmig-lead", daemon=True).start()
        self.leading.set()
        return True

    @property
    def status(self) -> str:
        return self.job.state.value

    # ---- connection threads: decode, then post ----------------------------------------------
    def _handle(self, peer: Peer, frame: dict[str, Any]) -> dict[str, Any] | None:
        if not self.leading.is_set():
            raise ValueError("this coordinator does not lead the job (ask etcd which does)")
        role = ROLES.get(str(peer.info.get("role")))
        if role is Party.AGENT:
            self.agent_seen[int(peer.info.get("node", -1))] = time.monotonic()
        try:
            if role is None:
                raise ProtocolError(f"unknown role {str(peer.info.get('role'))[:20]!r}")
            msg = decode(frame, Party.COORDINATOR, role)
        except ProtocolError as exc:
            log.warning("warning: rejected a message from a %s: %s", peer.info.get("role"), exc)
            raise ValueError(f"rejected: {exc}") from None
        if isinstance(msg, AgentAlive):
            return None
        if isinstance(msg, WaitResult):
            with self._lock:
                self.launchers.append(peer)
                if self.summary is not None:
                    peer.push(encode(Result(summary=self.summary)))
            return {"store_port": self.spec.master_port}
        pending = _Pending(msg, peer, done=threading.Event() if msg.REQUEST else None)
        self._queue.put(pending)
        if pending.done is None:
            return None
        if not pending.done.wait(REPLY_TIMEOUT_S):
            raise ValueError("the coordinator did not decide in time")
        if pending.refused is not None:
            raise ValueError(pending.refused)
        return pending.reply or {}

    def _on_close(self, peer: Peer) -> None:
        if peer.info.get("role") == "agent":
            self._queue.put(_Pending(_Closed(peer)))

    # ---- the decision thread ----------------------------------------------------------------
    def run(self) -> None:
        """Apply events until the job has an outcome."""
        self.server.start()
        if self.job.restarts:
            self.events.write("coordinator_restarted", time.time(),
                              {"restart": self.job.restarts, "pid": os.getpid()})  # fmt: skip
        else:
            self.events.write("job", time.time(), {"to": "starting", "job_id": self.spec.job_id,
                                                   "world_size": self.spec.world_size})  # fmt: skip
        self._keep_snapshot()
        next_check = 0.0
        while not self.finished.is_set():
            wait = CHECK_INTERVAL_S
            due = self.job.next_deadline()
            if due is not None:
                wait = min(wait, max(0.0, due - time.time()))
            if self._queue.empty():  # idle: what was logged reaches the file now
                self.events.flush()
            try:
                pending = self._queue.get(timeout=wait)
            except queue.Empty:
                pass
            else:
                self._apply(pending)
            # deadlines are checked even while events keep coming (fast steps)
            if time.monotonic() >= next_check or (due is not None and time.time() >= due):
                next_check = time.monotonic() + CHECK_INTERVAL_S
                self._check_agents_alive()
                self._apply(_Pending(Tick()))
        self.events.close()

    def _apply(self, pending: _Pending) -> None:
        event = pending.event
        if isinstance(event, _Closed):
            node = int(event.peer.info.get("node", -1))
            if self.peers.get(node) is not event.peer:
                return
            event = AgentLost(node)
        if self.finished.is_set():
            pending.refused = "the job has ended"
            if pending.done is not None:
                pending.done.set()
            return
        try:
            orders = self.job.on(event, time.time())
        except Refused as exc:
            pending.refused = str(exc)
            orders = []
        if isinstance(event, AgentHello) and pending.refused is None:
            assert pending.peer is not None
            self.peers[event.node] = pending.peer
        # what was decided is kept before it is carried out: a successor never finds the
        # effects of a decision its snapshot does not know
        self._keep_snapshot()
        for order in orders:
            self._carry_out(order, pending)
        if isinstance(event, AgentLost):
            self.peers.pop(event.node, None)
        if pending.done is not None:
            pending.done.set()

    def _keep_snapshot(self) -> None:
        """Write what a restarted coordinator would need: before a decision is carried out,
        and the bookkeeping alone at most every ``BOOKKEEPING_LAG_S``."""
        now = revision(self.job)
        if now == self._revision:
            return
        decided = self._revision is None or now[0] != self._revision[0]
        if not decided and time.monotonic() < self._written + BOOKKEEPING_LAG_S:
            return
        self._written = time.monotonic()
        try:
            if self.plane is not None:
                assert self.leadership is not None
                self.plane.put_snapshot(self.leadership, snapshot(self.job))
            else:
                write_snapshot(self.snapshot_path, snapshot(self.job))
            self._revision = now
        except LostLeadership as exc:  # a successor leads: nothing more may be decided here
            log.error("this coordinator lost the lead of the job (%s): it stops", exc)
            self.events.flush()
            os._exit(LOST_LEAD_EXIT_CODE)
        except ControlPlaneError as exc:  # etcd unreachable for the call's whole deadline
            log.warning("warning: cannot write the job's snapshot to etcd: %s", exc)
        except OSError as exc:  # the job goes on; a restart would find an older one
            log.warning("warning: cannot write the coordinator's snapshot %s: %s",
                        self.snapshot_path, exc)  # fmt: skip

    def _carry_out(self, order: Order, pending: _Pending) -> None:
        if isinstance(order, ToAll):
            data = pack(encode(order.msg))  # once, not once an agent
            for node in sorted(self.job.agents):
                self._push(node, order.msg, data)
        elif isinstance(order, ToNode):
            self._push(order.node, order.msg)
        elif isinstance(order, Say):
            log.log(order.level, "%s", order.text)
            self.events.write("said", time.time(), {"text": order.text})
        elif isinstance(order, Note):
            self.events.write(order.event, time.time(), order.fields)
        elif isinstance(order, Reply):
            pending.reply = order.value
        elif isinstance(order, Finish):
            self._finish(order.summary)
        elif isinstance(order, Seal):
            self._queue.put(_Pending(self._seal(order)))
        elif isinstance(order, ToLaunchers):
            with self._lock:
                launchers = [p for p in self.launchers if p.info.get("role") == "launcher"]
            data = pack(encode(order.msg))
            pushed = [p.push_packed(data, within=PUSH_TIMEOUT_S) for p in launchers]
            if not any(pushed):
                log.warning("warning: no launcher took %s: %s", order.msg.OP, order.msg)
        else:  # pragma: no cover - the Job resolves every other order itself
            raise AssertionError(f"an order the coordinator cannot carry out: {order!r}")

    def _seal(self, order: Seal) -> Sealed:
        """Put the checkpoint's manifest in and rename it into place; how that went."""
        from xmig.state.checkpoint import seal

        try:
            seal(Path(order.partial), Path(order.final), order.manifest)
        except (OSError, ValueError) as exc:
            log.error("sealing the checkpoint %s failed: %s", order.final, exc)
            return Sealed(order.generation, f"{type(exc).__name__}: {exc}")
        return Sealed(order.generation)

    def _push(self, node: int, msg: Message, data: bytes | None = None) -> None:
        peer = self.peers.get(node)
        data = data if data is not None else pack(encode(msg))
        if peer is not None and peer.push_packed(data, within=PUSH_TIMEOUT_S):
            return
        if isinstance(msg, StopWorkers):  # it cannot stop anything: count it stopped
            self._queue.put(_Pending(AgentLost(node)))
        elif node in self.job.agents:
            log.debug("could not send %s to node %d", msg.OP, node)

    def _check_agents_alive(self) -> None:
        """An agent silent for longer than the heartbeat timeout is lost, connection or not."""
        if self.job.state not in LIVE or self.job.state is JobState.STARTING:
            return
        now = time.monotonic()
        for node, peer in list(self.peers.items()):
            seen = self.agent_seen.get(node)
            if seen is not None and now - seen > self.spec.heartbeat_timeout:
                self.agent_seen.pop(node, None)
                log.info("agent of node %d silent for %.1f s", node, now - seen)
                # should it come back: its node is given up
                peer.push_packed(pack(encode(Shutdown())), within=PUSH_TIMEOUT_S)
                self._queue.put(_Pending(AgentLost(node)))

    def _finish(self, summary: dict[str, Any]) -> None:
        summary["event_log"] = str(self.events_path)
        with self._lock:
            self.summary = summary
            launchers = list(self.launchers)
        self.events.write("outcome", time.time(), {"status": summary["status"],
                                                   "message": summary["message"]})  # fmt: skip
        shutdown, result = pack(encode(Shutdown())), pack(encode(Result(summary=summary)))
        for node in sorted(self.peers):
            self.peers[node].push_packed(shutdown, within=PUSH_TIMEOUT_S)
        for launcher in launchers:
            launcher.push_packed(result, within=PUSH_TIMEOUT_S)
        self.finished.set()
