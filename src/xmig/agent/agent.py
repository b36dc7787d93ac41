"""The node agent: spawns this node's workers and watches them (exit, heartbeat, errors)."""

from __future__ import annotations

import contextlib
import ctypes
import json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmig.agent.spare import READY_FD as SPARE_READY_FD
from xmig.faults.spec import FaultSpec
from xmig.jobenv import COORD_ADDR, JOB_ID, TOKEN, WorkerEnv
from xmig.migrate import criu, cuda, netif, stream
from xmig.procs import die_with_parent, group_members, kill_group
from xmig.wire import Client, Peer, Server, WireError, format_address


@dataclass
class Worker:
    """One local rank's current process, as the agent sees it."""

    rank: int
    local_rank: int
    proc: subprocess.Popen | AdoptedProcess
    pidfd: int
    attempt: int
    state: str = "starting"  # starting, running, done, faulted, stopping, exited
    peer: Peer | None = None
    last_beat: float | None = None  # monotonic time of the last sign of life
    last_beat_wall: float | None = None
    step: int | None = None
    announced: dict[str, Any] | None = None  # the injected fault it said it is carrying out
    gpu: str | None = None  # the UUID of the GPU it holds state on, when it is moving
    gpu_bytes: int = 0  # how much of that GPU's memory it holds

    @property
    def pid(self) -> int:
        return self.proc.pid


class AdoptedProcess:
    """A worker this agent did not start (restored by CRIU, then re-parented to the agent,
    its child subreaper): the parts of ``Popen`` the agent uses."""

    args: list[str] = []

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


_PR_SET_CHILD_SUBREAPER = 36


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


@dataclass
class Spare:
    """A pre-started interpreter (``xmig.agent.spare``) waiting to become a worker."""

    proc: subprocess.Popen
    ready_fd: int
    ready: bool = False


SPARE_DELAY_S = 5.0  # a new spare waits this long, so its start does not slow a recovery
CORES_PER_PROCESS = 2  # cores a node needs per worker and spare to warm spares up beside them


def spare_may_start(cores: int, workers: int, spares_wanted: int, workers_starting: bool) -> bool:
    """Whether a spare may start its warm-up now. On a node with cores for every worker and
    spare, spares warm up beside the starting workers (ready sooner, on a GPU node about the
    time training begins); on a smaller one they wait until the workers are up, so as not to
    slow the workers' own start."""
    return not workers_starting or cores >= CORES_PER_PROCESS * (workers + spares_wanted)


