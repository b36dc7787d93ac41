"""A node's pool of hot spares: interpreters started ahead of need (``xmig.agent.spare``),
torch loaded, each waiting to become a replacement worker.

The pool starts spares, notices when one is ready (the agent's selector watches each spare's
ready pipe and calls :meth:`SparePool.on_ready`), hands a ready one a worker's environment and
kills them all when the node stops. Only the agent's main thread uses it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from xmig.agent.spare import READY_FD
from xmig.jobspec import JobSpec
from xmig.procs import kill_group, start_waiting

SPARE_DELAY_S = 5.0  # a new spare waits this long, so its start does not slow a recovery
SPARE_RETRY_S = 30.0  # after a spare that could not be started
CORES_PER_PROCESS = 2  # cores a node needs per worker and spare to warm spares up beside them
SPARE_COMMAND = (sys.executable, "-m", "xmig.agent.spare")

log = logging.getLogger(__name__)


def spare_may_start(cores: int, workers: int, spares_wanted: int, workers_starting: bool) -> bool:
    """Whether a spare may start its warm-up now. On a node with cores for every worker and
    spare, spares warm up beside the starting workers (ready sooner, on a GPU node about the
    time training begins); on a smaller one they wait until the workers are up (each has begun
    a step), so as not to slow the workers' own start."""
    return not workers_starting or cores >= CORES_PER_PROCESS * (workers + spares_wanted)


# starts a spare's command in a container instead: (command, environment, ready pipe's
# write end) -> its process, with the parts of Popen the pool uses (``stdin`` among them)
ContainerStarter = Callable[[Sequence[str], dict[str, str], int], Any]


@dataclass
class Spare:
    """A pre-started interpreter (``xmig.agent.spare``) waiting to become a worker."""

    proc: Any  # subprocess.Popen, or a container's init (xmig.container.process)
    ready_fd: int
    ready: bool = False


class SparePool:
    """The hot spares of one node.

    ``selector`` is the agent's: the pool registers each starting spare's ready pipe in it,
    with the :class:`Spare` as its data; when that pipe is readable the agent calls
    :meth:`on_ready`. ``environ`` gives the environment a spare starts with (the node's
    workers'). ``wanted`` is how many spares the pool keeps: the job's ``hot_spares``, 0 once
    the node stops.
    """

    def __init__(
        self,
        selector: selectors.BaseSelector,
        environ: Callable[[], dict[str, str]],
        wanted: int = 0,
        command: Sequence[str] = SPARE_COMMAND,
    ) -> None:
        self.wanted = wanted
        self._selector = selector
        self._environ = environ
        self._command = list(command)
        self._spares: list[Spare] = []
        self._due = 0.0  # no new spare before this (monotonic): one was just taken
        self.in_container: ContainerStarter | None = None  # container mode: how to start one

    def __len__(self) -> int:
        """Spares started and not taken, ready or not."""
        return len(self._spares)

    @property
    def ready_count(self) -> int:
        """Spares that can take a worker now."""
        return sum(s.ready for s in self._spares)

    def keep(self, cwd: str, workers: int, workers_starting: bool) -> Spare | None:
        """Start a spare if the pool has fewer than it wants and may start one now (see
        :func:`spare_may_start`; ``workers``: this node's workers, ``workers_starting``:
        whether some have not said hello yet). Returns the started spare."""
        if len(self._spares) >= self.wanted or time.monotonic() < self._due:
            return None
        cores = len(os.sched_getaffinity(0))
        if not spare_may_start(cores, workers, self.wanted, workers_starting):
            return None
        try:
            return self.start(cwd)
        except (OSError, RuntimeError) as exc:  # a container's runtime refused it
            log.warning("no hot spare started (trying again in %.0f s): %s", SPARE_RETRY_S, exc)
            self._due = time.monotonic() + SPARE_RETRY_S
            return None

    def start(self, cwd: str) -> Spare:
        """Start one spare now, in ``cwd``."""
        ready_r, ready_w = os.pipe()
        environ = self._environ()
        environ[READY_FD] = str(ready_w)
        try:
            if self.in_container is not None:
                proc = self.in_container(self._command, environ, ready_w)
            else:
                proc = start_waiting(self._command, cwd, environ, ready_w)
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        spare = Spare(proc, ready_r)
        self._spares.append(spare)
        self._selector.register(ready_r, selectors.EVENT_READ, spare)
        return spare

    def on_ready(self, spare: Spare) -> bool:
        """``spare``'s ready pipe is readable: it is ready, or it died warming up (then it is
        reaped and dropped; :meth:`keep` starts another). Whether it is ready."""
        self._selector.unregister(spare.ready_fd)
        spare.ready = os.read(spare.ready_fd, 1) == b"1"
        os.close(spare.ready_fd)
        if not spare.ready:
            spare.proc.wait()
            self._spares.remove(spare)
        return spare.ready

    def take(self, environ: dict[str, str], spec: JobSpec) -> Any:
        """Hand a ready spare a worker's environment (it runs ``spec``'s script with it);
        its process, now the worker's, or None when no spare is ready."""
        for spare in list(self._spares):
            if not spare.ready:
                continue
            self._spares.remove(spare)
            order = {"env": environ, "script": spec.script, "args": list(spec.args),
                     "cwd": spec.cwd}  # fmt: skip
            try:
                assert spare.proc.stdin is not None
                spare.proc.stdin.write((json.dumps(order) + "\n").encode())
                spare.proc.stdin.close()
            except OSError:
                spare.proc.kill()
                spare.proc.wait()
                continue
            self._due = time.monotonic() + SPARE_DELAY_S
            return spare.proc
        return None

    def stop(self) -> None:
        """Kill and reap every spare and start no more (a stopping node needs none)."""
        self.wanted = 0
        for spare in self._spares:
            spare.proc.kill()
        for spare in self._spares:
            spare.proc.wait()
            if not spare.ready:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(spare.ready_fd)
                    os.close(spare.ready_fd)
        self._spares.clear()

    def kill_groups(self) -> None:
        """SIGKILL every spare's process group at once, reaping nothing (the node is lost)."""
        for spare in self._spares:
            kill_group(spare.proc.pid, signal.SIGKILL)
