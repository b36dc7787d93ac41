"""Which Python client xmig uses to talk to etcd (an HA control plane): measured side by side.

    python bench/etcd_clients.py [--out bench/results/etcd-clients.md] [--ops 300] [--runs 3]
                                 [--clients etcd-sdk-python,etcd3gw,etcd3] [--budget 900]

Run it from a scratch virtual environment that holds the candidates, never xmig's own::

    python3 -m venv /tmp/etcd-venv
    /tmp/etcd-venv/bin/pip install etcd3gw etcd-sdk-python 'protobuf>=5.27' etcd3
    apt-get install -y etcd-server etcd-client      # etcd 3.4 on Debian 12
    /tmp/etcd-venv/bin/python bench/etcd_clients.py

Starts a 3-member etcd cluster on 127.0.0.1 (free ports, data dirs in a temporary folder,
``--heartbeat-interval 50 --election-timeout 250``) and, for each candidate client, a worker
process of this same script (``--worker NAME``) that measures, through that client only:

(a) put, get and a create-if-absent transaction: median and p99 over ``--ops`` operations;
(b) lease grant and one keep-alive refresh;
(c) a watch: from the put to the watcher's callback;
(d) failover: the leader member SIGKILLed while the client writes in a loop (each write with
    its own 0.5 s timeout), the client given all three endpoints and talking to the leader:
    the time to the first successful write started after the kill; ``--runs`` times, the
    killed member restarted between runs;
(e) whether a lease (kept alive by a thread of the bench every 0.4 s, TTL 2 s) and a watch
    opened before the kill still work after it;
and several threads sharing one client. A client that cannot do one of these says so in the
report's tables. The parent adds each client's install footprint (the distributions it pulls
in and their size on disk), its newest release (one ``pip download --no-deps``: the version
and the newest timestamp inside the archive) and its declared Python versions.

The worker asks the parent, which owns every etcd process, to kill or restart the leader
through lines on its stdin and stdout. Every process started here is ended by PID in a
``finally`` with a bounded wait, each has a parent-death signal, and the whole run is bounded
by ``--budget`` seconds. Writes ``bench/results/etcd-clients.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import importlib.metadata as md
import json
import math
import os
import platform
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "etcd-clients.md"
ETCD_TIMING = ["--heartbeat-interval", "50", "--election-timeout", "250"]
MEMBERS = 3
OP_TIMEOUT_S = 2.0  # each operation's own timeout in the steady-state phases
FAILOVER_OP_TIMEOUT_S = 0.5  # each write's own timeout in the failover loop
FAILOVER_GIVE_UP_S = 15.0  # a failover run without a successful write by then failed
LEASE_TTL_S = 2  # the lease kept alive through the failover
KEEPALIVE_EVERY_S = 0.4
HOLD_AFTER_KILL_S = 3.5  # > LEASE_TTL_S: a lease not kept alive would have expired
WATCH_WAIT_S = 3.0
THREADS = 4
THREAD_OPS = 100
WORKER_BUDGET_S = 300.0
PROTO = "@@ "  # prefix of the protocol lines between the parent and a worker


@dataclass(frozen=True)
class ClientSpec:
    """A candidate: its distribution, module, how it reaches several endpoints, its gaps."""

    name: str
    dist: str
    module: str
    transport: str
    endpoints: str
    env: dict[str, str] = field(default_factory=dict)
    undeclared: tuple[str, ...] = ()  # needed at import time, not in its Requires-Dist
    gaps: tuple[str, ...] = ()


CLIENTS: dict[str, ClientSpec] = {
    "etcd-sdk-python": ClientSpec(
        name="etcd-sdk-python",
        dist="etcd-sdk-python",
        module="pyetcd",
        transport="gRPC (grpcio + protobuf)",
        endpoints="native: `MultiEndpointEtcd3Client(failover=True)`, `Endpoint(time_retry=0.3)`",
        undeclared=("protobuf",),
        gaps=(
            "no lease keep-alive loop: `refresh_lease()` is one request (one short gRPC "
            "stream); xmig runs its own keep-alive thread (every TTL/3) and treats a "
            "refresh that fails until the TTL runs out as leadership lost",
            "a watch is not carried over to the next endpoint: its callback gets the "
            "`grpc.RpcError` (or `None` when the client closed it on switching endpoints); "
            "xmig re-opens it with `start_revision` = last seen revision + 1",
            "no retry: a failed call raises and only marks the endpoint failed, the next "
            "call goes to another one; xmig retries each call itself within its deadline",
            "`Endpoint(time_retry=...)` defaults to 300 s (failover then stalls for "
            "minutes): always pass 0.2-0.5 s",
            "`protobuf` is imported but not declared: xmig's extra pins it itself",
            "no type hints (no `py.typed`): xmig keeps the client behind one typed module",
            "a young fork (0.0.x, one maintainer) of python-etcd3's code with its unreleased "
            "multi-endpoint client: xmig pins a narrow range and keeps every call in that one "
            "module, so that etcd3gw (the maintained, typed alternative) can replace it there",
        ),
    ),
    "etcd3gw": ClientSpec(
        name="etcd3gw",
        dist="etcd3gw",
        module="etcd3gw",
        transport="HTTP/JSON to etcd's gRPC gateway (`requests`)",
        endpoints="one per client: by hand (the bench moves to the next endpoint on any error)",
        gaps=(
            "one endpoint per client: xmig keeps one client per member and moves on by hand",
            "a watch whose stream breaks ends silently (the reader's exception dies in its "
            "thread pool): xmig needs its own watch loop over the raw stream, with "
            "progress notifications to notice a dead one",
            "no lease keep-alive loop: `Lease.refresh()` is one HTTP request; xmig runs its "
            "own thread",
            "a `Lease` object is bound to the client that granted it: after moving to "
            "another endpoint, rebuild it from its ID",
        ),
    ),
    "etcd3": ClientSpec(
        name="etcd3",
        dist="etcd3",
        module="etcd3",
        transport="gRPC (grpcio + protobuf)",
        endpoints="one per client: by hand (the bench moves to the next endpoint on any error)",
        env={"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"},
        gaps=(
            "its generated protobuf code needs protobuf <= 3.20.x, or the pure-Python "
            "protobuf for the whole process (`PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`)",
            "one endpoint per client: xmig keeps one client per member and moves on by hand",
            "no lease keep-alive loop; a watch ends with an error on its callback",
        ),
    ),
}


GOTCHAS = (
    "etcd-sdk-python's generated code checks the protobuf runtime (gencode 5.27.2): it needs "
    "protobuf >= 5.27 and does not declare protobuf at all; it declares grpcio >= 1.66.2.",
    "etcd3 0.12's generated code predates protobuf 4: with a newer protobuf it imports only with "
    "the pure-Python protobuf (`PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`, process-wide), "
    "else protobuf <= 3.20.x, which clashes with etcd-sdk-python's >= 5.27 in one environment.",
    "etcd 3.4's gateway serves `/v3/` (`/v3beta/` is 3.3, `/v3alpha/` 3.2); etcd3gw finds it "
    "through `GET /version` on first use unless given `api_path='/v3/'`.",
    "The gateway's JSON carries keys and values base64-encoded and every int64 (revisions, "
    "lease IDs, TTLs) as a string; etcd3gw encodes and decodes keys and values for you.",
    "etcd-sdk-python's `Endpoint` defaults to `secure=True` (needs credentials) and "
    "`time_retry=300` s; it starts on a random endpoint.",
    "A watch callback of etcd-sdk-python and etcd3 gets `None` (not an error) when the client "
    "itself closed the stream on moving to another endpoint.",
    "etcd3gw opens a watch with `stream=True` and no timeout, on the client's shared "
    "`requests.Session`; `Watcher.stop()` shuts the socket down under it.",
    "Debian's etcd package enables a systemd unit that does not start here (no systemd): the "
    "bench starts its members by hand.",
)

# ---------------------------------------------------------------------------------------------
# small helpers


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary(samples_ms: list[float]) -> dict[str, float]:
    if not samples_ms:
        return {"n": 0}
    return {
        "n": len(samples_ms),
        "p50": statistics.median(samples_ms),
        "p99": percentile(samples_ms, 99),
        "max": max(samples_ms),
    }


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text[:140]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def watch_end(resp: Any) -> str:
    """What a gRPC client's watch callback got instead of events."""
    if resp is None:
        return "stream closed by the client (None)"
    code = getattr(resp, "code", None)
    if callable(code):
        with contextlib.suppress(Exception):
            return f"gRPC {code().name}"
    return short_error(resp)


