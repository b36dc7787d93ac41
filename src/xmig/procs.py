"""Process helpers shared by the launcher and the agents."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGKILL the child when the thread that started it dies.

    Linux ties this to the spawning *thread*, so xmig always spawns from a long-lived main
    thread; it guarantees that no worker outlives its agent and no agent its launcher.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_waiting(command: Sequence[str], cwd: str, environ: dict[str, str],
                  fd: int) -> subprocess.Popen[bytes]:  # fmt: skip
    """Start a warm interpreter of a node (a hot spare, a zygote) that reads its orders on
    stdin and answers on ``fd``: a session of its own, dying with this process."""
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=environ,
        stdin=subprocess.PIPE,
        pass_fds=(fd,),
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def outlive_parent() -> None:
    """Undo ``die_with_parent`` for this process (before it is moved to another parent)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, 0)


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; returns once the process is reaped."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def kill_group(pid: int, sig: int) -> None:
    """Signal the process group that ``pid`` leads: a worker and every process it started
    that stayed in its group (as torchrun's ``close()`` does). Only ``pid`` itself when it
    leads no group of its own, so that the caller's own group is never hit."""
    try:
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgrp():
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class AdoptedProcess:
    """A child this process did not start itself (a worker restored by CRIU, a container's
    init, re-parented to its agent, their child subreaper): the parts of ``Popen`` an agent
    uses."""

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
