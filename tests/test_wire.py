"""Control connections: only holders of the job token get in, requests get replies."""

import errno
import json
import logging
import select
import socket
import struct
import threading
import time

import pytest

from xmig import wire
from xmig.wire import MAX_FRAME, AuthError, Client, Connection, RemoteError, Server, WireError


def _echo_server(token):
    seen = []

    def handle(peer, msg):
        seen.append((peer.info, msg))
        if msg.get("op") == "fail":
            raise ValueError("refused on purpose")
        if msg.get("op") == "push_me":
            peer.push({"op": "pushed", "n": 1})
        return {"echo": msg.get("value")}

    return Server("127.0.0.1", 0, token, handle).start(), seen


def test_request_reply_and_push():
    server, seen = _echo_server("secret")
    pushed = threading.Event()
    client = Client(server.address, "secret", info={"role": "test"}, on_push=lambda m: pushed.set())
    try:
        assert client.call("echo", value=[1, 2])["echo"] == [1, 2]
        with pytest.raises(RemoteError, match="refused on purpose"):
            client.call("fail")
        client.call("push_me")
        assert pushed.wait(5)
        assert seen[0][0] == {"role": "test"}
    finally:
        client.close()
        server.close()


def test_a_server_counts_the_requests_it_has_not_answered_yet():
    # a coordinator that ends lingers while it has any: a request decided just before the
    # job's end (``xmig stop``) lost its reply on a busy machine
    decided = threading.Event()
    entered = threading.Event()

    def handle(peer, msg):
        if msg.get("op") == "slow":
            entered.set()
            decided.wait(10)
        return {"ok": 1}

    server = Server("127.0.0.1", 0, "secret", handle).start()
    client = Client(server.address, "secret", info={"role": "test"})
    replies = []
    try:
        assert server.answering() == 0
        caller = threading.Thread(target=lambda: replies.append(client.call("slow")))
        caller.start()
        assert entered.wait(5)
        assert server.answering() == 1
        client.notify("note")  # a notice is never answered: not counted
        decided.set()
        caller.join(5)
        assert replies and replies[0]["ok"] == 1
        deadline = time.monotonic() + 5
        while server.answering() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.answering() == 0
    finally:
        client.close()
        server.close()


def test_wrong_token_is_refused():
    server, seen = _echo_server("secret")
    try:
        with pytest.raises(AuthError, match="wrong job token"):
            Client(server.address, "not-the-secret")
        assert seen == []
    finally:
        server.close()


def test_client_checks_the_server_too():
    # a server that does not hold the token cannot pose as the coordinator
    server, _ = _echo_server("other")
    try:
        with pytest.raises(AuthError):
            Client(server.address, "secret")
    finally:
        server.close()


def test_unreachable():
    server, _ = _echo_server("secret")
    address = server.address
    server.close()
    with pytest.raises(WireError, match="cannot reach"):
        Client(address, "secret", connect_timeout=2)


# --- hardening against hostile or broken peers -------------------------------------------


def _handle(peer, msg):
    return {"echo": msg.get("value")}


def _read_frame(sock):
    """One frame read off a raw socket (the test plays a hand-written peer)."""
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        assert chunk, "peer closed before a frame header"
        header += chunk
    (size,) = struct.unpack("!I", header)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        assert chunk, "peer closed inside a frame"
        body += chunk
    return json.loads(body)