def set_pdeathsig() -> None:
    """In the child, before exec: die with the parent (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def free_ports(count: int) -> list[int]:
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """End one process we started, by its PID: SIGTERM, a bounded wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# the cluster (parent side)


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """Three etcd members on 127.0.0.1, started by hand; every PID is ours to end."""

    def __init__(self, root: Path, etcd: str) -> None:
        self.etcd = etcd
        ports = free_ports(2 * MEMBERS)
        self.members = [
            Member(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=root / f"m{i}.etcd",
                log_path=root / f"m{i}.log",
            )
            for i in range(MEMBERS)
        ]
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.kills = 0

    def start_member(self, m: Member) -> None:
        cmd = [
            self.etcd,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", "xmig-bench",
            "--log-level", "warn",
            *ETCD_TIMING,
        ]  # fmt: skip
        log = open(m.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            m.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=set_pdeathsig,  # the parent is single-threaded
            )
        finally:
            log.close()

    def start(self) -> None:
        for m in self.members:
            self.start_member(m)
        self.wait_ready(30.0)

    def status(self, m: Member) -> dict[str, Any] | None:
        req = urllib.request.Request(
            m.client_url + "/v3/maintenance/status",
            data=b"{}",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                return json.loads(resp.read())
        except (OSError, ValueError):
            return None

    def leader_index(self) -> int | None:
        """The index of the member every live member names as leader, or None."""
        ids: dict[str, int] = {}
        leaders: set[str] = set()
        for i, m in enumerate(self.members):
            if not m.alive():
                continue
            st = self.status(m)
            if st is None:
                return None
            ids[str(st["header"]["member_id"])] = i
            leaders.add(str(st.get("leader", "0")))
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def wait_ready(self, timeout_s: float) -> int:
        """Wait (bounded) until every member runs and they agree on a leader; its index."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.members:
                if not m.alive():
                    raise RuntimeError(f"etcd member {m.name} exited: see {m.log_path}")
            idx = self.leader_index()
            if idx is not None:
                return idx
            time.sleep(0.1)
        raise TimeoutError(f"etcd cluster not ready within {timeout_s:.0f} s")

    def kill_leader(self) -> tuple[int, float]:
        idx = self.wait_ready(10.0)
        m = self.members[idx]
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            m.proc.wait(timeout=5.0)
        self.kills += 1
        return idx, t_kill

    def restart_dead(self) -> None:
        for m in self.members:
            if not m.alive():
                self.start_member(m)
        self.wait_ready(30.0)

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None:
                stop_process(m.proc)

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members if m.proc is not None]


# ---------------------------------------------------------------------------------------------
# the clients (worker side): one adapter per candidate, all with the same few calls


WatchCallback = Callable[[bytes | None, str | None], None]  # (value, or an error text)


class Adapter:
    """The calls the bench needs, over one client library."""

    timeout: float

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def create(self, key: str, value: str) -> bool:
        """Create-if-absent: a transaction comparing the key's create_revision with 0."""
        raise NotImplementedError

    def lease_grant(self, ttl: int) -> int:
        raise NotImplementedError

    def lease_refresh(self, lease: int) -> int:
        """One keep-alive; the TTL etcd gives back."""
        raise NotImplementedError

    def lease_ttl(self, lease: int) -> int:
        raise NotImplementedError

    def watch(self, key: str, callback: WatchCallback) -> Callable[[], None]:
        """Open a watch on key; returns its cancel."""
        raise NotImplementedError

    def current_endpoint(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _host_port(url: str) -> tuple[str, int]:
    hostport = url.split("://", 1)[1]
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


class PyEtcdAdapter(Adapter):
    """etcd-sdk-python (``pyetcd``): its own multi-endpoint client with failover."""

    def __init__(self, urls: list[str], timeout: float, prefer: int) -> None:
        import pyetcd

        self.timeout = timeout
        self._eps = [pyetcd.Endpoint(*_host_port(u), secure=False, time_retry=0.3) for u in urls]
        self._c: Any = pyetcd.MultiEndpointEtcd3Client(
            endpoints=self._eps, timeout=timeout, failover=True
        )
        # it starts on a random endpoint: pin it to the one asked for (the leader)
        self._c._current_endpoint_label = self._eps[prefer].netloc

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        self._c.put(key, value, lease=lease)

    def get(self, key: str) -> bytes | None:
        value, _meta = self._c.get(key)
        return value

    def create(self, key: str, value: str) -> bool:
        tx = self._c.transactions
        ok, _ = self._c.transaction(
            compare=[tx.create(key) == 0], success=[tx.put(key, value)], failure=[]
        )
        return bool(ok)

    def lease_grant(self, ttl: int) -> int:
        return int(self._c.lease(ttl).id)

    def lease_refresh(self, lease: int) -> int:
        replies = list(self._c.refresh_lease(lease))
        return int(replies[0].TTL)

    def lease_ttl(self, lease: int) -> int:
        return int(self._c.get_lease_info(lease).TTL)

    def watch(self, key: str, callback: WatchCallback) -> Callable[[], None]:
        def on_response(resp: Any) -> None:
            events = getattr(resp, "events", None)
            if events is None:  # an error, or None when the client closed the stream
                callback(None, watch_end(resp))
                return
            for ev in events:
                callback(bytes(ev.value), None)

        watch_id = self._c.add_watch_callback(key, on_response)

        def cancel() -> None:
            with contextlib.suppress(Exception):
                self._c.cancel_watch(watch_id)

        return cancel

    def current_endpoint(self) -> int:
        label = self._c._current_endpoint_label
        return [e.netloc for e in self._eps].index(label)

    def close(self) -> None:
        self._c.close()


class RotatingAdapter(Adapter):
    """One single-endpoint client per member; on any error the next call goes to the next one.

    What xmig would have to write around a client without multi-endpoint support."""

    def __init__(self, clients: list[Any], timeout: float, prefer: int) -> None:
        self.timeout = timeout
        self._clients = clients
        self._idx = prefer
        self._lock = threading.Lock()

    def call(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            idx = self._idx
        try:
            return fn(self._clients[idx])
        except Exception:
            with self._lock:
                if self._idx == idx:
                    self._idx = (idx + 1) % len(self._clients)
            raise

    def current_endpoint(self) -> int:
        with self._lock:
            return self._idx


class Etcd3gwAdapter(RotatingAdapter):
    """etcd3gw: HTTP/JSON through etcd's gateway (``/v3/`` for etcd 3.4)."""

    def __init__(self, urls: list[str], timeout: float, prefer: int) -> None:
        from etcd3gw.client import Etcd3Client

        clients = [Etcd3Client(*_host_port(u), timeout=timeout, api_path="/v3/") for u in urls]
        super().__init__(clients, timeout, prefer)

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        from etcd3gw.lease import Lease

        self.call(lambda c: c.put(key, value, lease=Lease(lease, c) if lease else None))

    def get(self, key: str) -> bytes | None:
        values = self.call(lambda c: c.get(key))
        return values[0] if values else None

    def create(self, key: str, value: str) -> bool:
        return bool(self.call(lambda c: c.create(key, value)))

    def lease_grant(self, ttl: int) -> int:
        return int(self.call(lambda c: c.lease(ttl)).id)

    def lease_refresh(self, lease: int) -> int:
        from etcd3gw.lease import Lease

        return int(self.call(lambda c: Lease(lease, c).refresh()))

    def lease_ttl(self, lease: int) -> int:
        from etcd3gw.lease import Lease

        return int(self.call(lambda c: Lease(lease, c).ttl()))

    def watch(self, key: str, callback: WatchCallback) -> Callable[[], None]:
        from etcd3gw.watch import Watcher

        def on_event(event: Any) -> None:
            value = event.get("kv", {}).get("value")
            callback(value if isinstance(value, bytes) else None, None)

        watcher = self.call(lambda c: Watcher(c, key, on_event))

        def cancel() -> None:
            with contextlib.suppress(Exception):
                watcher.stop()

        return cancel

    def close(self) -> None:
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.session.close()


class Etcd3Adapter(RotatingAdapter):
    """etcd3 (python-etcd3 0.12): gRPC, one endpoint per client."""

    def __init__(self, urls: list[str], timeout: float, prefer: int) -> None:
        import etcd3

        clients = [etcd3.client(*_host_port(u), timeout=timeout) for u in urls]
        super().__init__(clients, timeout, prefer)

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        self.call(lambda c: c.put(key, value, lease=lease))

    def get(self, key: str) -> bytes | None:
        return self.call(lambda c: c.get(key))[0]

    def create(self, key: str, value: str) -> bool:
        def txn(c: Any) -> bool:
            tx = c.transactions
            ok, _ = c.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, value)], failure=[]
            )
            return bool(ok)

        return bool(self.call(txn))

    def lease_grant(self, ttl: int) -> int:
        return int(self.call(lambda c: c.lease(ttl)).id)

    def lease_refresh(self, lease: int) -> int:
        return int(self.call(lambda c: list(c.refresh_lease(lease)))[0].TTL)

    def lease_ttl(self, lease: int) -> int:
        return int(self.call(lambda c: c.get_lease_info(lease)).TTL)

    def watch(self, key: str, callback: WatchCallback) -> Callable[[], None]:
        def on_response(resp: Any) -> None:
            events = getattr(resp, "events", None)
            if events is None:
                callback(None, watch_end(resp))
                return
            for ev in events:
                callback(bytes(ev.value), None)

        holder: list[Any] = []

        def add(c: Any) -> Any:
            holder.append(c)
            return c.add_watch_callback(key, on_response)

        watch_id = self.call(add)

        def cancel() -> None:
            with contextlib.suppress(Exception):
                holder[0].cancel_watch(watch_id)

        return cancel

    def close(self) -> None:
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()


