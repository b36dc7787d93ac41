"""A thin wrapper over the ``runc`` binary: run, kill, delete, list, checkpoint, restore.

Every call is bounded and fails with one :class:`RuncError` whose message carries runc's own
last lines. Checkpoint and restore use xmig's CRIU (``xmig.migrate.criu``); the CRIU options a
container needs (its TCP connections closed, no network lock in the node's shared namespace)
come from the container's ``org.criu.config`` annotation (``xmig.container.bundle``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from xmig.migrate import criu

ENV_VAR = "XMIG_RUNC"
"""Environment variable naming the runc binary to use (no fallback when set)."""

INSTALL_HINT = "install it (Debian: apt install runc)"
CALL_TIMEOUT_S = 30.0
_TAIL_LINES = 12
_HIGH_FD = 100  # where the extra fds wait before they go to 3, 4, ...


class RuncError(RuntimeError):
    """A runc command failed, or runc is missing; the message says which and why."""


def find_runc() -> str | None:
    """The runc binary: ``$XMIG_RUNC`` when set (and nothing else then), else ``runc`` on PATH."""
    env = os.environ.get(ENV_VAR)
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    return shutil.which("runc")


def require_runc() -> str:
    """The runc binary, or RuncError saying why there is none."""
    found = find_runc()
    if found is None:
        where = f"${ENV_VAR}={os.environ[ENV_VAR]}" if os.environ.get(ENV_VAR) else "PATH"
        raise RuncError(f"--container needs runc, and there is none on {where}: {INSTALL_HINT}")
    return found


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-_TAIL_LINES:])


def _runc(args: Sequence[str], what: str, *, timeout: float = CALL_TIMEOUT_S,
          stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE,
          stderr: Any = subprocess.PIPE,
          preexec: Callable[[], None] | None = None,
          close_fds: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    binary = require_runc()
    try:
        done = subprocess.run([binary, *args], stdin=stdin, stdout=stdout,
                              stderr=stderr, timeout=timeout, check=False, text=True,
                              preexec_fn=preexec, close_fds=close_fds)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuncError(f"{what}: runc did not finish within {timeout:.0f} s") from None
    except OSError as exc:
        raise RuncError(f"{what}: cannot run {binary}: {exc}") from None
    if done.returncode != 0:
        said = _tail((done.stderr or "") + (done.stdout or "") if stderr is subprocess.PIPE
                     else "")  # fmt: skip
        raise RuncError(f"{what} failed (runc exit {done.returncode})"
                        + (f": {said}" if said else ""))  # fmt: skip
    return done


def run(container_id: str, bundle: str | os.PathLike[str], *, stdout: int, stderr: int,
        pid_file: str | os.PathLike[str], stdin: Any = subprocess.DEVNULL,
        extra_fds: Sequence[int] = (), timeout: float = CALL_TIMEOUT_S) -> int:  # fmt: skip
    """Start the container detached; its init's PID. Its stdin, stdout and stderr are
    ``stdin``/``stdout``/``stderr`` (pipes: CRIU cannot take a host file along); ``extra_fds``
    become its fds 3, 4, ... in order. runc's own complaints are read from a file of the
    bundle, since its stderr is the container's."""
    log = Path(bundle) / "runc.log"
    fds = list(extra_fds)

    def hand_over() -> None:  # in the child: stdout/stderr set, the extra fds at 3, 4, ...
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, _HIGH_FD) for fd in fds]  # out of the way
        for index, fd in enumerate(moved):
            os.dup2(fd, 3 + index, inheritable=True)
            os.close(fd)

    args = ["--log", str(log), "run", "--detach", "--bundle", str(bundle), "--pid-file",
            str(pid_file), "--preserve-fds", str(len(fds)), container_id]  # fmt: skip
    try:
        _runc(args, f"starting container {container_id}", timeout=timeout, stdin=stdin,
              stdout=stdout, stderr=stderr, preexec=hand_over, close_fds=not fds)  # fmt: skip
    except RuncError as exc:
        said = _log_errors(log)
        raise RuncError(f"{exc}: {said}" if said else str(exc)) from None
    return int(Path(pid_file).read_text().strip())


