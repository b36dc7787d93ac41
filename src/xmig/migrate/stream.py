"""Checkpoint images from one agent to another over TCP, with the job's token.

The source agent serves the directory CRIU wrote once (``ImageServer``); the target agent
fetches it into a directory of its own (``fetch_images``). After the same mutual HMAC
challenge as every control connection, a JSON manifest (names and sizes) is followed by the
files' bytes, sent with ``sendfile`` (no copy through user space).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from xmig.wire import Connection, WireError, client_handshake, server_handshake

CHUNK = 8 * 2**20


class StreamError(RuntimeError):
    """The images could not be sent or received."""


class ImageServer:
    """Serves ``folder``'s files to one authenticated client, then stops (or at ``timeout``)."""

    def __init__(self, folder: str | os.PathLike[str], token: str, host: str,
                 timeout: float) -> None:  # fmt: skip
        self.folder = Path(folder)
        self._token = token
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(timeout)
        self.address = self._sock.getsockname()[:2]
        self.sent = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, name="xmig-images", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                client, _ = self._sock.accept()
                client.settimeout(None)
                conn = Connection(client)
                try:
                    server_handshake(conn, self._token)
                except WireError:
                    conn.close()  # not one of ours: keep waiting for the target agent
                    continue
                try:
                    self._send(conn)
                finally:
                    conn.close()
                return
        except OSError as exc:
            self.error = str(exc)
        finally:
            self._sock.close()
            self.sent.set()

    def _send(self, conn: Connection) -> None:
        files = sorted(p for p in self.folder.iterdir() if p.is_file())
        conn.send({"files": [[p.name, p.stat().st_size] for p in files]})
        for path in files:
            with path.open("rb") as source:
                size, offset = path.stat().st_size, 0
                while offset < size:
                    offset += os.sendfile(conn.sock.fileno(), source.fileno(), offset,
                                          min(CHUNK, size - offset))  # fmt: skip
        if conn.recv().get("ok") is not True:
            raise OSError("the receiver did not confirm the images")


def fetch_images(
    address: tuple[str, int], token: str, folder: str | os.PathLike[str], timeout: float
) -> tuple[int, float]:
    """Receive the served images into ``folder``; returns (bytes, seconds)."""
    started = time.monotonic()
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise StreamError(
            f"cannot reach the image server {address[0]}:{address[1]}: {exc}"
        ) from exc
    conn = Connection(sock)
    total = 0
    try:
        client_handshake(conn, token, {"role": "images"})
        manifest = conn.recv()["files"]
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        for name, size in manifest:
            if "/" in name or name in (".", ".."):
                raise StreamError(f"refusing an image named {name!r}")
            with (target / name).open("wb") as out:
                left = int(size)
                while left:
                    got = sock.recv_into(view, min(CHUNK, left))
                    if not got:
                        raise StreamError(f"the image server closed during {name}")
                    out.write(view[:got])
                    left -= got
            total += int(size)
        conn.send({"ok": True})
    except (OSError, WireError, KeyError, ValueError) as exc:
        raise StreamError(f"receiving the images failed: {exc}") from exc
    finally:
        conn.close()
    return total, time.monotonic() - started
