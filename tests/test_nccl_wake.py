"""Waking NCCL's socket service threads while a communicator closes (``xmig.ccl.wake``): the
sockets are found by this process's inodes, a thread that waits on one as NCCL's does leaves
at once, and a socket that is gone is dropped."""

from __future__ import annotations

import secrets
import select
import socket
import threading

import pytest

from xmig.ccl import wake

pytestmark = pytest.mark.timeout(60)

TABLE = """Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00000000 0002 01 1001 @/tmp/nccl-socket-0-1a2b3c
0000000000000000: 00000002 00000000 00000000 0002 01 1002 /tmp/nccl-socket-1-ff
0000000000000000: 00000002 00000000 00000000 0002 01 1003 @/tmp/nccl-socket-0-99
0000000000000000: 00000002 00000000 00000000 0002 01 1004 @/tmp/other-socket
0000000000000000: 00000003 00000000 00000000 0001 03 1005
"""


def test_only_this_process_s_sockets_with_nccl_s_prefix_are_found() -> None:
    found = wake.service_addresses(table=TABLE, inodes={1001, 1002, 1004, 1005})
    # 1003 is another process's; 1004 is not NCCL's; 1005 has no name
    assert found == ["\0/tmp/nccl-socket-0-1a2b3c", "/tmp/nccl-socket-1-ff"]
    assert wake.service_addresses(table=TABLE, inodes=set()) == []
    assert wake.service_addresses(table="garbage\nno fields here", inodes={1001}) == []


def _nccl_like_service(name: str, stop: threading.Event, seen: dict[str, int]
                       ) -> tuple[socket.socket, threading.Thread]:  # fmt: skip
    """A datagram socket under NCCL's prefix and a thread that waits on it as NCCL's UDS
    service does (there 500 ms at a time; here 30 s, so that only a datagram ends a wait
    within the test's bound), looking for its stop flag between waits."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)

    def serve() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while True:
            events = poller.poll(30_000)
            if stop.is_set():
                seen["woken_by_datagram"] = int(bool(events))
                return
            if events:  # a request before the stop flag: read and refused, as NCCL does
                sock.recv(64)
                seen["read"] = seen.get("read", 0) + 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_a_service_thread_waiting_on_its_socket_is_woken_once_stopped() -> None:
    name = f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    stop, seen = threading.Event(), {}
    sock, thread = _nccl_like_service(name, stop, seen)
    try:
        assert "\0" + name in wake.service_addresses()  # found through /proc, by its inode
        with wake.nccl_services_woken() as waker:
            stop.set()  # what NCCL's close does; the thread still waits in poll
            thread.join(20)
        assert not thread.is_alive(), "the service thread was not woken"
        assert seen["woken_by_datagram"] == 1 and waker.sent >= 1
    finally:
        sock.close()


def test_a_datagram_before_the_stop_flag_is_read_and_the_thread_goes_on() -> None:
    name = f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    stop, seen = threading.Event(), {}
    sock, thread = _nccl_like_service(name, stop, seen)
    try:
        with wake.ServiceWaker(["\0" + name], period_s=0.001):
            while seen.get("read", 0) < 2:  # woken, read, waiting again: the close not begun
                thread.join(0.01)
                assert thread.is_alive()
            stop.set()
            thread.join(20)
        assert not thread.is_alive() and seen["woken_by_datagram"] == 1
    finally:
        sock.close()


def test_a_socket_that_is_gone_is_dropped_and_the_waker_ends() -> None:
    name = "\0" + f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(name)
        waker = wake.ServiceWaker([name], period_s=0.001)
        with waker:
            while waker.sent == 0:
                threading.Event().wait(0.005)
            sock.close()  # the thread has left and closed it
            waker._thread.join(20)
            assert not waker._thread.is_alive() and waker.addresses == []


def test_waking_is_off_unless_the_job_asks_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "\0" + f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(name)
        sock.setblocking(False)
        for value in (None, "0"):
            if value is None:
                monkeypatch.delenv("XMIG_NCCL_WAKE", raising=False)
            else:
                monkeypatch.setenv("XMIG_NCCL_WAKE", value)
            with wake.woken() as waker:
                assert waker is None
        with pytest.raises(BlockingIOError):
            sock.recv(8)  # nothing was sent
        monkeypatch.setenv("XMIG_NCCL_WAKE", "1")
        with wake.woken() as waker:
            assert waker is not None and name in waker.addresses
            while waker.sent == 0:
                threading.Event().wait(0.005)
        assert sock.recv(8) == b"\0"