ADAPTERS: dict[str, Callable[[list[str], float, int], Adapter]] = {
    "etcd-sdk-python": PyEtcdAdapter,
    "etcd3gw": Etcd3gwAdapter,
    "etcd3": Etcd3Adapter,
}


# ---------------------------------------------------------------------------------------------
# the worker: measures one client


class Worker:
    def __init__(self, name: str, urls: list[str], ops: int, runs: int) -> None:
        self.name = name
        self.urls = urls
        self.ops = ops
        self.runs = runs
        self.prefix = f"/bench/{name}/{os.getpid()}"

    # the line protocol with the parent -------------------------------------------------------

    def send(self, kind: str, payload: Any = None) -> None:
        line = PROTO + kind + (" " + json.dumps(payload) if payload is not None else "")
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def ask(self, kind: str) -> Any:
        self.send(kind)
        line = sys.stdin.readline()
        if not line.startswith(PROTO):
            raise RuntimeError(f"no answer from the parent to {kind}: {line!r}")
        return json.loads(line[len(PROTO) :])

    def part(self, phase: str, data: Any) -> None:
        self.send("PART", {"phase": phase, "data": data})

    # phases ----------------------------------------------------------------------------------

    def run(self) -> None:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = CLIENTS[self.name]
            try:
                __import__(spec.module)
            except Exception as exc:
                self.part("import", {"ok": False, "error": short_error(exc)})
                return
        self.part(
            "import",
            {
                "ok": True,
                "seconds": round(time.monotonic() - t0, 3),
                "warnings": [f"{w.category.__name__}: {w.message}"[:90] for w in caught],
            },
        )
        phases: list[tuple[str, Callable[[], Any]]] = [
            ("kv", self.phase_kv),
            ("lease", self.phase_lease),
            ("watch", self.phase_watch),
            ("threads", self.phase_threads),
            ("failover", self.phase_failover),
        ]
        for phase, fn in phases:
            try:
                self.part(phase, fn())
            except Exception as exc:
                self.part(phase, {"error": short_error(exc)})

    def adapter(self, timeout: float) -> Adapter:
        leader = self.ask("LEADER")["leader"]
        return ADAPTERS[self.name](self.urls, timeout, leader)

    def phase_kv(self) -> dict[str, Any]:
        a = self.adapter(OP_TIMEOUT_S)
        try:
            out: dict[str, Any] = {}
            for i in range(20):  # warm-up: connections, gateways, caches
                a.put(f"{self.prefix}/warm/{i}", "x")
                a.get(f"{self.prefix}/warm/{i}")
            ops: dict[str, Callable[[int], Any]] = {
                "put": lambda i: a.put(f"{self.prefix}/kv/{i % 50}", f"v{i}"),
                "get": lambda i: a.get(f"{self.prefix}/kv/{i % 50}"),
                "create": lambda i: a.create(f"{self.prefix}/cas/{i}", "owner"),
            }
            for op, fn in ops.items():
                samples: list[float] = []
                errors: list[str] = []
                for i in range(self.ops):
                    t = time.perf_counter()
                    try:
                        fn(i)
                    except Exception as exc:
                        errors.append(short_error(exc))
                        continue
                    samples.append((time.perf_counter() - t) * 1e3)
                out[op] = {**summary(samples), "errors": len(errors), "first": errors[:1]}
            # the transaction's semantics: a second create of the same key must fail
            out["create_semantics_ok"] = a.create(f"{self.prefix}/cas/x", "a") and not a.create(
                f"{self.prefix}/cas/x", "b"
            )
            got = a.get(f"{self.prefix}/cas/x")
            out["create_semantics_ok"] = bool(out["create_semantics_ok"] and got == b"a")
            return out
        finally:
            a.close()

    def phase_lease(self) -> dict[str, Any]:
        a = self.adapter(OP_TIMEOUT_S)
        try:
            n = max(20, self.ops // 3)
            grant: list[float] = []
            leases: list[int] = []
            for _ in range(n):
                t = time.perf_counter()
                leases.append(a.lease_grant(10))
                grant.append((time.perf_counter() - t) * 1e3)
            refresh: list[float] = []
            ttls: set[int] = set()
            for i in range(self.ops):
                t = time.perf_counter()
                ttls.add(a.lease_refresh(leases[i % len(leases)]))
                refresh.append((time.perf_counter() - t) * 1e3)
            a.put(f"{self.prefix}/leased", "x", lease=leases[0])
            return {
                "grant": summary(grant),
                "refresh": summary(refresh),
                "refresh_ttls": sorted(ttls),
                "ttl_after": a.lease_ttl(leases[0]),
                "key_with_lease": a.get(f"{self.prefix}/leased") == b"x",
            }
        finally:
            a.close()

    def phase_watch(self) -> dict[str, Any]:
        a = self.adapter(OP_TIMEOUT_S)
        key = f"{self.prefix}/watched"
        arrived: dict[str, float] = {}
        errors: list[str] = []
        cond = threading.Condition()

        def on_event(value: bytes | None, err: str | None) -> None:
            now = time.perf_counter()
            with cond:
                if err is not None:
                    errors.append(err)
                elif value is not None:
                    arrived.setdefault(value.decode(), now)
                cond.notify_all()

        def wait_for(tag: str, timeout: float) -> bool:
            with cond:
                return cond.wait_for(lambda: tag in arrived, timeout=timeout)

        try:
            t = time.perf_counter()
            cancel = a.watch(key, on_event)
            open_ms = (time.perf_counter() - t) * 1e3
            # the watch may register on the server after watch() returns: wait until it sees
            ready = False
            for i in range(30):
                a.put(key, f"ready{i}")
                if wait_for(f"ready{i}", 0.1):
                    ready = True
                    break
            if not ready:
                return {"error": "the watch delivered nothing within 3 s", "open_ms": open_ms}
            lat: list[float] = []
            lost = 0
            n = max(50, self.ops * 2 // 3)
            for i in range(n):
                tag = f"w{i}"
                t = time.perf_counter()
                a.put(key, tag)
                if wait_for(tag, 2.0):
                    lat.append((arrived[tag] - t) * 1e3)
                else:
                    lost += 1
            cancel()
            return {
                "latency": summary(lat),
                "sent": n,
                "lost": lost,
                "errors": errors[:3],
                "open_ms": open_ms,
            }
        finally:
            a.close()

    def phase_threads(self) -> dict[str, Any]:
        a = self.adapter(OP_TIMEOUT_S)
        errors: list[str] = []
        mismatches = 0
        lock = threading.Lock()

        def body(tid: int) -> None:
            nonlocal mismatches
            for i in range(THREAD_OPS):
                key = f"{self.prefix}/thr/{tid}"
                try:
                    a.put(key, f"{tid}-{i}")
                    got = a.get(key)
                    created = a.create(f"{self.prefix}/thr/{tid}/c{i}", "x")
                    if got != f"{tid}-{i}".encode() or not created:
                        with lock:
                            mismatches += 1
                except Exception as exc:
                    with lock:
                        errors.append(short_error(exc))

        try:
            threads = [
                threading.Thread(target=body, args=(t,), daemon=True) for t in range(THREADS)
            ]
            t0 = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=120.0)
            seconds = time.perf_counter() - t0
            hung = sum(th.is_alive() for th in threads)
            total = THREADS * THREAD_OPS * 3
            return {
                "threads": THREADS,
                "ops": total,
                "errors": len(errors),
                "error_kinds": sorted(set(errors))[:3],
                "mismatches": mismatches,
                "hung": hung,
                "ops_per_s": total / seconds,
            }
        finally:
            a.close()

    def phase_failover(self) -> list[dict[str, Any]]:
        return [self.failover_run(r) for r in range(self.runs)]

    def failover_run(self, run: int) -> dict[str, Any]:
        a = self.adapter(FAILOVER_OP_TIMEOUT_S)
        stop = threading.Event()
        attempts: list[tuple[float, float, str | None]] = []  # (start, end, error)
        keepalives: list[tuple[float, bool]] = []
        seen: dict[str, float] = {}
        watch_errors: list[tuple[float, str]] = []
        cond = threading.Condition()
        base = f"{self.prefix}/fo{run}"
        res: dict[str, Any] = {"run": run + 1}
        try:
            lease = a.lease_grant(LEASE_TTL_S)
            a.put(f"{base}/leased", "alive", lease=lease)

            def on_event(value: bytes | None, err: str | None) -> None:
                with cond:
                    if err is not None:
                        watch_errors.append((time.monotonic(), err))
                    elif value is not None:
                        seen.setdefault(value.decode(), time.monotonic())
                    cond.notify_all()

            cancel_watch = a.watch(f"{base}/watched", on_event)
            a.put(f"{base}/watched", "before")
            with cond:
                res["watch_ok_before"] = cond.wait_for(lambda: "before" in seen, timeout=3.0)

            def writer() -> None:
                i = 0
                while not stop.is_set():
                    t = time.monotonic()
                    try:
                        a.put(f"{base}/w", str(i))
                        attempts.append((t, time.monotonic(), None))
                    except Exception as exc:
                        attempts.append((t, time.monotonic(), short_error(exc)))
                        stop.wait(0.01)  # no busy loop against a refused port
                    i += 1
                    stop.wait(0.005)

            def keepalive() -> None:
                while not stop.wait(KEEPALIVE_EVERY_S):
                    try:
                        ok = a.lease_refresh(lease) > 0
                    except Exception:
                        ok = False
                    keepalives.append((time.monotonic(), ok))

            threads = [
                threading.Thread(target=writer, daemon=True),
                threading.Thread(target=keepalive, daemon=True),
            ]
            for th in threads:
                th.start()
            time.sleep(0.5)
            res["client_on_leader"] = a.current_endpoint() == self.ask("LEADER")["leader"]
            killed = self.ask("KILL_LEADER")
            t_kill = float(killed["t_kill"])
            res["killed"] = killed["leader"]
            deadline = t_kill + FAILOVER_GIVE_UP_S
            first: tuple[float, float, str | None] | None = None
            while time.monotonic() < deadline:
                first = next((x for x in list(attempts) if x[0] >= t_kill and x[2] is None), None)
                if first is not None:
                    break
                time.sleep(0.02)
            after = [x for x in list(attempts) if x[0] >= t_kill]
            failed = [x for x in after if first is None or x[0] < first[0]]
            res["first_write_ms"] = (first[1] - t_kill) * 1e3 if first else None
            res["failed_attempts"] = len(failed)
            res["errors"] = sorted({e for _, _, e in failed if e})[:3]
            # hold on past the lease's TTL while the keep-alive thread goes on
            while time.monotonic() < t_kill + HOLD_AFTER_KILL_S:
                time.sleep(0.05)
            stop.set()
            for th in threads:
                th.join(timeout=5.0)
            ok_after = [t for t, ok in keepalives if ok and t >= t_kill]
            res["keepalive_gap_ms"] = (ok_after[0] - t_kill) * 1e3 if ok_after else None
            res["keepalive_failures"] = sum(1 for t, ok in keepalives if not ok and t >= t_kill)
            res["lease"] = self.check_lease(a, lease, f"{base}/leased")
            res["watch"] = self.check_watch(a, f"{base}/watched", seen, watch_errors, cond, t_kill)
            cancel_watch()
        except Exception as exc:
            res["error"] = short_error(exc)
        finally:
            stop.set()
            a.close()
            self.ask("RESTART")
        return res

    def retrying(self, fn: Callable[[], Any], within_s: float = 3.0) -> Any:
        deadline = time.monotonic() + within_s
        while True:
            try:
                return fn()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def check_lease(self, a: Adapter, lease: int, key: str) -> str:
        try:
            ttl = self.retrying(lambda: a.lease_ttl(lease))
            present = self.retrying(lambda: a.get(key)) == b"alive"
        except Exception as exc:
            return "cannot tell: " + short_error(exc)
        if ttl > 0 and present:
            return f"kept (TTL {ttl} s, key there)"
        return f"lost (TTL {ttl}, key {'there' if present else 'gone'})"

    def check_watch(
        self,
        a: Adapter,
        key: str,
        seen: dict[str, float],
        errors: list[tuple[float, str]],
        cond: threading.Condition,
        t_kill: float,
    ) -> str:
        try:
            self.retrying(lambda: a.put(key, "after"))
        except Exception as exc:
            return "cannot tell: " + short_error(exc)
        with cond:
            delivered = cond.wait_for(lambda: "after" in seen, timeout=WATCH_WAIT_S)
        told = [e for t, e in errors if t >= t_kill]
        if delivered:
            return "delivered after failover" + (" (after an error)" if told else "")
        if told:
            return f"ended, callback told ({told[0][:60]})"
        return "silent: no event, no error"


def worker_main(name: str, urls: list[str], ops: int, runs: int) -> None:
    signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(int(WORKER_BUDGET_S))
    try:
        Worker(name, urls, ops, runs).run()
        sys.stdout.write(PROTO + "DONE\n")
        sys.stdout.flush()
    finally:
        # a client's own threads (a watch stream on a dead member) must not hold the exit
        os._exit(0)


# ---------------------------------------------------------------------------------------------
# the parent: facts about each package, one worker per client, the report


def dist_footprint(spec: ClientSpec) -> dict[str, Any]:
    """The installed distributions the client pulls in (itself included) and their size."""

    def requires(dist: md.Distribution) -> list[str]:
        names: list[str] = []
        for req in dist.requires or []:
            if "extra ==" in req or "extra==" in req:
                continue
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if m:
                names.append(m.group(1))
        return names

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    try:
        root = md.distribution(spec.dist)
    except md.PackageNotFoundError:
        return {"installed": False}
    seen: dict[str, md.Distribution] = {}
    todo = [spec.dist, *spec.undeclared]
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a conditional requirement not installed here
        seen[name] = dist
        todo.extend(requires(dist))
    size = 0
    for dist in seen.values():
        for f in dist.files or []:
            with contextlib.suppress(OSError):
                size += Path(str(dist.locate_file(f))).stat().st_size
    deps = sorted(f"{d.metadata['Name']} {d.version}" for d in seen.values())
    classifiers = root.metadata.get_all("Classifier") or []
    versions = sorted(
        c.rsplit("::", 1)[1].strip()
        for c in classifiers
        if re.match(r"Programming Language :: Python :: 3\.\d+$", c)
    )
    declared = {norm(n) for n in requires(root)}
    return {
        "installed": True,
        "version": root.version,
        "deps": deps,
        "count": len(seen),
        "mib": size / 2**20,
        "requires_python": root.metadata.get("Requires-Python") or "(not declared)",
        "classifier_pythons": versions,
        "undeclared": [u for u in spec.undeclared if norm(u) not in declared],
        "typed": any(str(f).endswith("py.typed") for f in root.files or []),
        "summary": root.metadata.get("Summary") or "",
    }


def newest_release(spec: ClientSpec, scratch: Path, timeout_s: float) -> dict[str, Any]:
    """The newest release through pip itself: its version and the newest file date inside."""
    dest = scratch / f"dl-{spec.dist}"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec.dist]
    try:
        subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        return {"error": short_error(exc)}
    files = sorted(dest.iterdir())
    if not files:
        return {"error": "pip downloaded nothing"}
    path = files[0]
    m = re.match(r"[A-Za-z0-9_.]+?-(\d[^-]*?)(?:-py|\.tar\.gz|\.zip|-cp)", path.name)
    newest: float | None = None
    if path.suffix == ".whl" or path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            newest = max(
                dt.datetime(*i.date_time, tzinfo=dt.timezone.utc).timestamp() for i in z.infolist()
            )
    elif path.name.endswith(".tar.gz"):
        with tarfile.open(path) as t:
            newest = max(mem.mtime for mem in t.getmembers())
    date = dt.datetime.fromtimestamp(newest, dt.timezone.utc).date() if newest else None
    return {"version": m.group(1) if m else path.name, "date": date.isoformat() if date else None}


