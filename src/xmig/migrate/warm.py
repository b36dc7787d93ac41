"""Host memory made ready for the moves a node will receive.

Some machines back their memory only when it is first written: a virtual machine whose
host gives it pages on demand. On those, every page a move writes for the first time
costs far more than one the machine has used before. Measured: this project's CPU machine
wrote fresh memory at 0.40-0.42 GB/s and memory it had used before at 7.9 GB/s. A move
writes fresh pages twice: CRIU's image on a tmpfs, then the restored process. On a fresh
machine the first moves are slow, and each later move is faster as the machine warms.

An agent started with ``XMIG_WARM_MEMORY_GB`` writes that much memory once, in the
background, and gives it back. The kernel then hands those pages to the next allocations,
so the machine is backed before a move needs it. It keeps a floor of memory free, of the
machine's and of its memory cgroup's limit (where it has one: the cgroup's processes, the
node's workers among them, would be killed beyond it), and it stops when a move begins."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

WARM_ENV = "XMIG_WARM_MEMORY_GB"
CHUNK_BYTES = 256 << 20
"""Memory written, and checked against the floor and the stop, at a time."""
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in, writable, without writing it
MAP_FAILED = ctypes.c_void_p(-1).value
NO_LIMIT = 1 << 60
"""A memory cgroup's limit at or above this is none (cgroup v1 writes 2^63 less a page)."""


@dataclass(frozen=True)
class Warmed:
    """What a warm-up did: bytes written, in seconds, and why it stopped short (or None)."""

    bytes: int
    seconds: float
    stopped: str | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def wanted_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The bytes ``XMIG_WARM_MEMORY_GB`` asks for (0 when it is unset or empty); ValueError
    with what is wrong for a value that is not a number of GB >= 0."""
    text = (os.environ if environ is None else environ).get(WARM_ENV, "").strip()
    if not text:
        return 0
    try:
        gb = float(text)
    except ValueError:
        raise ValueError(f"{WARM_ENV}={text!r}: not a number of GB") from None
    if not gb >= 0 or gb == float("inf"):
        raise ValueError(f"{WARM_ENV}={text!r}: must be a finite number of GB >= 0")
    return int(gb * 1e9)


def default_floor(total: int | None = None) -> int:
    """The memory a warm-up leaves free: a tenth of the machine's, at least 2 GiB."""
    total = psutil.virtual_memory().total if total is None else total
    return max(total // 10, 2 << 30)


def _read_bytes(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_headroom(cgroup_file: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> int | None:  # fmt: skip
    """Bytes this process's memory cgroup may still take before its limit, the least over
    its cgroup and their parents (cgroup v2, or v1's memory controller); None where no
    limit applies or none can be read."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    folders: list[tuple[Path, str, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, limit, usage = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        here = base / path.strip("/")
        if not here.is_dir():  # a cgroup namespace hides the path: its root is ours
            here = base
        while True:
            folders.append((here, limit, usage))
            if here == base:
                break
            here = here.parent
    least: int | None = None
    for folder, limit_name, usage_name in folders:
        limit, usage = _read_bytes(folder / limit_name), _read_bytes(folder / usage_name)
        if limit is None or usage is None or limit >= NO_LIMIT:
            continue
        left = max(limit - usage, 0)
        least = left if least is None else min(least, left)
    return least


def available_bytes() -> int:
    """Memory this process may still take: the machine's available memory, or less where
    its memory cgroup's limit is nearer."""
    machine = psutil.virtual_memory().available
    cgroup = cgroup_headroom()
    return machine if cgroup is None else min(machine, cgroup)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.memset.restype = ctypes.c_void_p
    return libc


def _map(libc: ctypes.CDLL, size: int) -> int:
    """``size`` bytes of fresh anonymous memory, written to (so backed) page by page."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
    # the kernel writes the pages (zeroes them) without the interpreter; a kernel older
    # than 5.14 does not know the advice, and memset writes them instead. Any other refusal
    # (no memory left) ends the warm-up: memset would meet it as the OOM killer
    if libc.madvise(address, size, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        if errno != 22:  # EINVAL
            libc.munmap(address, size)
            raise OSError(errno, f"writing {size} bytes of fresh memory: {os.strerror(errno)}")
        libc.memset(address, 1, size)
    return address


def warm_memory(nbytes: int, *, keep_free: int | None = None,
                stop: threading.Event | None = None,
                available: Callable[[], int] | None = None,
                chunk: int = CHUNK_BYTES) -> Warmed:  # fmt: skip
    """Write ``nbytes`` of fresh memory, then give it all back. It stops short when less
    than ``keep_free`` (``default_floor()``) would be left, or once ``stop`` is set.
    ``available``: a callable giving the bytes available (``available_bytes``)."""
    keep_free = default_floor() if keep_free is None else keep_free
    free_now = available or available_bytes
    libc = _libc()
    held: list[tuple[int, int]] = []
    written = 0
    stopped: str | None = None
    started = time.monotonic()
    try:
        while written < nbytes:
            if stop is not None and stop.is_set():
                stopped = "stopped: a move began"
                break
            size = min(chunk, nbytes - written)
            if free_now() - size < keep_free:
                stopped = f"stopped: {keep_free / 1e9:.1f} GB must stay free"
                break
            held.append((_map(libc, size), size))
            written += size
    finally:
        for address, size in held:
            libc.munmap(address, size)
    return Warmed(written, time.monotonic() - started, stopped)


class MemoryWarmer:
    """The background warm-up an agent runs at its start (``XMIG_WARM_MEMORY_GB``)."""

    def __init__(self, nbytes: int, name: str, **options: Any) -> None:
        self.nbytes = nbytes
        self.name = name
        self.options = options  # warm_memory's (tests)
        self.stop = threading.Event()
        self.result: Warmed | None = None
        self._thread = threading.Thread(target=self._run, name="xmig-warm", daemon=True)

    def start(self) -> None:
        log.info("%s: warming %.1f GB of this host's memory", self.name, self.nbytes / 1e9)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = warm_memory(self.nbytes, stop=self.stop, **self.options)
        except OSError as exc:  # a warm-up only makes moves faster: it never stops a node
            log.warning("%s: warming this host's memory failed: %s", self.name, exc)
            return
        done = self.result
        log.info("%s: warmed %.1f GB of this host's memory in %.1f s (%.2f GB/s)%s",
                 self.name, done.bytes / 1e9, done.seconds, done.gb_per_s,
                 f"; {done.stopped}" if done.stopped else "")  # fmt: skip

    def halt(self, timeout: float = 5.0) -> None:
        """Stop and give the memory back (a move needs it now); waits up to ``timeout``."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
