"""Authenticated control messages between xmig's processes.

Every control connection (launcher, agents, workers, ``xmig inject`` → coordinator or agent)
speaks length-prefixed JSON frames over TCP. A connection is usable only after a mutual
challenge-response with the job's token (HMAC-SHA256), so nothing outside the job can post
faults, inject them or join it. Requests carry an ``id`` and get one reply carrying ``re``;
messages without an ``id`` are one-way notices (pushes).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from hashlib import sha256
from typing import Any

PROTOCOL = "xmig/1"
MAX_FRAME = 64 << 20
# Before the token is proven only the small handshake frames are read: a stranger must not
# make a process buffer up to MAX_FRAME.
MAX_HANDSHAKE_FRAME = 4096
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64
ACCEPT_BACKOFF_S = (0.05, 1.0)

# accept() errors that concern only the connection being accepted: retry at once
_ACCEPT_PER_CONNECTION = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
# accept() errors that mean the listening socket itself is gone
_ACCEPT_FATAL = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}

log = logging.getLogger(__name__)

Message = dict[str, Any]


READ_AHEAD = 1 << 16  # the most a buffered connection receives at once


class WireError(ConnectionError):
    """The peer closed the connection or sent something that is not a frame."""


class AuthError(WireError):
    """The peer does not hold this job's token."""


class RemoteError(RuntimeError):
    """A request was refused by the peer; the message says why."""


def _mac(token: str, label: bytes, nonce: str) -> str:
    return hmac.new(token.encode(), label + nonce.encode(), sha256).hexdigest()


