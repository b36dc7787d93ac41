"""Moving one process: checkpoint it on the node it leaves, restore it on the node it goes to.

:class:`ProcessMover` is what an agent uses: GPU memory into host memory (the CUDA checkpoint
API, ``cuda``), then the process tree into images (CRIU, ``criu``); on the other node the
rank's own network interface taken over (``netif``), the tree restored with its PID, then its
GPU memory put back onto this node's GPU. Whatever fails is one :class:`MigrationError`.
Getting the images from one node to the other (``stream``) is the caller's business.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmig.container import runc
from xmig.migrate import criu, cuda, netif

logger = logging.getLogger(__name__)

LAZY_ENV = "XMIG_CRIU_LAZY"
"""``1``: restore a moved process that holds no GPU state before its memory is back (CRIU's
lazy pages), which ``criu lazy-pages`` hands it as it touches it; off by default. Never for
a GPU process: the driver's restore reads the GPU's checkpoint out of the process's memory
page fault by page fault (measured on one H200: 20.7 s for 1.0 GB, against 0.35 s)."""


class MigrationError(RuntimeError):
    """Checkpointing or restoring a process failed (CRIU, the CUDA checkpoint API or the
    rank's network interface); the message is the underlying error's."""


@contextlib.contextmanager
def _as_migration_error() -> Iterator[None]:
    try:
        yield
    except (criu.CriuError, cuda.GpuCheckpointError, netif.InterfaceError, runc.RuncError) as exc:
        raise MigrationError(str(exc)) from exc


@dataclass(frozen=True)
class CheckpointResult:
    """What a checkpoint took (seconds) and what it left."""

    dump_s: float  # CRIU's dump
    image_bytes: int  # the images' size
    gpu_checkpoint_s: float = 0.0  # the GPU memory into host memory (lock and checkpoint)
    gpu_times: dict[str, float] = field(default_factory=dict)  # each checkpoint API call's
    gpus_before: list[str] = field(default_factory=list)  # every GPU of the machine it left
    gpu_bytes: int = 0  # the GPU memory it held
    # its own network interface, for the target node to take: name, address, netns
    interface: dict[str, Any] | None = None
    criu_stats: dict[str, float] = field(default_factory=dict)  # criu.dump_stats's
    steps: dict[str, float] = field(default_factory=dict)  # each step's seconds, in order


@dataclass(frozen=True)
class RestoreResult:
    """What a restore took (seconds) and where the GPU state went."""

    restore_s: float  # the interface taken over and CRIU's restore
    gpu_restore_s: float = 0.0  # the GPU memory put back and the process unlocked
    gpu_times: dict[str, float] = field(default_factory=dict)
    to_gpu: str | None = None  # the UUID of the GPU it now holds its state on
    lazy: bool = False  # its memory still arrives; the images go once it has
    criu_stats: dict[str, float] = field(default_factory=dict)  # criu.restore_stats's
    steps: dict[str, float] = field(default_factory=dict)  # each step's seconds, in order


class _Steps:
    """Seconds spent in each step of a checkpoint or restore, named in the order done: where
    a move's time goes beyond the calls timed on their own."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started


class ProcessMover:
    """Checkpoints and restores one process tree (as root, with CRIU >= 4.2). Its TCP
    connections are closed by the dump: the process reconnects after the restore.
    ``lazy``: bare processes without GPU state are restored lazily (``LAZY_ENV`` when not
    given)."""

    def __init__(self, lazy: bool | None = None) -> None:
        self.lazy = os.environ.get(LAZY_ENV) == "1" if lazy is None else lazy

    def checkpoint(
        self,
        pid: int,
        images_dir: str | os.PathLike[str],
        gpu_uuid: str | None = None,
        *,
        gpu_bytes: int = 0,
        interface: str | None = None,
        container: str | None = None,
    ) -> CheckpointResult:
        """Checkpoint process ``pid`` (CRIU ends it) into ``images_dir``. ``gpu_uuid``: the GPU
        it holds state on, checkpointed first (``gpu_bytes``: what it said it holds there, where
        NVML cannot tell). ``interface``: the name of its own network interface, reported
        when this node has it. ``container``: ``pid`` is the init of this container, which is
        checkpointed whole (runc, with xmig's CRIU; runc removes it)."""
        gpu_s, gpu_times, gpus_before = 0.0, {}, []
        step = _Steps()
        with _as_migration_error():
            if gpu_uuid is not None:  # its GPU memory goes into its host memory first
                with step("gpu_query"):
                    held = cuda.process_gpu_bytes(pid, gpu_uuid)
                    if held is not None:  # its own share (the worker said what its GPU holds)
                        gpu_bytes = held
                    gpus_before = cuda.machine_gpus()
                gpu = cuda.GpuCheckpoint(pid)
                with step("gpu_checkpoint"):
                    gpu_s, gpu_times = gpu.save(), gpu.times
            started = time.monotonic()
            with step("criu_dump"):
                if container is not None:
                    runc.checkpoint(container, images_dir)
                else:
                    criu.dump(pid, images_dir, tcp_close=True)
        took = time.monotonic() - started
        found = None
        with step("interface"):
            if interface is not None and netif.exists(interface):  # the target node takes it
                with contextlib.suppress(netif.InterfaceError):
                    found = {"name": interface, "address": netif.address_of(interface),
                             "netns": os.environ.get(netif.NETNS_ENV)}  # fmt: skip
        with step("image_size"):
            size = sum(f.stat().st_size for f in Path(images_dir).iterdir() if f.is_file())
            stats = criu.dump_stats(images_dir)
        return CheckpointResult(dump_s=took, image_bytes=size, gpu_checkpoint_s=gpu_s,
                                gpu_times=gpu_times, gpus_before=gpus_before,
                                gpu_bytes=gpu_bytes, interface=found,
                                criu_stats=stats, steps=step.seconds)  # fmt: skip

    def restore(
        self,
        images_dir: str | os.PathLike[str],
        pid: int,
        local_rank: int,
        gpu: str | None = None,
        gpus_before: Sequence[str] = (),
        interface: Mapping[str, Any] | None = None,
        inherit_fds: Mapping[int, str] | None = None,
        restore_tree: Callable[[], int] | None = None,
    ) -> RestoreResult:
        """Restore the process ``pid`` dumped into ``images_dir`` here; the restored tree goes
        to the nearest subreaper. ``interface``: its network interface (a checkpoint's), taken
        into this namespace first. ``gpu``: the GPU it held state on, restored onto this node's
        GPU for ``local_rank`` (``gpus_before``: every GPU of the machine it left).
        ``inherit_fds``: as ``criu.restore``'s (they stay the caller's to close).
        ``restore_tree``: restores the tree instead of CRIU alone (a container's runtime), and
        returns its init's PID, which the GPU state then goes to."""
        gpu_s, gpu_times, target = 0.0, {}, None
        step = _Steps()
        started = time.monotonic()
        lazy = None
        if self.lazy and restore_tree is None and gpu is None:
            lazy = criu.LazyPages(images_dir)
        with _as_migration_error():
            if interface:
                with step("interface"):
                    netif.take(interface["name"], interface["address"], interface["netns"])
            with step("criu_restore"):
                if restore_tree is not None:
                    pid = restore_tree()
                else:
                    if lazy is not None:
                        lazy.start()
                    try:
                        criu.restore(images_dir, tcp_close=True, inherit_fds=inherit_fds,
                                     lazy=lazy)  # fmt: skip
                    except criu.CriuError:
                        if lazy is not None:
                            lazy.stop()
                        raise
            took = time.monotonic() - started
            if lazy is not None:  # from now on the tree runs on pages still arriving
                threading.Thread(target=_watch_lazy_pages, args=(lazy, pid),
                                 name="xmig-lazy-pages", daemon=True).start()  # fmt: skip
            if gpu is not None:  # onto this node's GPU for its local rank
                with step("gpu_pairs"):
                    target = cuda.device_uuid(local_rank)
                    pairs = cuda.restore_pairs(gpu, target, list(gpus_before),
                                               cuda.machine_gpus())  # fmt: skip
                checkpoint = cuda.GpuCheckpoint(pid)
                with step("gpu_restore"):
                    gpu_s, gpu_times = checkpoint.load(pairs), checkpoint.times
        with step("criu_stats"):
            stats = criu.restore_stats(images_dir)
        return RestoreResult(restore_s=took, gpu_restore_s=gpu_s, gpu_times=gpu_times,
                             to_gpu=target, lazy=lazy is not None, criu_stats=stats,
                             steps=step.seconds)  # fmt: skip


def _watch_lazy_pages(lazy: criu.LazyPages, pid: int) -> None:
    """Until the lazily restored process ``pid`` has all its memory: a process whose pages
    stopped coming would read zeros for them, so it is killed instead (a lost rank, which
    the job recovers). The images go once every page is handed over."""
    problem = lazy.wait()
    if problem is not None:
        logger.error("the process %d restored lazily is killed: %s", pid, problem)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(lazy.images, ignore_errors=True)
