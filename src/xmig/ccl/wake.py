"""Wake NCCL's socket service threads while a communicator closes.

NCCL's service thread for cuMem's file descriptors (its "UDS" proxy service) waits on a
datagram socket 500 ms at a time and looks for its stop flag only between waits, so closing a
healthy communicator waited out the rest of a 0.5 s period: a migration's pause took 0.04 to
0.5 s for nothing (``bench/nccl_close.py``, ``bench/results/gpu-speed.md``). A datagram sent
to that socket ends the wait at once. Once the stop flag is set the thread leaves before
reading it; before, it reads it as a request without a file descriptor, which NCCL refuses
and ignores (the thread goes on waiting), so the datagram changes nothing else.

The sockets are this process's own Unix sockets named as NCCL names them, found through
``/proc``: ``/tmp/nccl-socket-<rank>-<hash>``, a file, or by default the same name in the
abstract namespace with its first byte (the ``/``) replaced by a NUL and padded with NULs to
the whole address (``/proc/net/unix`` shows ``@tmp/nccl-socket-0-…@@@…``; NCCL 2.28's
``ipcsocket.cc``, seen on an H100). Where none is found (another NCCL, another naming),
nothing is sent and the close takes its time, as before.

Only a socket that a thread of this process is waiting on as NCCL's service does (alone in
``poll(2)`` with its 500 ms timeout, read from ``/proc/self/task/*/syscall``) is woken. A
thread that is in the middle of asking a proxy for a file descriptor (NCCL's
``ncclProxyClientGetFdBlocking``, at a communicator's setup or a buffer's registration) waits
for the answer on a socket of its own with the same prefix, but not in such a ``poll``: a
datagram there would fail that exchange, and none is sent to it. Where the waits cannot be
read (another architecture, ``/proc`` refused), nothing is sent.

Measured on H100s (NCCL 2.28.9, ``bench/results/gpu-speed.md``, sixth and tenth sessions):
a communicator's shutdown took 0.446 s without and 0.016 s with it (``bench/nccl_close.py
--wake``); its abort 0.95 s either way (what waits there is not this socket). In a 1.5 GB
move the pause's ``stop`` took 0.022–0.032 s in 15 woken moves against 0.035–0.512 s without
(wherever NCCL's 500 ms period happened to be): the downtime's worst case fell from 2.53 to
2.02 s and its mean from 2.07 to 1.88 s (tenth session), though the later phases of a woken
move were a little slower (0.05 s, median; 0.08 s in the sixth session, where the 9 pairs'
ratio was 0.91–1.11, median 1.03). On by default; ``XMIG_NCCL_WAKE=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

from xmig import jobenv

logger = logging.getLogger(__name__)

SOCKET_PREFIX = "/tmp/nccl-socket-"
"""NCCL's name for a rank's IPC socket: the prefix, then ``<rank>-<hash>``."""

ADDRESS_BYTES = 108
"""The size of a Unix socket's address (``sun_path``): NCCL's abstract names fill it."""

SERVICE_POLL_MS = 500
"""How long NCCL's UDS service waits in ``poll`` at a time: how its socket is told apart."""

_SYSCALL_POLL = {"x86_64": 7}
"""``poll``'s number, where it is known (``/proc/*/syscall`` shows numbers)."""

POKE_PERIOD_S = 0.005
"""How often a datagram goes to each socket while the close runs."""


