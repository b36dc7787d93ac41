"""``xmig run``: start the coordinator and one agent per node, wait for the outcome."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from xmig.coord.checkpoint import saved_states_complete, seal_saved_states
from xmig.coord.migration import job_images
from xmig.jobenv import (
    COORD_RESTART,
    HOST_LAUNCH,
    JOB_ID,
    JOIN_REFUSED_EXIT_CODE,
    LAUNCHED_AT,
    TOKEN,
)
from xmig.jobspec import HostLaunch, JobSpec
from xmig.launch.hosts import HostSetupError, SimulatedHosts
from xmig.paths import job_folder, jobs_dir, parking_files
from xmig.procs import die_with_parent, kill_pids, stop_process, wait_gone
from xmig.protocol import Party, ProtocolError, StartNode, decode
from xmig.state.checkpoint import lost_coordinator_folder
from xmig.wire import (
    AuthError,
    Client,
    RemoteError,
    WireError,
    connect_retrying,
    format_address,
    parse_address,
)

COORDINATOR_START_TIMEOUT_S = 120.0
# (HA control plane) a leader etcd names that does not take the connection within this long
# has died too: etcd is asked again for its successor
LEADER_CONNECT_S = 3.0
LEADER_EXIT_S = 5.0  # how long a leader whose connection ended is given to be reaped
COORDINATOR_PING_S = 2.0  # how often a launcher asks the coordinator it started how it is
# a coordinator that has not answered for this long (at least; five heartbeat timeouts) is
# hung (its decision thread stuck, its process stopped): it is killed and started again
COORDINATOR_STALL_MIN_S = 10.0
SHUTDOWN_TIMEOUT_S = 15.0
SAVE_SLACK_S = 10.0  # beyond the ranks' time to save, for the agents to stop them and end
# create_time() adds the boot time, which the kernel derives from the wall clock: a clock
# step moves it, by a second or so under NTP, so a start time matches within this
START_TIME_TOLERANCE_S = 1.0

log = logging.getLogger(__name__)


class LaunchError(Exception):
    """Bad input or a job that could not start: printed as one line, exit code 2."""


@dataclass
class JobFile:
    job_id: str
    coordinator: str
    token: str
    launcher_pid: int
    launcher_started: float | None = None  # the launcher's create_time(), against PID reuse
    host: str | None = None  # the machine of the launcher (a shared home holds others')

    @classmethod
    def load(cls, path: Path) -> JobFile:
        return cls(**json.loads(path.read_text()))

    @property
    def elsewhere(self) -> bool:
        """Written by a launcher on another machine, whose processes this one cannot see."""
        return self.host is not None and self.host != socket.gethostname()

    def is_live(self) -> bool:
        """Whether the launcher that wrote this file still runs (another machine's: assumed
        so, it cannot be told from here)."""
        if self.elsewhere:
            return True
        try:
            proc = psutil.Process(self.launcher_pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            started = proc.create_time()
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # someone's process: cannot tell, so keep the file
        if self.launcher_started is None:  # written before start times were recorded
            return True
        return abs(started - self.launcher_started) <= START_TIME_TOLERANCE_S


def _live_job(path: Path) -> JobFile | None:
    """The job a file names if its launcher still runs; None for a stale or unreadable file."""
    try:
        job = JobFile.load(path)
        live = job.is_live()
    except (OSError, ValueError, TypeError):
        return None
    return job if live else None


def remove_stale_jobs(folder: Path | None = None) -> list[Path]:
    """Remove the job files whose launcher is gone (SIGKILLed): they hold a job's token."""
    folder = jobs_dir() if folder is None else folder
    removed = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, TypeError):
            if JobFile.load(path).elsewhere:
                continue  # another machine's launcher: not for this one to judge
        if _live_job(path) is None:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # not ours to remove: it must not stop this job's start
                log.warning("cannot remove the stale job file %s: %s", path, exc)
                continue
            removed.append(path)
            log.debug("removed the stale job file %s", path)
    return removed