def run_to_end(container_id: str, bundle: str | os.PathLike[str],
               timeout: float) -> tuple[int, str]:  # fmt: skip
    """Run the container in the foreground to its end: its exit code and its output (runc's
    own complaints with it). RuncError when it outlasts ``timeout`` (then it is removed)."""
    binary = require_runc()
    try:
        done = subprocess.run([binary, "run", "--bundle", str(bundle), container_id],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        delete(container_id)
        raise RuncError(f"container {container_id} did not end within {timeout:.0f} s") from None
    except OSError as exc:
        raise RuncError(f"cannot run {binary}: {exc}") from None
    return done.returncode, done.stdout + done.stderr


def _log_errors(log: Path) -> str:
    """The messages of runc's JSON log's error lines (the last few)."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return ""
    said = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "fatal"):
            said.append(str(entry.get("msg", "")))
    return "; ".join(said[-3:])


def delete(container_id: str) -> None:
    """Remove the container (its state and cgroups), killing what still runs in it."""
    try:
        _runc(["delete", "--force", container_id], f"removing container {container_id}")
    except RuncError as exc:
        if "does not exist" not in str(exc) and "not exist" not in str(exc):
            raise


def list_ids(prefix: str) -> list[str]:
    """The IDs of runc's containers that begin with ``prefix``."""
    done = _runc(["list", "--format", "json"], "listing containers")
    entries = json.loads(done.stdout or "null") or []
    return sorted(e["id"] for e in entries if str(e.get("id", "")).startswith(prefix))


def checkpoint(container_id: str, images: str | os.PathLike[str],
               timeout: float = 600.0) -> float:  # fmt: skip
    """Checkpoint the container into ``images`` (CRIU ends it; runc removes it); seconds taken.
    CRIU's log (``dump.log``) stays among the images."""
    images = Path(images)
    images.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        _runc(["--criu", _criu(), "checkpoint", "--image-path", str(images), "--work-path",
               str(images), container_id], f"checkpointing container {container_id}",
              timeout=timeout)  # fmt: skip
    except RuncError as exc:
        raise RuncError(_with_criu_log(str(exc), images / "dump.log")) from None
    return time.monotonic() - started


def restore(container_id: str, bundle: str | os.PathLike[str],
            images: str | os.PathLike[str], *, stdout: int, stderr: int,
            pid_file: str | os.PathLike[str], timeout: float = 600.0) -> int:  # fmt: skip
    """Restore the container checkpointed into ``images`` under the same ID, from ``bundle``
    (its config names this node's network namespace), detached; its init's PID. Its stdout
    and stderr become ``stdout``/``stderr`` (runc hands its own on)."""
    work = Path(bundle) / "restore.work"
    work.mkdir(parents=True, exist_ok=True)
    try:
        _runc(["--criu", _criu(), "restore", "--detach", "--image-path", str(images),
               "--work-path", str(work), "--bundle", str(bundle), "--pid-file", str(pid_file),
               container_id], f"restoring container {container_id}", timeout=timeout,
              stdout=stdout, stderr=stderr)  # fmt: skip
    except RuncError as exc:
        raise RuncError(_with_criu_log(str(exc), work / "restore.log")) from None
    return int(Path(pid_file).read_text().strip())


def _criu() -> str:
    found = criu.find_criu()
    if found is None:
        raise RuncError(f"container migration needs CRIU: {criu.INSTALL_HINT}")
    return found


def _with_criu_log(message: str, log: Path) -> str:
    try:
        lines = [line for line in log.read_text().splitlines()
                 if "Error" in line and "RLIMIT_NOFILE" not in line]  # fmt: skip
    except OSError:
        return message
    return message + ("\n" + "\n".join(lines[-_TAIL_LINES:]) if lines else "")