def import_without_env(spec: ClientSpec) -> str | None:
    """For a client run with extra environment: does it import without it?"""
    if not spec.env:
        return None
    env = {k: v for k, v in os.environ.items() if k not in spec.env}
    try:
        r = subprocess.run(
            [sys.executable, "-c", f"import {spec.module}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.SubprocessError as exc:
        return short_error(exc)
    if r.returncode == 0:
        return "imports"
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"[A-Za-z_.]+(Error|Exception)\b", ln)]
    last = errors or lines
    return last[-1][:200] if last else f"exit {r.returncode}"


class WorkerRun:
    """One worker process and the conversation with it, bounded in time."""

    def __init__(self, spec: ClientSpec, cluster: Cluster, args: argparse.Namespace, log: Path):
        self.spec = spec
        self.cluster = cluster
        self.parts: dict[str, Any] = {}
        self.log = log
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            spec.name,
            "--endpoints",
            ",".join(m.client_url for m in cluster.members),
            "--ops",
            str(args.ops),
            "--runs",
            str(args.runs),
        ]
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        err = open(log, "wb")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                cwd=REPO,
                preexec_fn=set_pdeathsig,
            )
        finally:
            err.close()

    def lines(self, deadline: float) -> Iterator[str]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                if self.proc.poll() is not None:
                    return
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                yield line.decode(errors="replace")
        raise TimeoutError(f"{self.spec.name}: worker over its time")

    def reply(self, payload: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((PROTO + json.dumps(payload) + "\n").encode())
        self.proc.stdin.flush()

    def run(self, deadline: float) -> None:
        try:
            for line in self.lines(deadline):
                if not line.startswith(PROTO):
                    continue
                kind, _, rest = line[len(PROTO) :].partition(" ")
                if kind == "LEADER":
                    self.reply({"leader": self.cluster.wait_ready(20.0)})
                elif kind == "KILL_LEADER":
                    idx, t_kill = self.cluster.kill_leader()
                    self.reply({"leader": idx, "t_kill": t_kill})
                elif kind == "RESTART":
                    self.cluster.restart_dead()
                    self.reply({"ok": True})
                elif kind == "PART":
                    part = json.loads(rest)
                    self.parts[part["phase"]] = part["data"]
                elif kind == "DONE":
                    break
        except Exception as exc:  # the cluster or the worker: reported, the run goes on
            self.parts.setdefault("worker", short_error(exc))
        finally:
            stop_process(self.proc, grace_s=2.0)
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        if "failover" not in self.parts:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
            self.parts.setdefault("worker", "ended early: " + " | ".join(tail)[:300])


def machine_facts(etcd: str) -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    etcd_version = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([etcd, "--version"], capture_output=True, text=True, timeout=10)
        etcd_version = out.stdout.splitlines()[0].replace("etcd Version:", "").strip()
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "etcd": etcd_version,
    }