def find_job(job_id: str | None) -> JobFile:
    """The running job named ``job_id``, or the only running one."""
    folder = jobs_dir()
    found = sorted(folder.glob("*.json")) if folder.is_dir() else []
    live = [job for job in map(_live_job, found) if job is not None]
    # a job with one launcher per host has a file per host: one job, whichever host's
    mine = {j.job_id: j for j in sorted(live, key=lambda j: not j.elsewhere)}
    if job_id:
        if job_id not in mine:
            raise LaunchError(f"no running job {job_id!r} (looked in {folder})")
        return mine[job_id]
    live = list(mine.values())
    if not live:
        raise LaunchError(f"no running xmig job found (looked in {folder})")
    if len(live) > 1:
        names = ", ".join(j.job_id for j in live)
        raise LaunchError(f"several jobs are running ({names}): pick one with --job")
    return live[0]


def uses_xmig(script: str) -> bool:
    """Whether the script's text mentions xmig at all (unreadable: assume it does)."""
    try:
        return "xmig" in Path(script).read_text(errors="replace")
    except OSError:
        return True


def _read_ready_line(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LaunchError(f"the coordinator did not start within {timeout:.0f} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise LaunchError(f"the coordinator exited during start-up (code {proc.wait()})")
            buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def resume_command(argv: list[str] | None, spec: JobSpec, path: str) -> str:
    """The command that resumes the job from the checkpoint at ``path``: the same command
    line (``argv``: ``xmig``'s arguments, ``run`` first), without its faults to inject or the
    checkpoint it resumed from, with ``--resume PATH``."""
    if not argv or argv[0] != "run":
        options = [f"--nnodes={spec.nnodes}", f"--nproc-per-node={spec.nproc_per_node}"]
        return shlex.join(["xmig", "run", "--resume", path, *options, spec.script, *spec.args])
    # what follows the script is the script's own
    head = argv[1 : len(argv) - len(spec.args) - 1]
    script = argv[len(argv) - len(spec.args) - 1]
    kept: list[str] = []
    skip = False
    for word in head:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in ("--inject", "--resume"):
            skip = "=" not in word
            continue
        kept.append(word)
    return shlex.join(["xmig", "run", "--resume", path, *kept, script, *spec.args])


class Launcher:
    """Runs one job to its outcome; owns the coordinator and agent processes."""

    def __init__(self, spec: JobSpec, summary_path: Path | None,
                 argv: list[str] | None = None, token: str | None = None,
                 node_rank: int | None = None) -> None:  # fmt: skip
        self.spec = spec
        self.summary_path = summary_path
        self.argv = argv  # ``xmig``'s own arguments, for the command that resumes the job
        self.token = token or secrets.token_hex(32)
        # one launcher per host: this host's node; None: this launcher starts every node
        self.node_rank = node_rank
        self.hosts_coordinator = node_rank in (None, 0)
        self._refused = False  # this host's agent was not taken into the job
        self._restarts = 0  # coordinators started again
        self._left = False  # this host was told to leave the job (SIGTERM, not node 0)
        self.coordinator: subprocess.Popen | None = None
        # with an HA control plane: every coordinator this launcher started (one leads)
        self.candidates: list[subprocess.Popen] = []
        self._leader: int | None = None  # the leadership (etcd revision) connected to
        self.agents: list[subprocess.Popen] = []
        self._agents_lock = threading.Lock()  # an agent started for an added node, or the end
        # nodes the coordinator asked for, started by one thread that lives as long as this
        # launcher: a child's parent-death signal comes when the thread that made it ends
        self._new_nodes: queue.SimpleQueue[int] | None = None
        self.address = ""  # the coordinator's, where every agent connects
        self.client: Client | None = None
        self._ended_event = threading.Event()  # the launcher is shutting the job down
        self.started_wall = time.time()  # this run's start (``LAUNCHED_AT``)
        self.job_file: Path | None = None
        self._result: dict[str, Any] | None = None
        self._result_ready = threading.Event()
        self._interrupted: str | None = None
        self.hosts: SimulatedHosts | None = None
        self._plain = not uses_xmig(spec.script)  # a script for torchrun, not adapted to xmig

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[TOKEN] = self.token
        env[JOB_ID] = self.spec.job_id
        env[LAUNCHED_AT] = repr(self.started_wall)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _start_candidate(self) -> None:
        """One more coordinator that campaigns for the lead (HA control plane): it listens on
        ports of its own, and takes the job up from etcd when it wins."""
        proc = subprocess.Popen([sys.executable, "-m", "xmig.coord"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=self._env(), start_new_session=True,
                                preexec_fn=die_with_parent)  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(self.spec.to_json()) + "\n").encode())
        proc.stdin.close()
        self.candidates.append(proc)
        ready = _read_ready_line(proc, COORDINATOR_START_TIMEOUT_S)
        if "error" in ready:
            raise LaunchError(ready["error"])

    def _ended(self) -> dict[str, Any] | None:
        """(HA control plane.) The job's summary, if it ended and its leader is gone."""
        from xmig.coord.etcd import ControlPlane, ControlPlaneError

        assert self.spec.control_plane is not None
        plane = ControlPlane(self.spec.control_plane, self.spec.job_id)
        try:
            return plane.outcome(since=self.started_wall)
        except ControlPlaneError as exc:
            raise LaunchError(str(exc)) from None
        finally:
            plane.close()

    def _find_leader(self, within: float) -> str:
        """The address of the coordinator that leads now (another than last time)."""
        from xmig.coord.etcd import ControlPlane, ControlPlaneError

        assert self.spec.control_plane is not None
        plane = ControlPlane(self.spec.control_plane, self.spec.job_id)
        try:
            leader = plane.wait_leader(within, other_than=self._leader)
        except ControlPlaneError as exc:
            raise LaunchError(str(exc)) from None
        finally:
            plane.close()
        self._leader = leader.revision
        self.spec = replace(self.spec, master_port=int(leader.store.rsplit(":", 1)[1]))
        # the leader, if it is one of this launcher's (it ends by itself with the job)
        self.coordinator = next((p for p in self.candidates if p.pid == leader.pid), None)
        return leader.address

    def _start_coordinator(self, restart: int = 0) -> str:
        env = self._env()
        if restart:  # it takes the job up from its predecessor's snapshot
            env[COORD_RESTART] = str(restart)
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "xmig.coord"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        assert self.coordinator.stdin is not None
        self.coordinator.stdin.write((json.dumps(self.spec.to_json()) + "\n").encode())
        self.coordinator.stdin.close()
        ready = _read_ready_line(self.coordinator, COORDINATOR_START_TIMEOUT_S)
        if "error" in ready:
            raise LaunchError(ready["error"])
        address = str(ready["address"])
        # a coordinator started again listens where this one does, for the agents to find it
        self.spec = replace(self.spec, master_port=int(ready["master_port"]),
                            coord_port=parse_address(address)[1])  # fmt: skip
        return address

    @property
    def local_nodes(self) -> list[int]:
        """The nodes whose agents this launcher starts."""
        return list(range(self.spec.all_nodes)) if self.node_rank is None else [self.node_rank]

    def _start_agents(self, address: str) -> None:
        self.address = address
        for node in self.local_nodes:
            self._start_agent(node)

    def _start_agent(self, node: int) -> None:
        env = self._env()
        extra: list[str] = []
        where = ["--coord", self.address]
        if self.spec.control_plane is not None:  # etcd says which coordinator leads
            where = ["--control-plane", self.spec.control_plane]
        if self.spec.multi_host:
            env[HOST_LAUNCH] = json.dumps(HostLaunch.of(self.spec).to_json())
            extra = ["--connect-timeout", str(self.spec.agent_connect_timeout)]
        enter = None
        if self.hosts is not None:
            env.update(self.hosts.environment(node))
            enter = self.hosts.enter(node)

        def prepare(enter: Any = enter) -> None:
            die_with_parent()
            if enter is not None:
                enter()

        # the node rank last: what tells the agents apart on a process list
        cmd = [sys.executable, "-m", "xmig.agent", "--log-level", self.spec.log_level,
               *extra, *where, "--node-rank", str(node)]  # fmt: skip
        self.agents.append(
            subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True, preexec_fn=prepare
            )
        )

    def _add_nodes(self) -> None:
        assert self._new_nodes is not None
        while True:
            self._add_node(self._new_nodes.get())

    def _add_node(self, node: int) -> None:
        """The coordinator asked for one more node: its simulated host, if the job has them,
        and its agent, which joins the job."""
        with self._agents_lock:
            if self._ended_event.is_set():
                return
            try:
                if self.hosts is not None:
                    self.hosts.add_node(node)
                self._start_agent(node)
            except (HostSetupError, OSError) as exc:
                print(f"xmig: node {node} could not be started: {exc}", file=sys.stderr,
                      flush=True)  # fmt: skip
                return
        where = f" in {self.hosts.namespace(node)}" if self.hosts is not None else ""
        print(f"xmig: started node {node}{where}; it joins the job", file=sys.stderr, flush=True)

    def _create_hosts(self) -> None:
        if not self.spec.simulate_hosts:
            return
        try:
            self.hosts = SimulatedHosts(
                self.spec.job_id, self.spec.all_nodes, gpus_per_node=self.spec.nproc_per_node
            ).create([r // self.spec.nproc_per_node for r in range(self.spec.world_size)])
        except HostSetupError as exc:
            raise LaunchError(str(exc)) from None
        self.spec = replace(self.spec, master_addr=self.hosts.bridge_address)
        print(
            f"xmig: simulated hosts: {self.spec.all_nodes} network namespaces "
            f"({self.hosts.namespace(0)}…) on {self.hosts.subnet}, coordinator at "
            f"{self.hosts.bridge_address}",
            file=sys.stderr,
            flush=True,
        )

    def _write_job_file(self, address: str) -> None:
        folder = jobs_dir()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        # with one launcher per host, each host's own (a home folder the hosts share)
        name = self.spec.job_id if self.node_rank is None else (
            f"{self.spec.job_id}.node{self.node_rank}")  # fmt: skip
        path = folder / f"{name}.json"
        # written aside and renamed: another launcher's clean-up must never see it half written
        # (an unreadable job file counts as stale)
        partial = folder / f".{name}.json.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(
                {
                    "job_id": self.spec.job_id,
                    "coordinator": address,
                    "token": self.token,
                    "launcher_pid": os.getpid(),
                    "launcher_started": psutil.Process().create_time(),
                    "host": socket.gethostname(),
                },
                out,
            )
        os.replace(partial, path)
        self.job_file = path

    def _on_push(self, msg: dict[str, Any]) -> None:
        if msg.get("op") == "result":
            self._result = msg["summary"]
            self._result_ready.set()
        elif msg.get("op") == StartNode.OP:
            try:
                order = decode(msg, Party.LAUNCHER, Party.COORDINATOR)
            except ProtocolError as exc:
                log.warning("warning: rejected a message from the coordinator: %s", exc)
                return
            assert isinstance(order, StartNode)
            if self._new_nodes is None:
                self._new_nodes = queue.SimpleQueue()
                threading.Thread(target=self._add_nodes, name="xmig-add-nodes",
                                 daemon=True).start()  # fmt: skip
            self._new_nodes.put(order.node)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.hosts_coordinator and self._interrupted is None:
            # one host of several is told to go (a drained node, an evicted pod): it leaves
            # the job, which goes on without it (a spare host takes its ranks)
            self._interrupted = name
            print(f"xmig: {name}: this host (node rank {self.node_rank}) leaves the job; "
                  "its ranks go to a spare host", file=sys.stderr, flush=True)  # fmt: skip
            kill_pids([p.pid for p in self.agents if p.poll() is None])
            self._left = True
            self._result_ready.set()
            return
        if self._interrupted is not None:
            print(f"xmig: {name} again: killing the job now", file=sys.stderr, flush=True)
            self._kill_all()
            os._exit(128 + signum)
        self._interrupted = name
        print(f"xmig: {name}: stopping the job (again to kill it)", file=sys.stderr, flush=True)
        if self.client is not None:
            with contextlib.suppress(WireError):
                self.client.notify("stop", reason=f"interrupted by {name}")

    def _connect(self, address: str, within: float | None = None) -> None:
        """This launcher's connection to the coordinator, for the job's outcome."""
        if within is None:
            within = self.spec.agent_connect_timeout if not self.hosts_coordinator else 10.0
        try:
            self.client = connect_retrying(parse_address(address), self.token, within,
                                           info={"role": "launcher"}, on_push=self._on_push,
                                           on_close=self._result_ready.set)  # fmt: skip
        except AuthError:
            raise LaunchError(f"the coordinator at {address} refused this host: it does not "
                              "hold this job's token (the same --token-file or XMIG_SECRET, "
                              "and --rdzv-id, on every host)") from None  # fmt: skip
        except WireError as exc:
            raise LaunchError(f"cannot reach the coordinator at {address}: {exc}") from None

    def _watch_agents(self) -> None:
        """Stop waiting for an outcome when every agent of this host ended without one (the
        job did not take this node: the agent said why)."""

        def watch() -> None:
            codes = [proc.wait() for proc in self.agents]
            if self._result is None and JOIN_REFUSED_EXIT_CODE in codes:
                self._refused = True
                self._result_ready.set()

        threading.Thread(target=watch, name="xmig-agents", daemon=True).start()

    @property
    def coordinator_stall_s(self) -> float:
        return max(COORDINATOR_STALL_MIN_S, 5 * self.spec.heartbeat_timeout)

    def _watch_coordinator(self) -> None:
        """(A launcher that started coordinators.) Ask the coordinator how the job is, every
        ``COORDINATOR_PING_S``; one that has not answered within ``coordinator_stall_s`` is
        hung (a process that is alive but silent is never noticed by its connections): it is
        killed, and so started again, or succeeded by a standby, like one that died. With an
        HA control plane, the leader is watched by the launcher that started it."""
        if not self.hosts_coordinator and not self.candidates:
            return

        def watch() -> None:
            while not self._ended_event.wait(COORDINATOR_PING_S):
                proc, client = self.coordinator, self.client
                if proc is None or client is None or proc.poll() is not None:
                    continue
                try:
                    client.call("status", timeout=self.coordinator_stall_s)
                except TimeoutError:
                    if self._ended_event.is_set() or self._result is not None:
                        return
                    then = ("a standby takes over" if self.spec.control_plane is not None
                            else "it is started again")  # fmt: skip
                    print(f"xmig: the coordinator (PID {proc.pid}) has not answered for "
                          f"{self.coordinator_stall_s:.0f} s: it is hung; it is stopped and "
                          f"{then}", file=sys.stderr, flush=True)  # fmt: skip
                    with contextlib.suppress(OSError):
                        proc.kill()
                except (WireError, RemoteError, OSError):
                    continue  # gone or refusing: the connection's end says what follows

        threading.Thread(target=watch, name="xmig-coordinator-watch", daemon=True).start()

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            remove_stale_jobs()
            self._create_hosts()
            if self.spec.control_plane is not None:
                # one launcher: every candidate; one per host: the first hosts' one each
                mine = self.spec.coordinators if self.node_rank is None else int(
                    self.node_rank < self.spec.coordinators)  # fmt: skip
                for _ in range(mine):
                    self._start_candidate()
                within = COORDINATOR_START_TIMEOUT_S if mine else self.spec.agent_connect_timeout
                address = self._find_leader(within)
            elif self.hosts_coordinator:
                address = self._start_coordinator()
            else:  # another host's: wait for it, and refuse a wrong token before anything
                address = format_address((self.spec.master_addr, self.spec.coord_port))
                self._connect(address)
            self._start_agents(address)
            if self.client is None:
                self._connect(address)
            assert self.client is not None
            self._watch_agents()
            joined = self.client.call("wait_result")
            self._watch_coordinator()
            self.spec = replace(self.spec, master_port=int(joined["store_port"]))
            self._write_job_file(address)
            self._say_started(address)
            if self._plain:
                print(
                    f"xmig: note: {Path(self.spec.script).name} does not use xmig: it runs as "
                    "under torchrun, without fault handling (a fault stops the job); to adapt "
                    'it, call xmig.init() (README, "The worker side")',
                    file=sys.stderr,
                    flush=True,
                )
            while True:
                self._result_ready.wait()
                if self._left:
                    return 128 + int(signal.Signals[self._interrupted or "SIGTERM"])
                if self._result is not None or self._refused or not self._coordinator_back():
                    break
            summary = self._result
            if summary is None and self._refused:
                print(
                    f"xmig: node rank {self.node_rank} did not join job {self.spec.job_id} "
                    "(the line above says why); exit code 2",
                    file=sys.stderr,
                    flush=True,
                )
                return 2
            if summary is None:
                summary = self._coordinator_lost()
            code = int(summary["exit_code"])
            if self._interrupted and summary["status"] != "completed":
                code = 130
            # the summary says what the launcher returns
            summary["exit_code"] = code
            summary["interrupted"] = self._interrupted
            self._report(summary)
            return code
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _coordinator_back(self) -> bool:
        """The coordinator's connection ended with no outcome: start it again (the
        coordinator's host) and connect to it; False when it cannot be."""
        if self._restarts >= self.spec.coordinator_restarts:
            return False
        self._restarts += 1
        self._result_ready.clear()
        address = format_address((self.spec.master_addr, self.spec.coord_port))
        count = f"{self._restarts} of {self.spec.coordinator_restarts}"
        if self.spec.control_plane is not None:
            return self._follow_leader(count)
        if self.hosts_coordinator:
            assert self.coordinator is not None
            try:
                code = self.coordinator.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # its connection is gone: it cannot serve
                stop_process(self.coordinator, grace=1.0)
                code = self.coordinator.returncode
            print(f"xmig: the coordinator died (exit {code}); starting it again ({count})",
                  file=sys.stderr, flush=True)  # fmt: skip
            try:
                self._start_coordinator(restart=self._restarts)
            except LaunchError as exc:
                print(f"xmig: the coordinator could not be started again: {exc}",
                      file=sys.stderr, flush=True)  # fmt: skip
                return False
        return self._reconnect(lambda: address, f"no coordinator at {address} again")

    def _reconnect(self, find: Callable[[], str], failed: str) -> bool:
        """Connect to the coordinator ``find`` names, for the outcome; False (with the line
        ``failed``) when none answers within the rejoin timeout."""
        try:
            self._connect(find(), within=self.spec.rejoin_timeout)
            assert self.client is not None
            self.client.call("wait_result")
        except (LaunchError, WireError, RemoteError) as exc:
            print(f"xmig: {failed}: {exc}", file=sys.stderr, flush=True)
            return False
        return True

    def _follow_leader(self, count: str) -> bool:
        """(HA control plane.) The leader went: a standby takes over; connect to it, and
        start a new standby in place of a coordinator that died."""
        self._replace_dead_candidates(count)
        # the leader's lease runs out first, then a standby takes over; one that dies before
        # this launcher is connected to it is passed over for its successor; a job that ended
        # meanwhile left its outcome in etcd
        deadline = time.monotonic() + self.spec.rejoin_timeout
        while True:
            try:
                ended = self._ended()
                if ended is not None:
                    self._result = ended
                    self._result_ready.set()
                    return True
                address = self._find_leader(min(max(0.1, deadline - time.monotonic()),
                                                LEADER_CONNECT_S))  # fmt: skip
                within = min(max(0.1, deadline - time.monotonic()), LEADER_CONNECT_S)
                self._connect(address, within=within)
                assert self.client is not None
                self.client.call("wait_result")
                return True
            except (LaunchError, WireError, RemoteError, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    print(f"xmig: no coordinator leads the job any more: {exc}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return False

    def _replace_dead_candidates(self, count: str) -> None:
        """(HA control plane.) Start a new standby for each coordinator of this launcher's
        that died. The leader whose connection just ended is waited for first: its socket
        closes before its exit can be reaped, and a launcher that polled too soon kept one
        coordinator fewer, so the next leader's death had no standby left to take over."""
        former = self.coordinator
        if former is not None and former in self.candidates:
            try:
                former.wait(timeout=LEADER_EXIT_S)
            except subprocess.TimeoutExpired:  # its connection is gone: it cannot serve
                stop_process(former, grace=1.0)
        for proc in list(self.candidates):
            if proc.poll() is None:
                continue
            self.candidates.remove(proc)
            print(f"xmig: coordinator {proc.pid} died (exit {proc.returncode}); a standby "
                  f"takes over; starting a new standby ({count})", file=sys.stderr,
                  flush=True)  # fmt: skip
            try:
                self._start_candidate()
            except LaunchError as exc:
                print(f"xmig: no new standby coordinator: {exc}", file=sys.stderr,
                      flush=True)  # fmt: skip

    def _say_started(self, address: str) -> None:
        spares = f" + {self.spec.spare_nodes} spare" if self.spec.spare_nodes else ""
        here = ""
        if self.node_rank is not None:
            role = "spare node" if self.node_rank >= self.spec.nnodes else "node"
            here = f"; this host is {role} rank {self.node_rank}"
            if not self.hosts_coordinator:
                here += " (the coordinator's host writes the summary)"
        print(f"xmig: job {self.spec.job_id}: {self.spec.world_size} ranks on "
              f"{self.spec.nnodes} node(s){spares}, coordinator {address}, store port "
              f"{self.spec.master_port}{here}", file=sys.stderr, flush=True)  # fmt: skip

    def _coordinator_lost(self) -> dict[str, Any]:
        """The coordinator died before the job had an outcome: every agent has its ranks save
        their own state and stop; once the agents are gone, what was saved becomes one
        checkpoint, and the summary is the launcher's own."""
        lost = time.monotonic()
        code = self.coordinator.wait() if self.coordinator else None
        print(f"xmig: the coordinator died (exit {code}) before the job ended; the ranks save "
              "their state and stop", file=sys.stderr, flush=True)  # fmt: skip
        deadline = (lost + self.spec.rejoin_timeout + self.spec.recovery_timeout
                    + self.spec.stop_grace + SAVE_SLACK_S)  # fmt: skip
        for proc in self.agents:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(proc, grace=1.0)  # its workers die with it
        if not self.hosts_coordinator:
            folder = lost_coordinator_folder(self.spec.checkpoint_dir or "", self.spec.job_id)
            print(f"xmig: this host's ranks saved their state in {folder}; node 0's launcher "
                  "makes the checkpoint of them (--checkpoint-dir must be a folder every host "
                  "shares)", file=sys.stderr, flush=True)  # fmt: skip
        elif self.spec.multi_host:  # other hosts' ranks save into the shared folder too
            while time.monotonic() < deadline and not saved_states_complete(self.spec):
                time.sleep(0.5)
        saved: dict[str, Any] = {"path": None, "why": "sealed by node 0's launcher"}
        if self.hosts_coordinator:
            saved = seal_saved_states(self.spec, "the coordinator was lost", time.time())
        stopped = time.monotonic() - lost
        message = "failed: the coordinator was lost"
        if saved.get("path"):
            message += f"; just-in-time checkpoint of step {saved['step']} in {saved['path']}"
        elif not self.hosts_coordinator:
            message += "; this host's ranks saved their state for node 0's launcher to seal"
        else:
            message += f"; nothing saved: {saved['why']}"
        return {
            "job_id": self.spec.job_id, "status": "failed", "exit_code": 1, "message": message,
            "coordinator": "lost", "jit_checkpoint": saved, "world_size": self.spec.world_size,
            "nnodes": self.spec.nnodes, "nproc_per_node": self.spec.nproc_per_node,
            "steps": saved.get("step"), "final_params_sha256": None, "faults": [],
            "recoveries": [], "migrations": [], "unfired_faults": [], "worker_pids": {},
            "worker_containers": {},
            "coordinator_pid": self.coordinator.pid if self.coordinator else None,
            "agent_pids": {str(n): p.pid for n, p in enumerate(self.agents)},
            "resumed_from": self.spec.resume, "stop_s": round(stopped, 4),
            "duration_s": None,
        }  # fmt: skip

    def _report(self, summary: dict[str, Any]) -> None:
        # node 0's host writes it; with an HA control plane any host may be the one left
        writes = self.hosts_coordinator or self.spec.control_plane is not None
        if self.summary_path is not None and writes:
            self.summary_path.parent.mkdir(parents=True, exist_ok=True)
            self.summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        head = f"xmig: job {summary['job_id']}"
        if summary["status"] == "completed" and summary["steps"] is None:
            # rank 0 reported no steps: nothing was protected, which must not pass unnoticed
            why = (
                "no rank called xmig.init()"
                if self._plain
                else "rank 0 reported no steps (xmig.init(), then session.steps())"
            )
            print(
                f"{head} completed on {summary['world_size']} ranks in "
                f"{summary['duration_s']:.1f} s without fault handling: {why}",
                file=sys.stderr,
                flush=True,
            )
        elif summary["status"] == "completed":
            print(
                f"{head} completed: {summary['steps']} steps on {summary['world_size']} "
                f"ranks in {summary['duration_s']:.1f} s; final params sha256 "
                f"{summary['final_params_sha256']}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"{head} FAILED: {summary['message'].removeprefix('failed: ')}", file=sys.stderr)
            done = f"{summary['steps']} steps completed" if summary["steps"] is not None else ""
            print(
                f"xmig: all workers stopped {summary['stop_s']:.2f} s after the decision; "
                f"{done + '; ' if done else ''}exit code {summary['exit_code']}",
                file=sys.stderr,
                flush=True,
            )
        saved = summary.get("jit_checkpoint") or {}
        if saved.get("path") and saved.get("complete"):
            command = resume_command(self.argv, self.spec, saved["path"])
            summary["resume_command"] = command
            print(f"xmig: resume with: {command}", file=sys.stderr, flush=True)
        if summary["status"] == "completed" and summary.get("unfired_faults"):
            # a chaos run whose faults never happened tested nothing
            print(
                f"xmig: error: injected faults never fired: {', '.join(summary['unfired_faults'])}"
                f" (the script ran {summary['steps']} steps); exit code {summary['exit_code']}",
                file=sys.stderr,
                flush=True,
            )

    def _kill_all(self) -> None:
        procs = [p for p in [self.coordinator, *self.candidates, *self.agents] if p is not None]
        kill_pids([p.pid for p in procs if p.poll() is None])

    def _shutdown(self) -> None:
        """Every process of the job ends, within a bound, whatever happened."""
        with self._agents_lock:  # no node is added from now on
            self._ended_event.set()
        # the standbys first, while this launcher's connection still keeps the leader from
        # resigning (it lingers until its peers are gone): a standby that took the lead
        # after it and was stopped before it saw the outcome left the leader key behind
        # for its lease's time
        for proc in self.candidates:
            if proc is not self.coordinator and proc.poll() is None:
                stop_process(proc, grace=1.0)
        if self.client is not None:
            self.client.close()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in self.agents:
            left = max(0.1, deadline - time.monotonic())
            try:
                proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                stop_process(proc, grace=1.0)  # its workers die with it (parent-death signal)
        if self.coordinator is not None:
            try:
                self.coordinator.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_process(self.coordinator, grace=1.0)
        for proc in self.candidates:  # the standbys have nothing left to take over
            if proc.poll() is None:
                stop_process(proc, grace=1.0)
        if self._result is not None:
            pids = [p for ps in self._result.get("worker_pids", {}).values() for p in ps]
            left = wait_gone(pids, timeout=5.0)
            if left:
                log.warning("killing leftover worker processes %s", left)
                kill_pids(left)
        if self.job_file is not None:
            self.job_file.unlink(missing_ok=True)
        if self.hosts is not None:
            self.hosts.remove()
        for folder in job_images(self.spec.job_id):  # what migrations left behind
            shutil.rmtree(folder, ignore_errors=True)
        for parked in parking_files(self.spec.job_id):
            parked.unlink(missing_ok=True)
        if self.spec.container is not None:  # what agents that were killed left in runc
            from xmig.agent.containers import job_prefix
            from xmig.container.process import remove_all

            left = remove_all(job_prefix(self.spec.job_id))
            if left:
                log.info("removed the job's leftover containers %s", left)
            shutil.rmtree(job_folder(self.spec.job_id) / "containers", ignore_errors=True)
