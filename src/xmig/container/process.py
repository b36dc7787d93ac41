"""A running container as its node's agent holds it.

The agent starts (or restores) a container detached: runc exits, and the container's init, the
worker, becomes the agent's child (the agent is the child subreaper), watched through a pidfd
and reaped like any worker. Its stdout and stderr are pipes the agent relays to its own (CRIU
cannot take a host file along, and a pipe can be handed to the restored container anew). Once
its init has been reaped, the container is removed from runc (state, cgroups) and its bundle
folder deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from xmig.container import runc
from xmig.container.bundle import ContainerSpec, write_bundle
from xmig.procs import AdoptedProcess

log = logging.getLogger(__name__)

_CHUNK = 4096  # at most PIPE_BUF a write: the ranks' lines do not interleave mid-line


def _relay(source: int, target: int) -> None:
    """Copy what comes from ``source`` to ``target`` until its writers are all gone."""
    try:
        while chunk := os.read(source, _CHUNK):
            with contextlib.suppress(OSError):
                os.write(target, chunk)
    finally:
        os.close(source)


def _output_pipes(container_id: str) -> tuple[int, int]:
    """Write ends for a container's stdout and stderr, relayed to this process's own."""
    ends = []
    for target in (1, 2):
        read, write = os.pipe()
        threading.Thread(target=_relay, args=(read, target), daemon=True,
                         name=f"xmig-relay-{container_id}-{target}").start()  # fmt: skip
        ends.append(write)
    return ends[0], ends[1]


def inner_pid(pid: int) -> int | None:
    """The PID the process ``pid`` has in its own PID namespace (what ``getpid()`` says
    there), or None when it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


class ContainerProcess(AdoptedProcess):
    """A container's init, with the parts of ``Popen`` an agent uses (``pid``, ``poll``,
    ``wait``, ``kill``, ``terminate``, ``stdin``); once reaped, the container is removed."""

    def __init__(self, container_id: str, pid: int, bundle: Path,
                 stdin: IO[bytes] | None = None) -> None:  # fmt: skip
        super().__init__(pid)
        self.container_id = container_id
        self.bundle = bundle
        self.stdin = stdin
        self.inner_pid = inner_pid(pid)
        self._removed = False

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            self.remove()
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def remove(self) -> None:
        """Remove the container from runc and its bundle (its init has ended); once."""
        if self._removed:
            return
        self._removed = True
        if self.stdin is not None:
            with contextlib.suppress(OSError):
                self.stdin.close()
        try:
            runc.delete(self.container_id)
        except runc.RuncError as exc:
            log.warning("container %s was not removed: %s", self.container_id, exc)
        shutil.rmtree(self.bundle, ignore_errors=True)


def start(container_id: str, spec: ContainerSpec, folder: str | os.PathLike[str], *,
          stdin: bool = False, extra_fds: tuple[int, ...] = ()) -> ContainerProcess:  # fmt: skip
    """Start ``spec``'s container as ``container_id`` from a bundle in ``folder``; its init.
    ``stdin``: give it a pipe this process writes to (else /dev/null); ``extra_fds``: its
    fds 3, 4, ... RuncError when it does not start (nothing of it is left)."""
    bundle = write_bundle(folder, spec)
    out, err = _output_pipes(container_id)
    stdin_read = stdin_write = None
    if stdin:
        stdin_read, stdin_write = os.pipe()
    try:
        pid = runc.run(container_id, bundle, stdout=out, stderr=err, pid_file=bundle / "pid",
                       stdin=stdin_read if stdin_read is not None else subprocess.DEVNULL,
                       extra_fds=extra_fds)  # fmt: skip
    except runc.RuncError:
        with contextlib.suppress(runc.RuncError):
            runc.delete(container_id)
        shutil.rmtree(bundle, ignore_errors=True)
        if stdin_write is not None:
            os.close(stdin_write)
        raise
    finally:
        for fd in (out, err, stdin_read):
            if fd is not None:
                os.close(fd)
    writer = os.fdopen(stdin_write, "wb") if stdin_write is not None else None
    return ContainerProcess(container_id, pid, bundle, stdin=writer)


def restore(container_id: str, spec: ContainerSpec, folder: str | os.PathLike[str],
            images: str | os.PathLike[str]) -> tuple[ContainerProcess, float]:  # fmt: skip
    """Restore the container checkpointed into ``images`` as ``container_id``, in ``spec``'s
    network namespace, from a bundle in ``folder``; its init and the seconds runc took."""
    bundle = write_bundle(folder, spec)
    out, err = _output_pipes(container_id)
    started = time.monotonic()
    try:
        pid = runc.restore(container_id, bundle, images, stdout=out, stderr=err,
                           pid_file=bundle / "pid")  # fmt: skip
    except runc.RuncError:
        with contextlib.suppress(runc.RuncError):
            runc.delete(container_id)
        shutil.rmtree(bundle, ignore_errors=True)
        raise
    finally:
        os.close(out)
        os.close(err)
    return ContainerProcess(container_id, pid, bundle), time.monotonic() - started


def run_to_end(container_id: str, spec: ContainerSpec, folder: str | os.PathLike[str],
               timeout: float) -> tuple[int, str]:  # fmt: skip
    """Run ``spec``'s container to its end (a check before a job starts): its exit code and
    output; nothing of it is left."""
    bundle = write_bundle(folder, spec)
    try:
        return runc.run_to_end(container_id, bundle, timeout)
    finally:
        with contextlib.suppress(runc.RuncError):
            runc.delete(container_id)
        shutil.rmtree(bundle, ignore_errors=True)


def remove_all(prefix: str, only: set[str] | None = None) -> list[str]:
    """Kill and remove every runc container whose ID begins with ``prefix`` (a job's, left by
    an agent that was killed), or of those only the ones in ``only``; their IDs."""
    try:
        found = [c for c in runc.list_ids(prefix) if only is None or c in only]
    except runc.RuncError:
        return []
    for container_id in found:
        with contextlib.suppress(runc.RuncError):
            runc.delete(container_id)
    return found
