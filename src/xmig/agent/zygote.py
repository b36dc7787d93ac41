"""A node's zygote: one interpreter with torch loaded that forks the node's workers.

Importing torch, its distributed package and the compiler stack DDP and the optimizers pull in
costs every worker about 3 s of CPU before its script's first line. The agent of a node that
runs bare processes (not containers) starts one zygote (``python -m xmig.agent.zygote``),
which imports all that once, without touching CUDA (a process that initialised CUDA cannot
fork), says ``ready`` on the file descriptor ``XMIG_ZYGOTE_FD``, and then reads orders, one
JSON line each on stdin: a worker's environment, script, arguments and working directory, and
the agent's PID. For each it forks twice and answers the worker's PID (or ``error <why>``) on
the same descriptor. The worker's first parent exits at once, so the worker becomes the
agent's own child (the agent is a child subreaper) and is reaped and watched as a worker the
agent started itself; it leads a session of its own, reads ``/dev/null`` as stdin and dies
with the agent, as one started with ``subprocess`` does. It runs its script only once the
zygote has told the agent its PID (a byte on a pipe of its own): a worker whose PID the agent
never heard of (the zygote stalled, the agent gave up on it and started the rank afresh)
exits instead of running as a second process of the same rank.

What differs from a fresh interpreter: ``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ``
show the zygote's (the node's environment without the rank's own variables; ``os.environ``
has them all), and modules imported by the zygote are not imported again.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from xmig.procs import AdoptedProcess, kill_group, start_waiting

REPLY_FD = "XMIG_ZYGOTE_FD"
ENABLED = "XMIG_ZYGOTE"  # "0": every worker is a fresh interpreter, as before
ZYGOTE_COMMAND = (sys.executable, "-m", "xmig.agent.zygote")
READY_TIMEOUT_S = 120.0  # its imports take 2-3 s; a node loaded by other jobs takes longer
FORK_TIMEOUT_S = 10.0
REPARENT_TIMEOUT_S = 10.0
GO_TIMEOUT_S = 60.0  # a worker waits this long to be told to run, then exits
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(ENABLED, "1") != "0"


# ---- the zygote's side ------------------------------------------------------------------------
def main() -> None:
    order = serve(int(os.environ.pop(REPLY_FD)))
    # only a forked worker gets here
    from xmig.agent.spare import run_script

    run_script(order["script"], order["args"])


def serve(reply_fd: int) -> dict[str, Any]:
    """Fork a worker for each order on stdin; return the order in that worker (never in the
    zygote, which exits when stdin closes)."""
    from xmig.agent.spare import warm_up

    warm_up(cuda=False)
    os.write(reply_fd, b"ready\n")
    while True:
        line = sys.stdin.buffer.readline()
        if not line:
            sys.exit(0)  # the agent has gone, or needs no more workers
        try:
            order = json.loads(line)
            pid_r, pid_w = os.pipe()
            go_r, go_w = os.pipe()
        except (ValueError, OSError) as exc:
            _answer(reply_fd, f"error {type(exc).__name__}: {exc}")
            continue
        try:
            middle = _fork()
        except OSError as exc:
            for fd in (pid_r, pid_w, go_r, go_w):
                os.close(fd)
            _answer(reply_fd, f"error fork: {exc}")
            continue
        if middle == 0:
            _fork_worker(order, go_r, (reply_fd, pid_r, pid_w, go_w))
            return order  # in the worker
        os.close(pid_w)
        os.close(go_r)
        answer = _read_line(pid_r)
        os.close(pid_r)
        os.waitpid(middle, 0)  # once it has exited, the worker is the agent's child
        if answer.isdigit():
            _answer(reply_fd, answer)
            os.write(go_w, b"1")  # the agent knows it: it may run
        else:
            _answer(reply_fd, f"error no worker forked ({answer or 'fork failed'})")
        os.close(go_w)


def _answer(reply_fd: int, text: str) -> None:
    os.write(reply_fd, text.encode() + b"\n")


def _fork_worker(order: dict[str, Any], go: int, fds: tuple[int, int, int, int]) -> None:
    """In the first child: fork the worker, say its PID, exit. Returns only in the worker,
    once it may run (``go``); ``fds``: the zygote's, which the worker closes."""
    middle = os.getpid()
    try:
        worker = _fork()
    except BaseException:  # noqa: BLE001 (the zygote hears of it as no PID)
        os._exit(1)
    if worker == 0:
        try:
            _become_worker(order, middle, fds)
            ready, _, _ = select.select([go], [], [], GO_TIMEOUT_S)
            if not ready or os.read(go, 1) != b"1":
                os._exit(1)  # the agent never heard of this process: it must not run
            os.close(go)
        except BaseException as exc:  # noqa: BLE001 (as a Popen that failed in the child)
            with contextlib.suppress(OSError):
                os.write(2, f"xmig: a forked worker could not start: {exc!r}\n".encode())
            os._exit(1)
        return
    with contextlib.suppress(OSError):
        os.write(fds[2], f"{worker}\n".encode())
    os._exit(0)