def load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


# ---------------------------------------------------------------------------------------------
# the report


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def lat_cells(s: Any) -> list[str]:
    if not isinstance(s, dict) or not s.get("n"):
        return ["—", "—"]
    return [fmt(s["p50"]), fmt(s["p99"])]


def failed_phase(parts: dict[str, Any], phase: str) -> str | None:
    imp = parts.get("import", {})
    if not imp.get("ok"):
        return "cannot import: " + str(imp.get("error", parts.get("worker", "no result")))
    data = parts.get(phase)
    if data is None:
        return "no result: " + str(parts.get("worker", "worker ended"))
    if isinstance(data, dict) and "error" in data:
        return "cannot: " + str(data["error"])
    return None


def failover_median(parts: dict[str, Any]) -> float | None:
    runs = parts.get("failover")
    if not isinstance(runs, list) or not runs:
        return None
    times = [r.get("first_write_ms") for r in runs]
    if any(t is None for t in times):
        return None
    return statistics.median(times)


@dataclass
class Outcome:
    spec: ClientSpec
    parts: dict[str, Any]
    meta: dict[str, Any]
    release: dict[str, Any]
    no_env: str | None


def choose(outcomes: list[Outcome], today: dt.date) -> list[tuple[Outcome, list[str]]]:
    """Rank the clients: hard needs first, then failover time, then latency. With reasons."""
    ranked: list[tuple[tuple[Any, ...], Outcome, list[str]]] = []
    for o in outcomes:
        p = o.parts
        fails: list[str] = []
        if not p.get("import", {}).get("ok"):
            fails.append("does not import")
        fo = failover_median(p)
        if fo is None:
            fails.append("failover not recovered in every run")
        date = o.release.get("date")
        months = None
        if date:
            d = dt.date.fromisoformat(date)
            months = (today.year - d.year) * 12 + today.month - d.month
            if months > 24:
                fails.append(f"newest release {date}, {months} months ago")
        thr = p.get("threads", {})
        if not isinstance(thr, dict) or thr.get("errors") or thr.get("mismatches"):
            fails.append("errors when shared by threads")
        runs = p.get("failover") if isinstance(p.get("failover"), list) else []
        watch_told = bool(runs) and all(
            not str(r.get("watch", "")).startswith("silent") for r in runs
        )
        if runs and not watch_told:
            fails.append("a watch broken by the failover goes silent")
        put = p.get("kv", {}).get("put", {}).get("p50") if isinstance(p.get("kv"), dict) else None
        key = (len(fails), fo if fo is not None else 1e9, put if put is not None else 1e9)
        ranked.append((key, o, fails))
    ranked.sort(key=lambda x: x[0])
    return [(o, fails) for _, o, fails in ranked]


