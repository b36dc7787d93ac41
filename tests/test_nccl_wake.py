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
0000000000000000: 00000002 00000000 00000000 0002 01 1001 @tmp/nccl-socket-0-1a2b3c@@@@
0000000000000000: 00000002 00000000 00000000 0002 01 1002 /tmp/nccl-socket-1-ff
0000000000000000: 00000002 00000000 00000000 0002 01 1003 @tmp/nccl-socket-0-99@@@@@@@@
0000000000000000: 00000002 00000000 00000000 0002 01 1004 @tmp/other-socket
0000000000000000: 00000003 00000000 00000000 0001 03 1005
0000000000000000: 00000002 00000000 00000000 0005 01 1006 @cuda-uvmfd-4026531836-576@
"""
# (the lines as an H100's /proc/net/unix shows NCCL 2.28's sockets, their NUL padding
# shortened: each ``@`` after the name is a NUL of the address)


def test_only_this_process_s_sockets_with_nccl_s_prefix_are_found() -> None:
    found = wake.service_addresses(table=TABLE, inodes={1001, 1002, 1004, 1005, 1006})
    # 1003 is another process's; 1004 and 1006 are not NCCL's; 1005 has no name
    assert found == ["\0tmp/nccl-socket-0-1a2b3c\0\0\0\0", "/tmp/nccl-socket-1-ff"]
    assert wake.service_addresses(table=TABLE, inodes=set()) == []
    assert wake.service_addresses(table="garbage\nno fields here", inodes={1001}) == []


LONG_POLL_MS = 30_000
"""The fake service's wait: NCCL's is 500 ms; this one long enough that only a datagram
ends it within the test's bound."""


def _nccl_like_service(
    name: str, stop: threading.Event, seen: dict[str, int], poll_ms: int = LONG_POLL_MS
) -> tuple[socket.socket, threading.Thread]:
    """A datagram socket bound as NCCL binds its own (``name``'s abstract address) and a
    thread that waits on it as NCCL's UDS service does (``poll_ms`` at a time, alone in
    ``poll``), looking for its stop flag between waits."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(wake.abstract_address(name))

    def serve() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while True:
            seen["polling"] = 1
            events = poller.poll(poll_ms)
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
        _wait_polling(seen)
        # found through /proc, by its thread's wait and its inode, and addressed whole
        assert wake.service_addresses(inodes=wake.polled_socket_inodes(LONG_POLL_MS)) == [
            wake.abstract_address(name).decode()
        ]
        with wake.nccl_services_woken(LONG_POLL_MS) as waker:
            stop.set()  # what NCCL's close does; the thread still waits in poll
            thread.join(20)
        assert not thread.is_alive(), "the service thread was not woken"
        assert seen["woken_by_datagram"] == 1 and waker.sent >= 1
    finally:
        sock.close()


def _end(stop: threading.Event, sock: socket.socket, thread: threading.Thread) -> None:
    """Stop a fake service: its flag, then a datagram to end its wait."""
    stop.set()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"\0", sock.getsockname())
    thread.join(20)
    sock.close()
    assert not thread.is_alive()


def _caught_polling(poll_ms: int = wake.SERVICE_POLL_MS) -> list[str]:
    """The service addresses found, read again until a thread is caught inside its wait
    (a thread that polls 500 ms at a time is outside it for microseconds)."""
    for _ in range(100):
        found = wake.service_addresses(inodes=wake.polled_socket_inodes(poll_ms))
        if found:
            return found
    return []


def _wait_polling(seen: dict[str, int]) -> None:
    while not seen.get("polling"):
        threading.Event().wait(0.005)
    threading.Event().wait(0.05)  # into the poll itself


def test_only_a_socket_waited_on_as_nccl_s_service_waits_is_woken() -> None:
    """NCCL's service polls alone for 500 ms at a time; a descriptor exchange's socket (the
    same prefix) is waited on otherwise, and a datagram there would fail it."""
    stop, seen = threading.Event(), {}
    service = f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    sock, thread = _nccl_like_service(service, stop, seen, poll_ms=wake.SERVICE_POLL_MS)
    exchange = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # nobody polls it
    exchange.bind(wake.abstract_address(f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"))
    other, other_seen = threading.Event(), {}
    slow, slow_thread = _nccl_like_service(f"{wake.SOCKET_PREFIX}1-{secrets.token_hex(6)}",
                                           other, other_seen, poll_ms=LONG_POLL_MS)  # fmt: skip
    try:
        _wait_polling(seen)
        _wait_polling(other_seen)
        named = wake.service_addresses(inodes=wake.own_socket_inodes())
        assert len(named) == 3  # all three carry NCCL's name
        # the one service polled 500 ms at a time
        assert _caught_polling() == [wake.abstract_address(service).decode()]
    finally:
        _end(stop, sock, thread)
        _end(other, slow, slow_thread)
        exchange.close()


def test_a_datagram_before_the_stop_flag_is_read_and_the_thread_goes_on() -> None:
    name = f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    stop, seen = threading.Event(), {}
    sock, thread = _nccl_like_service(name, stop, seen)
    try:
        with wake.ServiceWaker([wake.abstract_address(name).decode()], period_s=0.001):
            while seen.get("read", 0) < 2:  # woken, read, waiting again: the close not begun
                thread.join(0.01)
                assert thread.is_alive()
            stop.set()
            thread.join(20)
        assert not thread.is_alive() and seen["woken_by_datagram"] == 1
    finally:
        sock.close()


def test_a_socket_that_is_gone_is_dropped_and_the_waker_ends() -> None:
    name = wake.abstract_address(f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}").decode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(name)
        waker = wake.ServiceWaker([name], period_s=0.001)
        with waker:
            while waker.sent == 0:
                threading.Event().wait(0.005)
            sock.close()  # the thread has left and closed it
            waker._thread.join(20)
            assert not waker._thread.is_alive() and waker.addresses == []


def test_waking_is_on_unless_the_job_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    stop, seen = threading.Event(), {}
    name = f"{wake.SOCKET_PREFIX}0-{secrets.token_hex(6)}"
    sock, thread = _nccl_like_service(name, stop, seen, poll_ms=wake.SERVICE_POLL_MS)
    try:
        _wait_polling(seen)
        monkeypatch.setenv("XMIG_NCCL_WAKE", "0")
        with wake.woken() as waker:
            assert waker is None
        for value in (None, "1"):
            if value is None:
                monkeypatch.delenv("XMIG_NCCL_WAKE", raising=False)
            else:
                monkeypatch.setenv("XMIG_NCCL_WAKE", value)
            for _ in range(100):  # until the thread is caught inside its 500 ms wait
                with wake.woken() as waker:
                    assert waker is not None
                    if waker.addresses:
                        break
            assert waker.addresses == [wake.abstract_address(name).decode()]
    finally:
        _end(stop, sock, thread)


def test_a_value_other_than_0_or_1_is_said_and_wakes_as_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XMIG_NCCL_WAKE", "off")
    with caplog.at_level("WARNING", logger=wake.__name__), wake.woken() as waker:
        assert waker is not None
    assert "XMIG_NCCL_WAKE='off': expected 0 or 1" in caplog.text
