"""A real etcd cluster on loopback for tests: members started by hand (Debian's
``etcd-server``), quick elections, every process ended by PID."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="needs etcd (Debian: apt install etcd-server)")  # fmt: skip
START_TIMEOUT_S = 30.0


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class EtcdCluster:
    """``size`` members on 127.0.0.1 with elections in a fraction of a second."""

    def __init__(self, size: int = 3, host: str = "127.0.0.1") -> None:
        self.size = size
        self.host = host  # the address its members listen on
        self.folder = Path(tempfile.mkdtemp(prefix="xmig-etcd-"))
        ports = _free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.procs: list[subprocess.Popen | None] = [None] * size

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client_ports)

    def _cluster(self) -> str:
        return ",".join(f"m{i}=http://{self.host}:{p}" for i, p in enumerate(self.peer_ports))

    def start_member(self, i: int, state: str = "new") -> None:
        client, peer = self.client_ports[i], self.peer_ports[i]
        log = open(self.folder / f"m{i}.log", "a")  # noqa: SIM115 - the member writes it
        self.procs[i] = subprocess.Popen(
            ["etcd", "--name", f"m{i}", "--data-dir", str(self.folder / f"m{i}"),
             "--listen-client-urls", f"http://{self.host}:{client}",
             "--advertise-client-urls", f"http://{self.host}:{client}",
             "--listen-peer-urls", f"http://{self.host}:{peer}",
             "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
             "--initial-cluster", self._cluster(), "--initial-cluster-state", state,
             "--initial-cluster-token", self.folder.name,
             "--heartbeat-interval", "50", "--election-timeout", "250"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def start(self) -> EtcdCluster:
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            done = subprocess.run(
                ["etcdctl", "--endpoints", self.url[len("etcd://"):], "--command-timeout=1s",
                 "put", "/xmig-test/health", "ok"],
                capture_output=True, text=True, timeout=10, check=False,
                env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            if done.returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"etcd did not come up in {START_TIMEOUT_S} s")

    def leader_member(self) -> int:
        """The index of the member that leads the cluster now."""
        for i, port in enumerate(self.client_ports):
            if self.procs[i] is None or self.procs[i].poll() is not None:
                continue
            done = subprocess.run(
                ["etcdctl", "--endpoints", f"{self.host}:{port}", "endpoint", "status",
                 "--write-out", "json"],
                capture_output=True, text=True, timeout=10, check=False,
                env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            if done.returncode == 0 and '"leader"' in done.stdout:
                import json

                status = json.loads(done.stdout)[0]["Status"]
                if status["header"]["member_id"] == status["leader"]:
                    return i
        raise AssertionError("no etcd member leads")

    def kill_member(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for i in range(self.size):
            with contextlib.suppress(Exception):
                self.kill_member(i)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(name="etcd_cluster")
def etcd_cluster_fixture():
    cluster = EtcdCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