def describe_exit(returncode: int) -> tuple[str, str]:
    """(kind, detail) for a worker's exit status: a signal or an exit code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return "signal", name
    return "exit", f"exit code {returncode}"


class Agent:
    """Spawns and watches the workers of one node; reports every fault to the coordinator.

    All spawning and reaping happens on the thread that runs ``run()`` (the workers' death
    signal is tied to it); other threads only post events to it.
    """

    def __init__(self, coord_addr: tuple[str, int], token: str, node_rank: int) -> None:
        self.coord_addr = coord_addr
        self.token = token
        self.node_rank = node_rank
        self.workers: dict[int, Worker] = {}
        # processes of replaced workers that have not exited yet (still watched, then reaped)
        self.retired: list[Worker] = []
        # what dead workers had started, adopted by this agent (child subreaper): reaped here
        self._orphans: set[int] = set()
        self.fired: dict[int, list[dict[str, Any]]] = {}  # injected faults already carried out
        self.spares: list[Spare] = []
        self._dump_orders: dict[int, dict[str, Any]] = {}
        self._spare_due = 0.0
        self.job: dict[str, Any] = {}
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self.server: Server | None = None
        self.coord: Client | None = None

    # ---- events from other threads -------------------------------------------------------
    def _post(self, kind: str, data: Any = None) -> None:
        self._events.put((kind, data))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _on_coord_push(self, msg: dict[str, Any]) -> None:
        self._post(msg.get("op", ""), msg)

    def _on_coord_lost(self) -> None:
        self._post("coord_lost")

    def _on_worker_message(self, peer: Peer, msg: dict[str, Any]) -> dict[str, Any] | None:
        rank = int(peer.info.get("rank", -1))
        op = msg.get("op")
        now, wall = time.monotonic(), time.time()
        with self._lock:
            worker = self.workers.get(rank)
            if worker is None or worker.pid != int(peer.info.get("pid", -1)):
                raise ValueError(f"no worker with rank {rank} and that pid on this node")
            worker.last_beat, worker.last_beat_wall = now, wall
            if op == "hello":
                worker.peer = peer
                worker.state = "running"
                self._post(
                    "forward",
                    (
                        "worker_joined",
                        {"rank": rank, "pid": worker.pid, "attempt": worker.attempt, "t": wall},
                    ),
                )
            elif op in ("hb", "step"):
                if msg.get("step") is not None and msg.get("step") != worker.step:
                    worker.step = msg["step"]
                    self._post("progress", (rank, worker.step))
            elif op == "injecting":
                worker.announced = {"fault": msg["fault"], "t": msg["t"], "step": msg.get("step")}
                self.fired.setdefault(rank, []).append(msg["fault"])
                if msg["fault"]["kind"] == "node":
                    self._post("node_loss", (msg["fault"], msg["t"]))
            elif op == "comm_error":
                self._post("comm_error", (rank, worker.pid, msg, wall))
            elif op in ("parked", "recovered", "recovery_failed", "paused", "pause_refused",
                        "rejoined", "resumed", "unreachable_faults", "state_digest", "verify",
                        "not_bit_identical"):  # fmt: skip
                fields = {k: v for k, v in msg.items() if k not in ("op", "id")}
                self._post("forward", (op, {"rank": rank, **fields}))
            elif op == "error":
                self._post("worker_error", (rank, worker.pid, msg, wall))
            elif op == "ready_for_dump":
                worker.state = "migrating"  # its link closes next; that is not a fault
                gpu = msg.get("gpu")
                worker.gpu = cuda.canonical_uuid(gpu) if gpu is not None else None
                worker.gpu_bytes = int(msg.get("gpu_bytes", 0))
                self._post("dump_now", rank)
            elif op == "done":
                worker.state = "done"
                self._post("done", (rank, msg))
        return {}

    # ---- main loop ------------------------------------------------------------------------
    def run(self) -> int:
        self.server = Server("127.0.0.1", 0, self.token, self._on_worker_message, name="agent")
        self.server.start()
        self.coord = Client(
            self.coord_addr,
            self.token,
            info={"role": "agent", "node": self.node_rank, "pid": os.getpid()},
            on_push=self._on_coord_push,
            on_close=self._on_coord_lost,
        )
        # a restored (migrated) worker's restorer exits at once: the worker becomes ours
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
        netns = os.stat("/proc/self/ns/net").st_ino
        reply = self.coord.call("agent_hello", node=self.node_rank, pid=os.getpid(), netns=netns)
        self.job = reply["job"]
        self.heartbeat_timeout = float(self.job["heartbeat_timeout"])
        threading.Thread(target=self._keep_alive, name="xmig-alive", daemon=True).start()
        threading.Thread(target=self._report_criu, name="xmig-criu", daemon=True).start()
        nproc = int(self.job["nproc_per_node"])
        if self.node_rank < int(self.job["nnodes"]):  # a spare node starts idle
            for local_rank in range(nproc):
                self._spawn(self.node_rank * nproc + local_rank, local_rank, attempt=0)
        while True:
            timeout = 0.05
            for key, _ in self._selector.select(timeout):
                if key.fileobj == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif isinstance(key.data, Spare):
                    self._spare_ready(key.data)
                else:
                    self._reap(key.data)
            if self._orphans:
                self._reap_orphans()
            while True:
                try:
                    kind, data = self._events.get_nowait()
                except queue.Empty:
                    break
                result = self._handle_event(kind, data)
                if result is not None:
                    return result
            self._check_heartbeats()
            self._keep_spares()

    def _keep_alive(self) -> None:
        """Tell the coordinator this node lives, on a thread of its own (the main loop may
        be busy stopping workers)."""
        interval = float(self.job["heartbeat_interval"])
        while True:
            time.sleep(interval)
            try:
                assert self.coord is not None
                self.coord.notify("agent_alive")
            except WireError:
                return

    def _report_criu(self) -> None:
        usable, detail = criu.criu_status()
        self._post("forward", ("criu", {"node": self.node_rank, "usable": usable,
                                        "detail": detail, "gpus": cuda.node_gpus()}))  # fmt: skip

    # ---- migration ----------------------------------------------------------------------------
    def _dump(self, rank: int) -> None:
        """Checkpoint a paused worker that closed its connections (on a thread of its own)."""
        worker, order = self.workers[rank], self._dump_orders.pop(rank)
        fds = {}
        for fd in (1, 2):  # pipes shared with the launcher: the target hands its own on
            with contextlib.suppress(OSError):
                fds[str(fd)] = os.readlink(f"/proc/{worker.pid}/fd/{fd}")
        generation = order["generation"]
        gpu_s, gpu_times, gpus_before = 0.0, {}, []
        try:
            if worker.gpu is not None:  # its GPU memory goes into its host memory first
                held = cuda.process_gpu_bytes(worker.pid, worker.gpu)
                if held is not None:  # its own share (the worker said what its GPU holds)
                    worker.gpu_bytes = held
                gpus_before = cuda.machine_gpus()
                checkpoint = cuda.GpuCheckpoint(worker.pid)
                gpu_s, gpu_times = checkpoint.save(), checkpoint.times
            started = time.monotonic()
            criu.dump(worker.pid, order["images"], tcp_close=True)
        except (criu.CriuError, cuda.GpuCheckpointError) as exc:
            self._post("dumped", (rank, {"ok": False, "error": str(exc),
                                         "generation": generation}))  # fmt: skip
            return
        took = time.monotonic() - started
        interface = None
        name = netif.rank_interface(rank)
        if netif.exists(name):  # the target node's agent takes it into its namespace
            with contextlib.suppress(netif.InterfaceError):
                interface = {"name": name, "address": netif.address_of(name),
                             "netns": os.environ.get(netif.NETNS_ENV)}  # fmt: skip
        size = sum(f.stat().st_size for f in Path(order["images"]).iterdir() if f.is_file())
        result = {"ok": True, "dump_s": took, "image_bytes": size, "fds": fds,
                  "generation": generation, "gpu": worker.gpu, "gpu_bytes": worker.gpu_bytes,
                  "gpu_checkpoint_s": gpu_s, "gpu_times": gpu_times,
                  "gpus_before": gpus_before, "interface": interface}  # fmt: skip
        if order.get("serve"):
            result["serve"] = self._serve_images(order["images"])
        self._post("dumped", (rank, result))

    def _serve_images(self, folder: str) -> list[Any]:
        """Offer the images to the target node's agent (once); remove them when sent."""
        assert self.coord is not None
        host = self.coord.conn.sock.getsockname()[0]  # this node's address, as others see it
        limit = float(self.job.get("recovery_timeout", 120.0))
        server = stream.ImageServer(folder, self.token, host, timeout=limit)

        def clean_up() -> None:
            server.sent.wait()
            shutil.rmtree(folder, ignore_errors=True)

        threading.Thread(target=clean_up, name="xmig-images-cleanup", daemon=True).start()
        return list(server.address)

    def _dumped(self, rank: int, result: dict[str, Any]) -> None:
        worker = self.workers[rank]
        if result["ok"]:
            if worker.state != "exited":
                self._reap(worker)  # CRIU ended it; its PID must be free for the restore
            del self.workers[rank]
        self._notify("dumped", rank=rank, node=self.node_rank, pid=worker.pid, **result)

    def _restore(self, order: dict[str, Any]) -> None:
        """Bring a migrated worker back in this node (its network namespace) and adopt it."""
        rank, pid = int(order["rank"]), int(order["pid"])
        rejoin = Path(order["rejoin_file"])
        transfer_s = 0.0
        if order.get("fetch"):
            try:
                limit = float(self.job.get("recovery_timeout", 120.0))
                _, transfer_s = stream.fetch_images(tuple(order["fetch"]), self.token,
                                                    order["images"], limit)  # fmt: skip
            except stream.StreamError as exc:
                self._notify("restored", rank=rank, node=self.node_rank, ok=False,
                             error=str(exc), generation=order["generation"])  # fmt: skip
                return
        assert self.server is not None
        partial = rejoin.with_suffix(".partial")
        where = {"agent_addr": format_address(self.server.address), "node": self.node_rank,
                 "agent_pid": os.getpid()}  # fmt: skip
        partial.write_text(json.dumps(where))
        os.replace(partial, rejoin)
        worker = Worker(rank=rank, local_rank=int(order["local_rank"]), proc=AdoptedProcess(pid),
                        pidfd=-1, attempt=int(order["attempt"]))  # fmt: skip
        with self._lock:
            self.workers[rank] = worker  # before it says hello
        # the worker's output goes where this agent's goes (duplicates handed to criu)
        inherit = {os.dup(fd): res for fd, res in stdio_resources(order.get("fds", {})).items()}
        started = time.monotonic()
        gpu_s, gpu_times, target = 0.0, {}, None
        try:
            interface = order.get("interface")
            if interface:
                netif.take(interface["name"], interface["address"], interface["netns"])
            criu.restore(order["images"], tcp_close=True, inherit_fds=inherit)
            took = time.monotonic() - started
            if order.get("gpu") is not None:  # onto this node's GPU for its local rank
                target = cuda.device_uuid(int(order["local_rank"]))
                pairs = cuda.restore_pairs(order["gpu"], target, order.get("gpus_before", []),
                                           cuda.machine_gpus())  # fmt: skip
                checkpoint = cuda.GpuCheckpoint(pid)
                gpu_s, gpu_times = checkpoint.load(pairs), checkpoint.times
        except (criu.CriuError, cuda.GpuCheckpointError, netif.InterfaceError) as exc:
            with self._lock:
                del self.workers[rank]
            self._notify("restored", rank=rank, node=self.node_rank, ok=False, error=str(exc),
                         generation=order["generation"])  # fmt: skip
            return
        finally:
            for fd in inherit:
                os.close(fd)
        worker.pidfd = os.pidfd_open(pid)
        self._selector.register(worker.pidfd, selectors.EVENT_READ, worker)
        self._notify("restored", rank=rank, node=self.node_rank, ok=True, pid=pid,
                     restore_s=took, gpu_restore_s=gpu_s, transfer_s=transfer_s,
                     gpu_times=gpu_times, to_gpu=target,
                     generation=order["generation"])  # fmt: skip
        shutil.rmtree(order["images"], ignore_errors=True)  # the worker removes the rejoin file

    def _lose_node(self, fault: dict[str, Any], t: float) -> None:
        """An injected node loss: every process of this node dies at once, this agent too."""
        with contextlib.suppress(WireError):
            assert self.coord is not None
            self.coord.call("node_dying", node=self.node_rank, fault=fault, t=t, timeout=5.0)
        print(f"xmig: node {self.node_rank} going down (injected {fault['kind']} fault)",
              file=sys.stderr, flush=True)  # fmt: skip
        for worker in [*self.workers.values(), *self.retired]:
            kill_group(worker.pid, signal.SIGKILL)
        for spare in self.spares:
            kill_group(spare.proc.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _handle_event(self, kind: str, data: Any) -> int | None:
        if kind == "progress":
            rank, step = data
            self._notify("progress", rank=rank, step=step)
        elif kind == "worker_error":
            rank, pid, msg, wall = data
            worker = self.workers.get(rank)
            if worker is not None and worker.pid == pid and worker.state != "stopping":
                worker.state = "faulted"
                self._report_fault(
                    worker, "error", msg.get("error", "?"), wall, step=msg.get("step")
                )
        elif kind == "done":
            rank, msg = data
            self._notify(
                "worker_done",
                rank=rank,
                steps=msg.get("steps"),
                params_sha256=msg.get("params_sha256"),
                checksum=msg.get("checksum"),
            )
        elif kind == "comm_error":
            rank, pid, msg, wall = data
            worker = self.workers.get(rank)
            if worker is not None and worker.pid == pid:
                self._report_fault(
                    worker,
                    "comm_error",
                    msg.get("error", "?"),
                    wall,
                    step=msg.get("step"),
                    generation=msg.get("generation"),
                )
        elif kind == "forward":
            op, fields = data
            self._notify(op, **fields)
        elif kind in ("park", "rebuild", "abort", "pause", "resume", "release", "state_digest"):
            for worker in self.workers.values():
                if worker.peer is not None and worker.state in ("running", "done"):
                    worker.peer.push(data)
        elif kind == "dump":
            worker = self.workers.get(int(data["rank"]))
            self._dump_orders[int(data["rank"])] = data
            if worker is None or worker.peer is None or not worker.peer.push(data):
                self._notify("dumped", rank=int(data["rank"]), node=self.node_rank, ok=False,
                             error="the rank is not connected to its agent",
                             generation=data["generation"])  # fmt: skip
        elif kind == "dump_now":
            threading.Thread(target=self._dump, args=(data,), name="xmig-dump",
                             daemon=True).start()  # fmt: skip
        elif kind == "dumped":
            self._dumped(*data)
        elif kind == "restore":
            self._restore(data)
        elif kind == "respawn":
            rank = int(data["rank"])
            old = self.workers.get(rank)
            if old is not None and old.state != "exited":
                # a replaced process must be gone (one that reported an error may still be
                # exiting); it stays watched until it is reaped
                old.state = "faulted"
                kill_group(old.pid, signal.SIGKILL)
                self.retired.append(old)
            known = self.fired.setdefault(rank, [])
            known.extend(f for f in data.get("fired", []) if f not in known)
            self._spawn(
                rank,
                int(data.get("local_rank", rank % int(self.job["nproc_per_node"]))),
                attempt=int(data.get("attempt", (old.attempt + 1) if old else 1)),
                generation=int(data["generation"]),
            )
        elif kind == "node_loss":
            self._lose_node(*data)
        elif kind == "inject":
            self._deliver_fault(msg=data)
        elif kind == "stop":
            self._stop_workers(float(data.get("grace", self.job.get("stop_grace", 3.0))))
            self._notify("stopped", node=self.node_rank)
        elif kind == "shutdown":
            self._stop_workers(0.0)
            return 0
        elif kind == "coord_lost":
            print(
                f"xmig: agent {self.node_rank} lost the coordinator; stopping its workers",
                file=sys.stderr,
                flush=True,
            )
            self._stop_workers(0.0)
            return 1
        return None

    def _notify(self, op: str, **fields: Any) -> None:
        assert self.coord is not None
        try:
            self.coord.notify(op, **fields)
        except WireError:
            self._post("coord_lost")

    # ---- workers --------------------------------------------------------------------------
    def _spawn(self, rank: int, local_rank: int, attempt: int, generation: int = 0) -> Worker:
        job = self.job
        fired = self.fired.get(rank, [])
        faults = [FaultSpec.from_json(f) for f in job["faults"] if f["rank"] == rank
                  and f not in fired and f["kind"] != "migrate"]  # fmt: skip
        assert self.server is not None
        env = WorkerEnv(
            rank=rank,
            local_rank=local_rank,
            world_size=int(job["world_size"]),
            master_addr=job["master_addr"],
            master_port=int(job["master_port"]),
            job_id=job["job_id"],
            token=self.token,
            agent_addr=format_address(self.server.address),
            node_rank=self.node_rank,
            heartbeat_interval=float(job["heartbeat_interval"]),
            attempt=attempt,
            generation=generation,
            keep_log=bool(job.get("keep_log", True)),
            recovery_timeout=float(job.get("recovery_timeout", 120.0)),
            faults=faults,
            nnodes=int(job["nnodes"]),
            local_world_size=int(job["nproc_per_node"]),
        )
        environ = self._base_environ()
        environ.update(env.to_environ())
        interface = netif.rank_interface(rank)
        if netif.exists(interface):  # the rank's own, which moves with it (simulated hosts)
            environ["NCCL_SOCKET_IFNAME"] = f"={interface}"
        proc = self._take_spare(environ) if attempt > 0 else None
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, job["script"], *job["args"]],
                cwd=job["cwd"],
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
        from_spare = attempt > 0 and proc.args[:3] == [sys.executable, "-m", "xmig.agent.spare"]
        self._notify("worker_started", rank=rank, pid=proc.pid, attempt=attempt, t=time.time(),
                     from_spare=from_spare)  # fmt: skip
        return worker

    def _base_environ(self) -> dict[str, str]:
        """What every worker of this node (and every spare) starts with."""
        job = self.job
        environ = dict(os.environ)
        environ["LOCAL_WORLD_SIZE"] = str(job["nproc_per_node"])
        environ[COORD_ADDR] = format_address(self.coord_addr)
        environ[JOB_ID] = job["job_id"]
        environ[TOKEN] = self.token
        environ.setdefault("PYTHONUNBUFFERED", "1")
        if int(job["world_size"]) > 1:
            # as torchrun does, but for every multi-rank job: all simulated nodes share this
            # machine, and a rank's numerics must not depend on how ranks map to nodes
            environ.setdefault("OMP_NUM_THREADS", "1")
        return environ

    # ---- hot spares ---------------------------------------------------------------------------
    def _keep_spares(self) -> None:
        wanted = int(self.job.get("hot_spares", 0))
        if len(self.spares) >= wanted or time.monotonic() < self._spare_due:
            return
        starting = any(w.state == "starting" for w in self.workers.values())
        if not spare_may_start(len(os.sched_getaffinity(0)), len(self.workers), wanted, starting):
            return
        ready_r, ready_w = os.pipe()
        environ = self._base_environ()
        environ[SPARE_READY_FD] = str(ready_w)
        proc = subprocess.Popen(
            [sys.executable, "-m", "xmig.agent.spare"],
            cwd=self.job["cwd"],
            env=environ,
            stdin=subprocess.PIPE,
            pass_fds=(ready_w,),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        os.close(ready_w)
        spare = Spare(proc, ready_r)
        self.spares.append(spare)
        self._selector.register(ready_r, selectors.EVENT_READ, spare)

    def _spare_ready(self, spare: Spare) -> None:
        self._selector.unregister(spare.ready_fd)
        spare.ready = os.read(spare.ready_fd, 1) == b"1"
        os.close(spare.ready_fd)
        if spare.ready:
            self._notify("spares", node=self.node_rank, ready=sum(s.ready for s in self.spares))
        if not spare.ready:
            spare.proc.wait()  # it died while warming up; _keep_spares starts another
            self.spares.remove(spare)

    def _take_spare(self, environ: dict[str, str]) -> subprocess.Popen | None:
        """Hand a warm spare the worker's environment; None when no spare is ready."""
        for spare in list(self.spares):
            if not spare.ready:
                continue
            self.spares.remove(spare)
            order = {"env": environ, "script": self.job["script"], "args": self.job["args"],
                     "cwd": self.job["cwd"]}  # fmt: skip
            try:
                assert spare.proc.stdin is not None
                spare.proc.stdin.write((json.dumps(order) + "\n").encode())
                spare.proc.stdin.close()
            except OSError:
                spare.proc.kill()
                spare.proc.wait()
                continue
            self._spare_due = time.monotonic() + SPARE_DELAY_S
            self._notify("spares", node=self.node_rank, ready=sum(s.ready for s in self.spares))
            return spare.proc
        return None

    def _stop_spares(self) -> None:
        for spare in self.spares:
            spare.proc.kill()
        for spare in self.spares:
            spare.proc.wait()
            if not spare.ready:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(spare.ready_fd)
                    os.close(spare.ready_fd)
        self.spares.clear()

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
        if previous in ("stopping", "faulted", "migrating") or self.workers.get(rank) is not worker:
            return
        if returncode != 0 and previous == "done":
            kind, detail = describe_exit(returncode)
            print(f"xmig: rank {rank} finished its steps, then exited with {detail}",
                  file=sys.stderr, flush=True)  # fmt: skip
            returncode = 0
        if returncode == 0:
            self._notify("worker_exited", rank=rank, pid=worker.pid, t=detected)
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
    ) -> None:
        announced, worker.announced = worker.announced, None
        if announced is not None:
            t_fault, source = announced["t"], "injection"
        elif kind == "hang" and worker.last_beat_wall is not None:
            t_fault, source = worker.last_beat_wall, "last_heartbeat"
        else:
            t_fault, source = detected, "detection"
        if step is None:
            step = announced["step"] if announced is not None else worker.step
        record = {
            "rank": worker.rank,
            "node": self.node_rank,
            "pid": worker.pid,
            "attempt": worker.attempt,
            "kind": kind,
            "detail": detail,
            "step": step,
            "injected": announced["fault"] if announced is not None else None,
            "t_fault": t_fault,
            "t_detected": detected,
            "fault_time_source": source,
            "detected_after_s": round(max(0.0, detected - t_fault), 6),
            "generation": generation,
        }
        self._notify("fault", record=record)

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

    def _deliver_fault(self, msg: dict[str, Any]) -> None:
        fault = msg["fault"]
        worker = self.workers.get(int(fault["rank"]))
        if (
            worker is None
            or worker.peer is None
            or not worker.peer.push({"op": "inject", "fault": fault})
        ):
            print(
                f"xmig: agent {self.node_rank}: could not deliver fault {fault} "
                "(the rank is not connected)",
                file=sys.stderr,
                flush=True,
            )

    @staticmethod
    def _kill(worker: Worker, sig: int) -> None:
        """Signal the worker and the processes it started (its process group)."""
        kill_group(worker.pid, sig)
        if sig != signal.SIGKILL:
            kill_group(worker.pid, signal.SIGCONT)  # a stopped process must run to die

    def _stop_workers(self, grace: float) -> None:
        """Stop every worker of this node and what they started: SIGTERM to each process
        group, SIGKILL after ``grace``; every worker is reaped before this returns."""
        self._stop_spares()
        self.job["hot_spares"] = 0  # a stopping job needs none
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
                print(
                    f"xmig: worker pid {worker.pid} did not die after SIGKILL",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            try:
                self._selector.unregister(worker.pidfd)
                os.close(worker.pidfd)
            except (KeyError, ValueError, OSError):
                pass
            worker.state = "exited"
        self.retired.clear()
