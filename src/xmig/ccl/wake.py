"""Wake NCCL's socket service threads while a communicator closes.

NCCL's service thread for cuMem's file descriptors (its "UDS" proxy service) waits on a
datagram socket 500 ms at a time and looks for its stop flag only between waits, so closing a
healthy communicator waited out the rest of a 0.5 s period: a migration's pause took 0.04 to
0.5 s for nothing (``bench/nccl_close.py``, ``bench/results/gpu-speed.md``). A datagram sent
to that socket ends the wait at once. Once the stop flag is set the thread leaves before
reading it; before, it reads it as a request without a file descriptor, which NCCL refuses
and ignores (the thread goes on waiting), so the datagram changes nothing else.

The sockets are this process's own Unix sockets whose address starts with NCCL's prefix
(abstract, or a file under ``/tmp``), found through ``/proc``. Where none is found (another
NCCL, another naming), nothing is sent and the close takes its time, as before.

A caveat, why it is not on by default: a thread of this process that is in the middle of
asking a proxy for a file descriptor (NCCL's ``ncclProxyClientGetFdBlocking``, at a
communicator's setup or a buffer's registration) waits for the answer on a socket of its own
with the same prefix; a datagram that reaches it first would fail that exchange. The socket
list is read once, as the close begins; xmig closes its own communicators at a step
boundary, where none of them is setting up, but a communicator the job made outside xmig
could be.

Experimental: off unless ``XMIG_NCCL_WAKE=1``. The reading above is of NCCL 2.28's source
(``proxy.cc``, ``ipcsocket.cc``) and the CPU tests mimic its loop; it has not yet been run
against NCCL itself on a GPU (``bench/nccl_close.py --wake`` measures it there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from xmig import jobenv

logger = logging.getLogger(__name__)

SOCKET_PREFIX = "/tmp/nccl-socket-"
"""NCCL's name for a rank's IPC socket: the prefix, then ``<rank>-<hash>``."""

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


def service_addresses(
    prefix: str = SOCKET_PREFIX,
    table: str | None = None,
    inodes: set[int] | None = None,
) -> list[str]:
    """The addresses (an abstract one with its leading NUL) of this process's Unix sockets
    named with ``prefix``. ``table``: the text of ``/proc/net/unix``; ``inodes``: this
    process's socket inodes (tests)."""
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
        if path.startswith("@" + prefix):
            found.append("\0" + path[1:])
        elif path.startswith(prefix):
            found.append(path)
    return sorted(set(found))


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


def nccl_services_woken() -> ServiceWaker:
    """A ``ServiceWaker`` for this process's NCCL service sockets, to run around a close."""
    addresses = service_addresses()
    logger.debug("waking %d NCCL service socket(s) during the close", len(addresses))
    return ServiceWaker(addresses)


@contextlib.contextmanager
def woken(enabled: bool | None = None) -> Iterator[ServiceWaker | None]:
    """``nccl_services_woken()`` around the block, or nothing when not ``enabled`` (by
    default: only with ``XMIG_NCCL_WAKE=1``, until it has been measured on a GPU)."""
    if enabled is None:
        enabled = os.environ.get(jobenv.NCCL_WAKE) == "1"
    if not enabled:
        yield None
        return
    with nccl_services_woken() as waker:
        yield waker
