"""Authenticated control messages between xmig's processes.

Every control connection (launcher, agents, workers, ``xmig inject`` → coordinator or agent)
speaks length-prefixed JSON frames over TCP. A connection is usable only after a mutual
challenge-response with the job's token (HMAC-SHA256), so nothing outside the job can post
faults, inject them or join it. Requests carry an ``id`` and get one reply carrying ``re``;
messages without an ``id`` are one-way notices (pushes).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from hashlib import sha256
from typing import Any

PROTOCOL = "xmig/1"
MAX_FRAME = 64 << 20
HANDSHAKE_TIMEOUT_S = 5.0

Message = dict[str, Any]


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


class Connection:
    """One framed, authenticated socket; ``send`` is safe from several threads."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: Message) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            try:
                self.sock.sendall(struct.pack("!I", len(data)) + data)
            except OSError as exc:
                raise WireError(f"send failed: {exc}") from exc

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError as exc:
                raise WireError(f"receive failed: {exc}") from exc
            if not chunk:
                raise WireError("connection closed by peer")
            buf += chunk
        return bytes(buf)

    def recv(self) -> Message:
        (size,) = struct.unpack("!I", self._recv_exact(4))
        if size > MAX_FRAME:
            raise WireError(f"frame of {size} bytes exceeds the limit")
        try:
            msg = json.loads(self._recv_exact(size))
        except ValueError as exc:
            raise WireError("peer sent a frame that is not JSON") from exc
        if not isinstance(msg, dict):
            raise WireError("peer sent a frame that is not an object")
        return msg

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def server_handshake(conn: Connection, token: str) -> Message:
    """The server's half of the mutual challenge; returns the client's info."""
    nonce = os.urandom(16).hex()
    conn.send({"hello": PROTOCOL, "nonce": nonce})
    answer = conn.recv()
    if not hmac.compare_digest(str(answer.get("mac", "")), _mac(token, b"client|", nonce)):
        conn.send({"error": "authentication failed: wrong job token"})
        raise AuthError("client failed authentication")
    conn.send({"mac": _mac(token, b"server|", str(answer.get("nonce", "")))})
    return answer.get("info") or {}


def client_handshake(conn: Connection, token: str, info: Message) -> None:
    """The client's half of the mutual challenge (raises AuthError on a wrong token)."""
    hello = conn.recv()
    if hello.get("hello") != PROTOCOL:
        raise WireError(f"peer does not speak {PROTOCOL}")
    nonce = os.urandom(16).hex()
    conn.send({"nonce": nonce, "mac": _mac(token, b"client|", str(hello["nonce"])), "info": info})
    reply = conn.recv()
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
        try:
            self.conn.send(msg)
            return True
        except WireError:
            return False


Handler = Callable[[Peer, Message], Message | None]


class Server:
    """Accepts authenticated clients and serves each on its own thread.

    ``handler(peer, msg)`` answers requests (its return value becomes the reply; an exception
    becomes an error reply) and receives notices (its return value is dropped).
    ``on_close(peer)`` is called once when a client's connection ends.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handler: Handler,
        on_close: Callable[[Peer], None] | None = None,
        name: str = "xmig",
    ) -> None:
        self._token = token
        self._handler = handler
        self._on_close = on_close
        self._name = name
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.address = self._sock.getsockname()[:2]
        self._stopped = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"{name}-accept", daemon=True
        )

    def start(self) -> Server:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock,), name=f"{self._name}-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            info = server_handshake(conn, self._token)
            sock.settimeout(None)
        except (WireError, OSError, KeyError, TypeError):
            conn.close()
            return
        peer = Peer(conn, info)
        try:
            while True:
                msg = conn.recv()
                req_id = msg.get("id")
                try:
                    reply = self._handler(peer, msg)
                except Exception as exc:  # the request is refused, the connection stays
                    if req_id is not None:
                        peer.push({"re": req_id, "ok": False, "error": str(exc)})
                    continue
                if req_id is not None:
                    peer.push({"re": req_id, "ok": True, **(reply or {})})
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
        self.conn = Connection(sock)
        client_handshake(self.conn, token, info or {})
        sock.settimeout(None)
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