def _fork() -> int:
    with warnings.catch_warnings():
        # Python 3.12 warns of any thread; the only one here is OpenBLAS's, which shuts
        # itself down across a fork (its own atfork handler)
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _become_worker(order: dict[str, Any], middle: int, fds: Sequence[int]) -> None:
    """In the forked worker: what ``subprocess.Popen`` with ``start_new_session``, stdin
    from ``/dev/null``, ``close_fds`` and ``die_with_parent`` would have given it."""
    os.setsid()
    for fd in fds:
        os.close(fd)
    old = sys.stdin
    sys.stdin = None  # type: ignore[assignment]
    old.close()  # fd 0, the orders' pipe
    devnull = os.open(os.devnull, os.O_RDONLY)
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the worker's stdin for its whole life)
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() == middle:  # its first parent is exiting
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0005)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != order["parent"]:  # the agent died meanwhile, or is no subreaper
        os._exit(1)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])


# ---- the agent's side -------------------------------------------------------------------------
class Zygote:
    """The agent's handle on its zygote. Every failure (it did not start, died, or did not
    answer in time) is logged once and ends it: ``fork`` then returns None and the agent
    starts its workers as fresh interpreters."""

    def __init__(self, environ: dict[str, str], cwd: str, command: Sequence[str] = ZYGOTE_COMMAND,
                 fork_timeout: float = FORK_TIMEOUT_S) -> None:  # fmt: skip
        reply_r, reply_w = os.pipe()
        environ = dict(environ)
        environ[REPLY_FD] = str(reply_w)
        try:
            self._proc: subprocess.Popen[bytes] | None = start_waiting(
                command, cwd, environ, reply_w
            )
        except OSError as exc:
            os.close(reply_r)
            self._proc = None
            log.warning("no zygote: %s; workers start as fresh interpreters", exc)
        finally:
            os.close(reply_w)
        self._reply = reply_r if self._proc is not None else -1
        self._pending = b""
        self._ready_by = time.monotonic() + READY_TIMEOUT_S
        self.fork_timeout = fork_timeout
        self.ready = False
        self.forked = 0
        # workers forked but not handed over (their PIDs read after the zygote was ended);
        # killed, and for the agent to reap
        self.abandoned: list[int] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None

    def fork(self, environ: dict[str, str], script: str, args: Sequence[str],
             cwd: str) -> AdoptedProcess | None:  # fmt: skip
        """A worker running ``script`` with ``environ``, forked from the zygote (waiting
        for it to be ready, up to ``READY_TIMEOUT_S`` after it started), or None."""
        if self._proc is None:
            return None
        if not self.ready:
            line = self._line(self._ready_by)
            if line != "ready":
                self._fail(f"it did not get ready ({line or 'no answer'})")
                return None
            self.ready = True
        order = {"env": environ, "script": script, "args": list(args), "cwd": cwd,
                 "parent": os.getpid()}  # fmt: skip
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(order) + "\n").encode())
            self._proc.stdin.flush()
        except OSError as exc:
            self._fail(f"it took no order ({exc})")
            return None
        line = self._line(time.monotonic() + self.fork_timeout)
        if not line.isdigit():
            self._fail(f"it forked no worker ({line or 'no answer'})")
            return None
        self.forked += 1
        return AdoptedProcess(int(line))

    def _line(self, deadline: float) -> str:
        """The zygote's next line, or "" if it ends or says nothing by ``deadline``."""
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._reply], [], [], remaining)[0]:
                return ""
            chunk = os.read(self._reply, 4096)
            if not chunk:
                return ""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def _fail(self, why: str) -> None:
        log.warning("the zygote (pid %s) is ended: %s; workers start as fresh interpreters",
                    self.pid, why)  # fmt: skip
        self.stop()

    def stop(self) -> None:
        """End it at once (SIGKILL: it holds nothing; an exit would spend a second unloading
        torch) and reap it; the workers it forked live on."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        proc.kill()
        proc.wait()
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        # a PID it said after the agent stopped listening: that worker may have been told to
        # run, so it is ended here (one it did not say was never told to, and exits)
        self._pending += _available(self._reply)
        for line in self._pending.decode(errors="replace").splitlines():
            if line.strip().isdigit():
                pid = int(line)
                kill_group(pid, signal.SIGKILL)
                self.abandoned.append(pid)
        self._pending = b""
        os.close(self._reply)


def _available(fd: int) -> bytes:
    """What can be read from ``fd`` now, without waiting."""
    data = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


if __name__ == "__main__":
    main()