def _closed_by_peer(sock, within):
    """True when the peer closes (EOF or reset) within ``within`` seconds without sending."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


class _FlakyListener:
    """A listening socket whose first ``failures`` accepts fail as if out of file descriptors."""

    def __init__(self, sock, failures):
        self._sock = sock
        self.failures = failures

    def accept(self):
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.timeout(30)
def test_accept_survives_running_out_of_file_descriptors(caplog):
    # EMFILE used to end the accept loop for good: nobody could connect again
    server = Server("127.0.0.1", 0, "secret", _handle)
    listener = _FlakyListener(server._sock, failures=3)
    server._sock = listener
    server.start()
    client = None
    try:
        with caplog.at_level(logging.WARNING, logger="xmig.wire"):
            started = time.monotonic()
            client = Client(server.address, "secret", connect_timeout=5)
            assert client.call("echo", timeout=5, value=7)["echo"] == 7
            assert time.monotonic() - started < 4
        assert listener.failures == 0
        assert any("accept" in r.getMessage() for r in caplog.records)
    finally:
        if client is not None:
            client.close()
        server.close()
    server._thread.join(5)
    assert not server._thread.is_alive()  # close() still ends the loop


@pytest.mark.timeout(30)
def test_a_slow_drip_handshake_is_cut_off():
    # one byte every 0.2 s used to reset a per-receive timeout, holding a thread forever
    server = Server("127.0.0.1", 0, "secret", _handle, handshake_timeout=1.0).start()
    try:
        with socket.create_connection(server.address, timeout=5) as sock:
            assert _read_frame(sock)["hello"]
            started = time.monotonic()
            payload = struct.pack("!I", 200) + b" " * 200
            closed = False
            for byte in payload:
                if time.monotonic() - started > 5:
                    break
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    closed = True
                    break
                readable, _, _ = select.select([sock], [], [], 0.2)
                if readable and _closed_by_peer(sock, 1):
                    closed = True
                    break
            elapsed = time.monotonic() - started
        assert closed, "the server kept a dripping handshake open for 5 s"
        assert elapsed < 1.5
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_pending_handshakes_are_capped(caplog):
    server = Server(
        "127.0.0.1", 0, "secret", _handle, handshake_timeout=1.0, max_pending_handshakes=4
    ).start()
    idle = []
    client = None
    try:
        for _ in range(4):
            sock = socket.create_connection(server.address, timeout=5)
            idle.append(sock)
            assert _read_frame(sock)["hello"]
        with (
            caplog.at_level(logging.WARNING, logger="xmig.wire"),
            socket.create_connection(server.address, timeout=5) as extra,
        ):
            started = time.monotonic()
            assert _closed_by_peer(extra, 2), "a 5th pending handshake was let in"
            assert time.monotonic() - started < 1
            assert server.refused_handshakes == 1
            # the server says so after the close, on its own thread
            deadline = time.monotonic() + 5
            while not any("pending handshakes" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the refusal was not logged"
                time.sleep(0.01)
        for sock in idle:  # they time out, which frees their places
            assert _closed_by_peer(sock, 3)
        client = Client(server.address, "secret", connect_timeout=5)
        assert client.call("echo", timeout=5, value="in")["echo"] == "in"
    finally:
        for sock in idle:
            sock.close()
        if client is not None:
            client.close()
        server.close()


@pytest.mark.timeout(30)
def test_server_refuses_a_huge_frame_before_authentication(monkeypatch):
    # a 64 MiB body used to be read (and held in memory) before the token was checked
    wanted = []
    original = Connection._recv_exact

    def spy(self, n, *args, **kwargs):
        wanted.append(n)
        return original(self, n, *args, **kwargs)

    monkeypatch.setattr(Connection, "_recv_exact", spy)
    server = Server("127.0.0.1", 0, "secret", _handle).start()
    try:
        with socket.create_connection(server.address, timeout=5) as sock:
            assert _read_frame(sock)["hello"]
            sock.sendall(struct.pack("!I", MAX_FRAME))
            assert _closed_by_peer(sock, 2), "the server waited for a 64 MiB frame"
        assert max(wanted) <= wire.MAX_HANDSHAKE_FRAME
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_client_refuses_a_huge_frame_from_a_rogue_server():
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def rogue():
        sock, _ = listener.accept()
        with sock:
            sock.sendall(struct.pack("!I", MAX_FRAME))
            done.wait(10)

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(WireError, match="exceeds"):
            Client(listener.getsockname()[:2], "secret", connect_timeout=5)
        assert time.monotonic() - started < 2
    finally:
        done.set()
        thread.join(10)
        listener.close()


@pytest.mark.timeout(30)
def test_a_deeply_nested_handshake_frame_only_costs_its_connection():
    # json.loads raises RecursionError on deep nesting; it used to escape and kill the thread
    server = Server("127.0.0.1", 0, "secret", _handle).start()
    client = None
    try:
        with socket.create_connection(server.address, timeout=5) as sock:
            assert _read_frame(sock)["hello"]
            body = b"[" * 4000
            sock.sendall(struct.pack("!I", len(body)) + body)
            assert _closed_by_peer(sock, 2)
        client = Client(server.address, "secret", connect_timeout=5)
        assert client.call("echo", timeout=5, value=1)["echo"] == 1
    finally:
        if client is not None:
            client.close()
        server.close()


def test_a_buffered_connection_reads_bursts_and_split_frames_alike():
    """Several frames in one receive, and one frame over many: the same frames, in order;
    an unbuffered connection leaves what follows its frames in the socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
    listener.close()
    try:
        frames = [wire.pack({"n": n, "pad": "x" * (n * 7000)}) for n in range(12)]
        burst = b"".join(frames)
        left.sendall(burst[:5])  # a header split across receives
        reader = Connection(right, buffered=True)
        sender = threading.Thread(target=lambda: (time.sleep(0.05), left.sendall(burst[5:])))
        sender.start()
        assert [reader.recv()["n"] for _ in frames] == list(range(12))
        sender.join()
        plain = Connection(left)
        right.sendall(wire.pack({"n": 1}) + b"raw")
        assert plain.recv() == {"n": 1}
        assert left.recv(3) == b"raw"  # (the image stream reads raw bytes after a frame)
    finally:
        left.close()
        right.close()


def test_a_peer_that_reads_nothing_is_cut_off_within_the_bound():
    """``send_within`` gives up on a peer whose receive buffer stays full, after its bound,
    and closes the connection; a peer that reads gets the frame whole."""
    listener = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
    listener.close()
    try:
        sender, reader = Connection(left), Connection(right, buffered=True)
        sender.send_within(wire.pack({"n": 1}), 1.0)
        assert reader.recv() == {"n": 1}
        big = wire.pack({"pad": "x" * (32 << 20)})  # more than both sockets' buffers hold
        started = time.monotonic()
        with pytest.raises(WireError, match="read nothing for 1 s"):
            sender.send_within(big, 1.0)
        assert 0.9 < time.monotonic() - started < 5.0
        assert sender.closed
    finally:
        left.close()
        right.close()


def test_a_call_on_a_connection_its_peer_closed_fails_at_once():
    """A launcher's watcher asked a closed client for the coordinator's status, and got its
    answer only from the timeout: it took the silence for a hung coordinator and killed the
    one just started in its place."""
    peers = []

    def handle(peer, msg):
        peers.append(peer)
        return {}

    server = Server("127.0.0.1", 0, "secret", handle).start()
    closed = threading.Event()
    client = Client(server.address, "secret", on_close=closed.set)
    try:
        client.call("hello")
        peers[0].conn.close()  # the coordinator's end goes (it died)
        assert closed.wait(5)
        started = time.monotonic()
        with pytest.raises(WireError, match="closed"):
            client.call("status", timeout=3.0)
        assert time.monotonic() - started < 1.0
    finally:
        client.close()
        server.close()