def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` (the port must be a number)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def format_address(address: tuple[str, int]) -> str:
    """``host:port`` for a (host, port) pair."""
    return f"{address[0]}:{address[1]}"


def listening_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A TCP socket listening on ``host`` only (IPv4 or IPv6, as ``host`` resolves)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def pack(msg: Message) -> bytes:
    """``msg`` as one frame: its length, then its JSON."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack("!I", len(data)) + data


class Connection:
    """One framed, authenticated socket; ``send`` is safe from several threads."""

    def __init__(self, sock: socket.socket, buffered: bool = False) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False
        # buffered: a receive takes what the socket holds, up to READ_AHEAD bytes, and later
        # frames come from it; a burst of frames then costs one system call (and one wait
        # for the GIL) instead of two a frame. Only for connections nothing reads raw bytes
        # from after their frames (the image stream does).
        self._read_ahead = READ_AHEAD if buffered else 0
        self._buf = bytearray()

    def _arm(self, deadline: float | None) -> None:
        """Let the next socket operation wait only until ``deadline`` (monotonic)."""
        if deadline is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireError("handshake timed out")
        try:
            self.sock.settimeout(left)
        except OSError as exc:
            raise WireError(f"connection unusable: {exc}") from exc

    def send(self, msg: Message, deadline: float | None = None) -> None:
        """Send one frame; with ``deadline``, give up when it passes."""
        self.send_packed(pack(msg), deadline)

    def send_packed(self, data: bytes, deadline: float | None = None) -> None:
        """Send a frame ``pack`` made (one message to many peers is packed once)."""
        with self._send_lock:
            self._arm(deadline)
            try:
                self.sock.sendall(data)
            except OSError as exc:
                raise WireError(f"send failed: {exc}") from exc

    def send_within(self, data: bytes, timeout: float) -> None:
        """Send a frame ``pack`` made, giving up after ``timeout`` seconds: a peer that stops
        reading cannot hold the sender for longer. The socket's own timeout is left alone
        (its reader thread shares it); a frame cut off leaves the connection unusable, so
        it is closed."""
        deadline = time.monotonic() + timeout
        view = memoryview(data)
        with self._send_lock:
            while view:
                try:
                    view = view[self.sock.send(view, socket.MSG_DONTWAIT) :]
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise WireError(f"send failed: {exc}") from exc
                if not view:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    raise WireError(f"the peer read nothing for {timeout:.0f} s")
                try:
                    select.select([], [self.sock], [], left)
                except (OSError, ValueError) as exc:  # closed meanwhile
                    raise WireError(f"send failed: {exc}") from exc

    def _recv_exact(self, n: int, deadline: float | None = None) -> bytes:
        buf = self._buf
        while len(buf) < n:
            # re-armed before every receive: a peer dripping bytes must not extend the deadline
            self._arm(deadline)
            try:
                chunk = self.sock.recv(max(n - len(buf), self._read_ahead))
            except OSError as exc:
                raise WireError(f"receive failed: {exc}") from exc
            if not chunk:
                raise WireError("connection closed by peer")
            buf += chunk
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def recv(self, limit: int = MAX_FRAME, deadline: float | None = None) -> Message:
        """Receive one frame of at most ``limit`` bytes; with ``deadline``, only until then."""
        (size,) = struct.unpack("!I", self._recv_exact(4, deadline))
        if size > limit:
            raise WireError(f"frame of {size} bytes exceeds the limit of {limit}")
        try:
            msg = json.loads(self._recv_exact(size, deadline))
        except (ValueError, RecursionError) as exc:  # deep nesting overflows the parser
            raise WireError("peer sent a frame that is not JSON") from exc
        if not isinstance(msg, dict):
            raise WireError("peer sent a frame that is not an object")
        return msg

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@contextlib.contextmanager
def _keeping_timeout(conn: Connection) -> Iterator[None]:
    """Restore the socket's timeout after a handshake that armed its own deadlines."""
    previous = conn.sock.gettimeout()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            conn.sock.settimeout(previous)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def server_handshake(
    conn: Connection, token: str, timeout: float | None = HANDSHAKE_TIMEOUT_S
) -> Message:
    """The server's half of the mutual challenge; returns the client's info.

    The whole exchange must end within ``timeout`` seconds (None: no bound), and the client's
    frames may not exceed MAX_HANDSHAKE_FRAME.
    """
    deadline = _deadline(timeout)
    with _keeping_timeout(conn):
        nonce = os.urandom(16).hex()
        conn.send({"hello": PROTOCOL, "nonce": nonce}, deadline)
        answer = conn.recv(MAX_HANDSHAKE_FRAME, deadline)
        if not hmac.compare_digest(str(answer.get("mac", "")), _mac(token, b"client|", nonce)):
            conn.send({"error": "authentication failed: wrong job token"}, deadline)
            raise AuthError("client failed authentication")
        conn.send({"mac": _mac(token, b"server|", str(answer.get("nonce", "")))}, deadline)
    return answer.get("info") or {}


def client_handshake(
    conn: Connection, token: str, info: Message, timeout: float | None = None
) -> None:
    """The client's half of the mutual challenge (raises AuthError on a wrong token).

    With ``timeout`` the whole exchange must end within that many seconds; without it only the
    socket's own timeout applies. The server's frames may not exceed MAX_HANDSHAKE_FRAME.
    """
    deadline = _deadline(timeout)
    with _keeping_timeout(conn):
        hello = conn.recv(MAX_HANDSHAKE_FRAME, deadline)
        if hello.get("hello") != PROTOCOL or "nonce" not in hello:
            raise WireError(f"peer does not speak {PROTOCOL}")
        nonce = os.urandom(16).hex()
        mac = _mac(token, b"client|", str(hello["nonce"]))
        conn.send({"nonce": nonce, "mac": mac, "info": info}, deadline)
        reply = conn.recv(MAX_HANDSHAKE_FRAME, deadline)
    if "error" in reply:
        raise AuthError(str(reply["error"]))
    if not hmac.compare_digest(str(reply.get("mac", "")), _mac(token, b"server|", nonce)):
        raise AuthError("server failed authentication: it does not hold the job token")


class Peer:
    """The server's view of one authenticated client."""

    def __init__(self, conn: Connection, info: Message) -> None:
        self.conn = conn
        self.info = info

    def push(self, msg: Message) -> bool:
        """Send a one-way notice; False when the peer is gone."""
        return self.push_packed(pack(msg))

    def push_packed(self, data: bytes, within: float | None = None) -> bool:
        """``push`` of a frame ``pack`` made; with ``within``, a peer that has read nothing
        for that many seconds is cut off (False)."""
        try:
            if within is None:
                self.conn.send_packed(data)
            else:
                self.conn.send_within(data, within)
            return True
        except WireError:
            return False


Handler = Callable[[Peer, Message], Message | None]


class Server:
    """Accepts authenticated clients and serves each on its own thread.

    ``handler(peer, msg)`` answers requests (its return value becomes the reply; an exception
    becomes an error reply) and receives notices (its return value is dropped).
    ``on_close(peer)`` is called once when a client's connection ends.
    A client must finish the handshake within ``handshake_timeout`` seconds; at most
    ``max_pending_handshakes`` connections may be in their handshake at once, and further ones
    are closed on arrival (counted in ``refused_handshakes``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handler: Handler,
        on_close: Callable[[Peer], None] | None = None,
        name: str = "xmig",
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self._token = token
        self._handler = handler
        self._on_close = on_close
        self._name = name
        self._handshake_timeout = handshake_timeout
        self._max_pending = max_pending_handshakes
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._answering = 0  # requests read and not yet answered
        self.refused_handshakes = 0
        self._refused_unlogged = 0
        self._refused_logged_at = float("-inf")
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._stopped = False
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"{name}-accept", daemon=True
        )

    def start(self) -> Server:
        self._thread.start()
        return self

    def answering(self) -> int:
        """Requests this server has read and not yet answered: a process that ends must let
        those replies go out first (a request decided just before the end lost its reply)."""
        with self._pending_lock:
            return self._answering

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
            except OSError as exc:
                if self._stopped:
                    return
                if exc.errno in _ACCEPT_FATAL:
                    log.error(
                        "%s: the listening socket failed, no more clients: %s", self._name, exc
                    )
                    return
                if exc.errno in _ACCEPT_PER_CONNECTION:
                    log.debug("%s: accept dropped a connection: %s", self._name, exc)
                    continue
                # out of descriptors or memory: the backlog waits until some are freed
                backoff = min(max(backoff * 2, ACCEPT_BACKOFF_S[0]), ACCEPT_BACKOFF_S[1])
                log.warning("%s: accept failed (%s); retrying in %.2f s", self._name, exc, backoff)
                self._wake.wait(backoff)
                continue
            backoff = 0.0
            if not self._admit():
                self._refuse(sock)
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock,), name=f"{self._name}-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread to spare: drop this client, keep serving
                self._release()
                sock.close()
                log.warning("%s: cannot serve a connection: %s", self._name, exc)
                self._wake.wait(ACCEPT_BACKOFF_S[0])

    def _admit(self) -> bool:
        with self._pending_lock:
            if self._pending >= self._max_pending:
                return False
            self._pending += 1
            return True

    def _release(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _refuse(self, sock: socket.socket) -> None:
        # counted before the close: whoever sees the close may read the count at once
        self.refused_handshakes += 1
        self._refused_unlogged += 1
        sock.close()
        now = time.monotonic()
        if now - self._refused_logged_at >= 1.0:  # a flood must not flood the log too
            log.warning(
                "%s: refused %d connection(s): already %d pending handshakes",
                self._name,
                self._refused_unlogged,
                self._max_pending,
            )
            self._refused_unlogged = 0
            self._refused_logged_at = now

    def _serve(self, sock: socket.socket) -> None:
        info: Message | None = None
        try:
            conn = Connection(sock, buffered=True)
            info = server_handshake(conn, self._token, self._handshake_timeout)
            sock.settimeout(None)
        except Exception as exc:  # whatever a stranger sends, it only costs its connection
            log.debug("%s: handshake failed: %s", self._name, exc)
            info = None
        finally:
            # released before the socket closes, so a peer that sees the close can retry at once
            self._release()
        if info is None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            return
        peer = Peer(conn, info)
        try:
            while True:
                msg = conn.recv()
                req_id = msg.get("id")
                if req_id is not None:
                    with self._pending_lock:
                        self._answering += 1
                try:
                    try:
                        reply = self._handler(peer, msg)
                    except Exception as exc:  # the request is refused, the connection stays
                        if req_id is not None:
                            peer.push({"re": req_id, "ok": False, "error": str(exc)})
                        continue
                    if req_id is not None:
                        peer.push({"re": req_id, "ok": True, **(reply or {})})
                finally:
                    if req_id is not None:
                        with self._pending_lock:
                            self._answering -= 1
        except WireError:
            pass
        finally:
            conn.close()
            if self._on_close is not None:
                self._on_close(peer)


class Client:
    """An authenticated connection to a Server, with request/reply and pushed notices."""

    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        info: Message | None = None,
        on_push: Callable[[Message], None] | None = None,
        on_close: Callable[[], None] | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        try:
            sock = socket.create_connection(address, timeout=connect_timeout)
        except OSError as exc:
            raise WireError(f"cannot reach {address[0]}:{address[1]}: {exc}") from exc
        self.conn = Connection(sock, buffered=True)
        try:
            client_handshake(self.conn, token, info or {}, timeout=connect_timeout)
            sock.settimeout(None)
        except BaseException:
            self.conn.close()
            raise
        self._on_push = on_push
        self._on_close = on_close
        self._next_id = 0
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Any]] = {}
        self._reader = threading.Thread(target=self._read_loop, name="xmig-client", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                req_id = msg.get("re")
                if req_id is None:
                    if self._on_push is not None:
                        self._on_push(msg)
                    continue
                with self._lock:
                    slot = self._waiting.pop(req_id, None)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
        except WireError:
            pass
        finally:
            self.conn.closed = True
            with self._lock:
                pending = list(self._waiting.values())
                self._waiting.clear()
            for slot in pending:
                slot[0].set()
            if self._on_close is not None:
                self._on_close()

    def call(self, op: str, timeout: float | None = 30.0, **fields: Any) -> Message:
        """Send a request and wait for its reply; raise RemoteError if it was refused."""
        event = threading.Event()
        slot: list[Any] = [event, None]
        with self._lock:
            if self.conn.closed:
                # the reader has ended and answers nothing more: waiting would only end in a
                # timeout, which a caller may take for a silent peer (a launcher for a hung
                # coordinator, which it then kills)
                raise WireError(f"connection closed before the request {op!r}")
            self._next_id += 1
            req_id = self._next_id
            self._waiting[req_id] = slot
        self.conn.send({"op": op, "id": req_id, **fields})
        if not event.wait(timeout):
            with self._lock:
                self._waiting.pop(req_id, None)
            raise TimeoutError(f"no reply to {op!r} within {timeout} s")
        reply = slot[1]
        if reply is None:
            raise WireError(f"connection closed before the reply to {op!r}")
        if not reply.get("ok"):
            raise RemoteError(str(reply.get("error", "refused")))
        return reply

    def notify(self, op: str, **fields: Any) -> None:
        """Send a one-way notice."""
        self.conn.send({"op": op, **fields})

    def close(self) -> None:
        self.conn.close()


def connect_retrying(
    address: tuple[str, int],
    token: str,
    within: float,
    *,
    info: Message | None = None,
    on_push: Callable[[Message], None] | None = None,
    on_close: Callable[[], None] | None = None,
    interval: float = 0.2,
) -> Client:
    """A Client to ``address``, trying again while nothing answers there (a host started
    before the coordinator's) for up to ``within`` seconds; a wrong token (AuthError) is
    final at once."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        try:
            return Client(address, token, info=info, on_push=on_push, on_close=on_close,
                          connect_timeout=max(1.0, min(10.0, left)))  # fmt: skip
        except AuthError:
            raise
        except WireError as exc:
            if time.monotonic() + interval >= deadline:
                raise WireError(f"{exc} (tried for {within:.0f} s)") from exc
            time.sleep(interval)