def report(
    outcomes: list[Outcome],
    facts: dict[str, str],
    args: argparse.Namespace,
    started: dt.datetime,
    seconds: float,
    loads: tuple[str, str],
) -> str:
    w: list[str] = []
    cmd = " ".join([sys.executable, *sys.argv])
    w.append("# etcd clients for xmig's HA control plane\n")
    w.append(f"Measured {started:%Y-%m-%d %H:%M} UTC with `{cmd}` ({seconds:.0f} s in all).\n")
    w.append(
        f"Machine: {facts['cpu']}, {facts['cores']} cores, {facts['kernel']}, "
        f"Python {facts['python']}, etcd {facts['etcd']} (Debian's `etcd-server`). "
        f"Load average at the start {loads[0]}, at the end {loads[1]}: the machine is shared "
        "with another benchmark, so single milliseconds are noise.\n"
    )
    w.append(
        f"Cluster: {MEMBERS} members on 127.0.0.1, `{' '.join(ETCD_TIMING)}`, data on local "
        f"disk (fsync on). Every client talks to the leader; {args.ops} operations per "
        "latency row, one after another from one thread, after 20 warm-up puts and gets.\n"
    )

    w.append("## The clients\n")
    w.append(
        "| client | import | version (newest release) | transport | several endpoints | "
        "pulls in | Python |"
    )
    w.append("|---|---|---|---|---|---|---|")
    for o in outcomes:
        m, p = o.meta, o.parts
        imp = p.get("import", {})
        imp_txt = "yes" if imp.get("ok") else "no: " + str(imp.get("error", "?"))
        if o.spec.env and imp.get("ok"):
            env = " ".join(f"{k}={v}" for k, v in o.spec.env.items())
            imp_txt = f"only with `{env}` (without: `{o.no_env}`)"
        if imp.get("warnings"):
            imp_txt += f"; {len(imp['warnings'])} warnings on import (first: {imp['warnings'][0]}…)"
        rel = o.release
        rel_txt = (
            f"{m.get('version', '?')} ({rel.get('version', '?')}, {rel.get('date', '?')})"
            if "error" not in rel
            else f"{m.get('version', '?')} (unknown: {rel['error']})"
        )
        deps = ", ".join(m.get("deps", []))
        pulls = f"{m.get('count', '?')} dists, {fmt(m.get('mib'), 1)} MiB: {deps}"
        if m.get("undeclared"):
            pulls += f" (**{', '.join(m['undeclared'])} needed but not declared**)"
        pys = ", ".join(m.get("classifier_pythons", [])) or "none listed"
        py_txt = (
            f"requires {m.get('requires_python')}; classifiers {pys}; "
            f"{'runs' if imp.get('ok') else 'fails'} on {facts['python']} here; "
            f"{'typed (py.typed)' if m.get('typed') else 'no type hints'}"
        )
        w.append(
            f"| {o.spec.name} (`import {o.spec.module}`) | {imp_txt} | {rel_txt} | "
            f"{o.spec.transport} | {o.spec.endpoints} | {pulls} | {py_txt} |"
        )
    w.append(
        "\nNewest release: `pip download --no-deps NAME` and the newest timestamp inside the "
        "downloaded archive (its build date). Footprint: the installed distributions the "
        "client requires, recursively, itself included, and their files' size on disk.\n"
    )

    w.append("## (a) Key-value latency (ms)\n")
    w.append(
        "| client | put p50 | put p99 | get p50 | get p99 | create-if-absent txn p50 | p99 | "
        "txn semantics | errors |"
    )
    w.append("|---|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        why = failed_phase(o.parts, "kv")
        if why:
            w.append(f"| {o.spec.name} | {why} |||||||")
            continue
        kv = o.parts["kv"]
        errs = sum(kv[op].get("errors", 0) for op in ("put", "get", "create"))
        sem = "ok" if kv.get("create_semantics_ok") else "**wrong**"
        w.append(
            f"| {o.spec.name} | "
            + " | ".join(lat_cells(kv["put"]) + lat_cells(kv["get"]) + lat_cells(kv["create"]))
            + f" | {sem} | {errs} |"
        )
    w.append(
        "\nGets are linearizable (etcd's default). The transaction compares the key's "
        "`create_revision` with 0 and puts it only then; a second create of the same key "
        'must fail ("txn semantics").\n'
    )

    w.append("## (b) Leases (ms)\n")
    w.append(
        "| client | grant p50 | grant p99 | one keep-alive p50 | p99 | keep-alive loop built in |"
    )
    w.append("|---|---|---|---|---|---|")
    for o in outcomes:
        why = failed_phase(o.parts, "lease")
        if why:
            w.append(f"| {o.spec.name} | {why} |||||")
            continue
        le = o.parts["lease"]
        w.append(
            f"| {o.spec.name} | "
            + " | ".join(lat_cells(le["grant"]) + lat_cells(le["refresh"]))
            + " | no: one call per refresh, the caller loops |"
        )
    w.append("")

    w.append("## (c) Watch: from the put to the watcher's callback (ms)\n")
    w.append("| client | p50 | p99 | events lost | how it delivers |")
    w.append("|---|---|---|---|---|")
    delivery = {
        "etcd-sdk-python": "callback on the client's one watch thread (one gRPC stream)",
        "etcd3gw": "callback on a thread pool reading one HTTP stream per watch",
        "etcd3": "callback on the client's one watch thread (one gRPC stream)",
    }
    for o in outcomes:
        why = failed_phase(o.parts, "watch")
        if why:
            w.append(f"| {o.spec.name} | {why} ||||")
            continue
        wa = o.parts["watch"]
        w.append(
            f"| {o.spec.name} | "
            + " | ".join(lat_cells(wa["latency"]))
            + f" | {wa['lost']} of {wa['sent']} | {delivery.get(o.spec.name, '?')} |"
        )
    w.append(
        "\nThe latency includes the put itself (the event leaves etcd when the put commits).\n"
    )

    w.append("## (d) Failover: leader SIGKILLed while writing\n")
    w.append(
        f"Each write has its own {FAILOVER_OP_TIMEOUT_S} s timeout; the client was given all "
        "three endpoints and was talking to the leader when it was killed. Time from the "
        "SIGKILL to the end of the first successful write started after it; the killed member "
        "is restarted between runs.\n"
    )
    w.append("| client | " + " | ".join(f"run {r + 1} (ms)" for r in range(args.runs)))
    w[-1] += " | median (ms) | failed writes per run | errors seen |"
    w.append("|---|" + "---|" * (args.runs + 3))
    for o in outcomes:
        why = failed_phase(o.parts, "failover")
        if why:
            w.append(f"| {o.spec.name} | {why} |" + "|" * (args.runs + 2))
            continue
        runs = o.parts["failover"]
        cells = []
        for r in runs:
            if "error" in r:
                cells.append("error: " + r["error"])
            elif r.get("first_write_ms") is None:
                cells.append(f"none in {FAILOVER_GIVE_UP_S:.0f} s")
            else:
                cells.append(
                    fmt(r["first_write_ms"], 0) + ("" if r.get("client_on_leader") else "*")
                )
        cells += ["—"] * (args.runs - len(cells))
        failed = ", ".join(str(r.get("failed_attempts", "?")) for r in runs)
        errs = sorted({e for r in runs for e in r.get("errors", [])})
        w.append(
            f"| {o.spec.name} | "
            + " | ".join(cells)
            + f" | {fmt(failover_median(o.parts), 0)} | {failed} | {'; '.join(errs)[:220]} |"
        )
    off_leader = any(
        isinstance(o.parts.get("failover"), list)
        and any(r.get("client_on_leader") is False for r in o.parts["failover"])
        for o in outcomes
    )
    w.append(
        "\nFailed writes: attempts that started after the kill and failed before the first "
        "success."
        + (" (* the client was not on the leader when it was killed.)" if off_leader else "")
        + "\n"
    )

    w.append("## (e) Do a lease and a watch survive the failover?\n")
    w.append(
        f"Before the kill: a lease (TTL {LEASE_TTL_S} s) with a key on it, kept alive by a "
        f"thread of the bench every {KEEPALIVE_EVERY_S} s through the same client, and a "
        f"watch on another key. {HOLD_AFTER_KILL_S} s after the kill (past the TTL): is the "
        "lease alive with its key, and does the watch opened before the kill deliver a put "
        f"made after it (waiting {WATCH_WAIT_S:.0f} s)? The first keep-alive after the kill "
        f"is known to within the keep-alive period ({KEEPALIVE_EVERY_S} s).\n"
    )
    w.append("| client | run | first keep-alive after the kill (ms) | lease | watch |")
    w.append("|---|---|---|---|---|")
    for o in outcomes:
        why = failed_phase(o.parts, "failover")
        if why:
            w.append(f"| {o.spec.name} | {why} ||||")
            continue
        for r in o.parts["failover"]:
            w.append(
                f"| {o.spec.name} | {r.get('run')} | {fmt(r.get('keepalive_gap_ms'), 0)} | "
                f"{r.get('lease', r.get('error', '?'))} | {r.get('watch', r.get('error', '?'))} |"
            )
    w.append("")

    w.append("## Shared by threads\n")
    w.append(
        f"One client, {THREADS} threads, each {THREAD_OPS} × (put its key, get it back, "
        "create a new key); a mismatch is a get that did not return the thread's own last "
        "value or a create that failed.\n"
    )
    w.append("| client | ops | errors | mismatches | hung threads | ops/s |")
    w.append("|---|---|---|---|---|---|")
    for o in outcomes:
        why = failed_phase(o.parts, "threads")
        if why:
            w.append(f"| {o.spec.name} | {why} |||||")
            continue
        t = o.parts["threads"]
        errs = f"{t['errors']}" + (f" ({'; '.join(t['error_kinds'])})" if t["errors"] else "")
        w.append(
            f"| {o.spec.name} | {t['ops']} | {errs} | {t['mismatches']} | {t['hung']} | "
            f"{t['ops_per_s']:.0f} |"
        )
    w.append(
        "\nFrom the code: etcd-sdk-python and etcd3 share one gRPC channel (thread-safe) but "
        "keep their endpoint choice and stub cache in plain attributes, unlocked; etcd3gw "
        "shares one `requests.Session` across threads (not documented thread-safe; its "
        "connection pool is). The failover runs above also drive each client from two threads "
        "at once (writer and keep-alive).\n"
    )

    today = started.date()
    ranked = choose(outcomes, today)
    w.append("## Choice\n")
    best, best_fails = ranked[0]
    p = best.parts
    kv = p.get("kv", {}) if isinstance(p.get("kv"), dict) else {}
    wa = p.get("watch", {}) if isinstance(p.get("watch"), dict) else {}
    fo = failover_median(p)
    thr = p.get("threads", {}) if isinstance(p.get("threads"), dict) else {}
    if best_fails:
        w.append(
            f"No client meets every need; the closest is **{best.spec.name}** "
            f"({'; '.join(best_fails)}).\n"
        )
    else:
        w.append(f"**{best.spec.name}** (`{best.spec.dist}`, `import {best.spec.module}`).\n")
    reasons = [
        f"failover: the first write {fmt(fo, 0)} ms (median of {args.runs}) after the leader's "
        f"SIGKILL; several endpoints: {best.spec.endpoints}",
        f"put {fmt(kv.get('put', {}).get('p50'))} ms, get {fmt(kv.get('get', {}).get('p50'))} "
        f"ms, create-if-absent {fmt(kv.get('create', {}).get('p50'))} ms (p50); a watch event "
        f"{fmt(wa.get('latency', {}).get('p50'))} ms after its put; "
        f"{fmt(thr.get('ops_per_s'), 0)} ops/s from {THREADS} threads sharing it, "
        f"{thr.get('errors', '?')} errors, {thr.get('mismatches', '?')} mismatches",
    ]
    runs = p.get("failover") if isinstance(p.get("failover"), list) else []
    if runs:
        leases = sum(1 for r in runs if str(r.get("lease", "")).startswith("kept"))
        silent = any(str(r.get("watch", "")).startswith("silent") for r in runs)
        told = "goes silent" if silent else "is reported to its callback"
        reasons.append(
            f"a lease kept alive by our own thread survived {leases} of {len(runs)} failovers; "
            f"a watch broken by it {told}"
        )
    medians = [m for m in (failover_median(o.parts) for o in outcomes) if m is not None]
    if len(medians) > 1:
        reasons.append(
            f"the failover medians of all clients lie within {max(medians) - min(medians):.0f} ms "
            f"of each other ({min(medians):.0f}-{max(medians):.0f} ms): etcd's election "
            "sets the time, so the choice rests on what each client does around it"
        )
    bm = best.meta
    reasons.append(
        f"footprint: {bm.get('count', '?')} distributions, {fmt(bm.get('mib'), 1)} MiB installed; "
        f"newest release {best.release.get('version', '?')} of {best.release.get('date', '?')}"
    )
    for o, fails in ranked[1:]:
        ofo = failover_median(o.parts)
        why_not = "; ".join(fails) if fails else "ranked lower on failover time, then put latency"
        okv = o.parts.get("kv", {}) if isinstance(o.parts.get("kv"), dict) else {}
        othr = o.parts.get("threads", {}) if isinstance(o.parts.get("threads"), dict) else {}
        reasons.append(
            f"not {o.spec.name}: {why_not} (failover {fmt(ofo, 0)} ms median; put "
            f"{fmt(okv.get('put', {}).get('p50'))} ms, get {fmt(okv.get('get', {}).get('p50'))} "
            f"ms p50; {fmt(othr.get('ops_per_s'), 0)} ops/s from {THREADS} threads; "
            f"{o.meta.get('count', '?')} distributions, {fmt(o.meta.get('mib'), 1)} MiB; "
            f"several endpoints: {o.spec.endpoints})"
        )
    for r in reasons:
        w.append(f"- {r}")
    w.append("\nWhat it lacks, and what xmig does about it:\n")
    for g in best.spec.gaps:
        w.append(f"- {g}")
    w.append("\n## Gotchas met\n")
    for g in GOTCHAS:
        w.append(f"- {g}")
    w.append("")
    return "\n".join(w)


def parent_main(args: argparse.Namespace) -> int:
    etcd = shutil.which("etcd")
    if etcd is None:
        print("etcd not found: apt-get install -y etcd-server etcd-client", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        print(f"unknown clients: {unknown}; known: {list(CLIENTS)}", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    load_start = load()

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("the bench ran past --budget")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    signal.alarm(int(args.budget) + 60)  # last resort; every wait below has its own bound
    root = Path(tempfile.mkdtemp(prefix="etcd-clients-bench-"))
    cluster = Cluster(root, etcd)
    outcomes: list[Outcome] = []
    try:
        facts = machine_facts(etcd)
        cluster.start()
        print(f"cluster up: {[m.client_url for m in cluster.members]}", flush=True)
        for name in names:
            spec = CLIENTS[name]
            print(f"[{time.monotonic() - t0:5.0f} s] {name}: package facts", flush=True)
            meta = dist_footprint(spec)
            release = newest_release(spec, root, timeout_s=min(120.0, deadline - time.monotonic()))
            no_env = import_without_env(spec)
            print(f"[{time.monotonic() - t0:5.0f} s] {name}: measuring", flush=True)
            cluster.restart_dead()
            run = WorkerRun(spec, cluster, args, root / f"worker-{name}.log")
            run.run(min(deadline, time.monotonic() + WORKER_BUDGET_S + 30))
            outcomes.append(Outcome(spec, run.parts, meta, release, no_env))
            fo = failover_median(run.parts)
            print(f"  failover median: {fmt(fo, 0)} ms; parts: {sorted(run.parts)}", flush=True)
        seconds = time.monotonic() - t0
        text = report(outcomes, facts, args, started, seconds, (load_start, load()))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out} in {seconds:.0f} s", flush=True)
        return 0
    finally:
        signal.alarm(0)
        pids = cluster.pids()
        cluster.stop()
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        if left:
            print(f"etcd processes still there: {left}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--ops", type=int, default=300, help="operations per latency row")
    ap.add_argument("--runs", type=int, default=3, help="failover runs per client")
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--budget", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.endpoints.split(","), args.ops, args.runs)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
