"""Simulated hosts for tests of one launcher per host: each host a network namespace of its
own with its own address, every process started in one ended when the test ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from xmig.launch.hosts import SimulatedHosts

from helpers import REPO

SECRET = "a-secret-every-host-of-the-job-holds"
PORT = 29400
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="simulated hosts need root (network namespaces)"
)


class Hosts:
    """Simulated hosts, each ``xmig run`` of which runs in its own namespace."""

    def __init__(self, count: int, tmp_path: Path) -> None:
        self.net = SimulatedHosts(f"mh-{uuid.uuid4().hex[:8]}", count).create()
        self.tmp_path = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def endpoint(self) -> str:
        return f"{self.net.address(0)}:{PORT}"

    def start(self, name: str, node: int, args: list[str], secret: str = SECRET,
              namespace: int | None = None) -> subprocess.Popen:  # fmt: skip
        """``xmig run ARGS`` as host ``node`` (in namespace ``namespace``, its own by
        default), its output in ``NAME.log``; a host's own jobs folder, as on its own
        machine."""
        where = node if namespace is None else namespace
        env = {**os.environ, "XMIG_SECRET": secret, **self.net.environment(where),
               "XMIG_JOBS_DIR": str(self.tmp_path / name / "jobs")}  # fmt: skip
        cmd = [sys.executable, "-m", "xmig", "run", "--node-rank", str(node), *args]
        return self.spawn(name, cmd, env, where)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str], namespace: int | None,
              cwd: Path = REPO) -> subprocess.Popen:  # fmt: skip
        """Any command ``cmd`` in a session of its own, in host ``namespace``'s network
        namespace (None: this machine's), its output in ``NAME.log``; ended by ``close``."""
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the child writes it
        enter = None if namespace is None else self.net.enter(namespace)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            preexec_fn=enter, start_new_session=True,
        )  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"host {name} did not end in {timeout} s:\n"
                                 f"{self.output(name)}") from None  # fmt: skip

    def namespace_pids(self, node: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.net.namespace(node)],
                                capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        return [int(p) for p in listed.stdout.split()]

    def kill_host(self, node: int) -> list[int]:
        """Every process of host ``node`` at once: its launcher, agent and workers."""
        pids = self.namespace_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for node in range(self.net.count):
            with contextlib.suppress(subprocess.SubprocessError):
                self.kill_host(node)
        self.net.remove()


@pytest.fixture(name="hosts")
def hosts_fixture(tmp_path):
    """``hosts(count)``: that many simulated hosts, removed with their processes at the end."""
    made: list[Hosts] = []

    def make(count: int) -> Hosts:
        made.append(Hosts(count, tmp_path))
        return made[-1]

    yield make
    for each in made:
        each.close()