def own_socket_inodes(proc: Path = Path("/proc/self")) -> set[int]:
    """The inodes of the sockets this process has open."""
    inodes = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(entry.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def polled_socket_inodes(poll_ms: int = SERVICE_POLL_MS, proc: Path = Path("/proc/self")
                         ) -> set[int]:  # fmt: skip
    """The inodes of the sockets that a thread of this process is waiting on alone in
    ``poll(2)`` with a timeout of ``poll_ms``, as NCCL's UDS service does."""
    number = _SYSCALL_POLL.get(platform.machine())
    if number is None:
        return set()
    fds = set()
    with contextlib.suppress(OSError):
        for task in os.scandir(proc / "task"):
            with contextlib.suppress(OSError, ValueError, IndexError, struct.error):
                fields = Path(task.path, "syscall").read_text().split()
                # "number fds nfds timeout ...": arguments in hex, while the thread waits
                waits = [int(fields[0])] + [int(x, 16) for x in fields[2:4]]
                if waits == [number, 1, poll_ms]:
                    fds.add(_polled_fd(proc, int(fields[1], 16)))
    inodes = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(proc / "fd" / str(fd))
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _polled_fd(proc: Path, address: int) -> int:
    """The descriptor of the ``struct pollfd`` at ``address`` in this process's memory (read
    through ``/proc``: an address no longer mapped raises OSError, it does not crash)."""
    with open(proc / "mem", "rb", buffering=0) as memory:
        return struct.unpack("i", os.pread(memory.fileno(), 4, address))[0]


def service_addresses(
    prefix: str = SOCKET_PREFIX,
    table: str | None = None,
    inodes: set[int] | None = None,
) -> list[str]:
    """The addresses of this process's Unix sockets named with ``prefix``: a file's path, or
    an abstract name as NCCL binds it (a NUL in place of the prefix's first character, and
    the NULs after the name that ``/proc/net/unix`` shows as ``@``). ``table``: the text of
    ``/proc/net/unix``; ``inodes``: this process's socket inodes (tests)."""
    if table is None:
        try:
            table = Path("/proc/net/unix").read_text()
        except OSError:
            return []
    if inodes is None:
        inodes = own_socket_inodes()
    found = []
    for line in table.splitlines()[1:]:
        # Num RefCount Protocol Flags Type St Inode Path
        fields = line.split(None, 7)
        if len(fields) < 8 or not fields[6].isdigit() or int(fields[6]) not in inodes:
            continue
        path = fields[7]
        if path.startswith("@"):
            shown = path[1:]
            name = shown.rstrip("@")
            if name.startswith(prefix[1:]):
                found.append("\0" + name + "\0" * (len(shown) - len(name)))
        elif path.startswith(prefix):
            found.append(path)
    return sorted(set(found))


def abstract_address(path: str) -> bytes:
    """The abstract address NCCL binds for the socket file name ``path`` (tests)."""
    name = b"\0" + path[1:].encode()
    return name + b"\0" * (ADDRESS_BYTES - len(name))


class ServiceWaker:
    """While it runs, sends a datagram to each of ``addresses`` every ``period_s`` seconds;
    an address that no longer answers (its thread has closed the socket) is dropped."""

    def __init__(self, addresses: list[str], period_s: float = POKE_PERIOD_S) -> None:
        self.addresses = list(addresses)
        self.found = len(self.addresses)
        self.period_s = period_s
        self.sent = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xmig-nccl-waker", daemon=True)

    def __enter__(self) -> ServiceWaker:
        if self.addresses:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.setblocking(False)
            while self.addresses and not self._done.wait(self.period_s):
                for address in list(self.addresses):
                    try:
                        sender.sendto(b"\0", address)
                        self.sent += 1
                    except BlockingIOError:
                        pass  # its queue is full: it has enough to wake on
                    except OSError:  # gone (closed, unbound): its thread has left
                        self.addresses.remove(address)


def nccl_services_woken(poll_ms: int = SERVICE_POLL_MS) -> ServiceWaker:
    """A ``ServiceWaker`` for this process's NCCL service sockets (those a thread waits on as
    NCCL's service does, ``poll_ms`` at a time), to run around a close."""
    addresses = service_addresses(inodes=polled_socket_inodes(poll_ms))
    logger.debug("waking %d NCCL service socket(s) during the close", len(addresses))
    return ServiceWaker(addresses)


@contextlib.contextmanager
def woken(enabled: bool | None = None) -> Iterator[ServiceWaker | None]:
    """``nccl_services_woken()`` around the block, or nothing when not ``enabled`` (by
    default: unless ``XMIG_NCCL_WAKE=0``)."""
    if enabled is None:
        value = os.environ.get(jobenv.NCCL_WAKE)
        if value not in (None, "", "0", "1"):
            logger.warning("%s=%r: expected 0 or 1; NCCL's close is woken, as by default",
                           jobenv.NCCL_WAKE, value)  # fmt: skip
        enabled = value != "0"
    if not enabled:
        yield None
        return
    with nccl_services_woken() as waker:
        yield waker
