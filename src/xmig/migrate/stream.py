"""Checkpoint images from one agent to another over TCP, with the job's token.

The source agent serves the directory CRIU wrote once (``ImageServer``); the target agent
fetches it into a directory of its own (``fetch_images``). After the same mutual HMAC
challenge as every control connection, a JSON manifest (names and sizes, and the host files
the process maps: paths and sizes) goes to the target, which answers with the host files it
lacks (a target on the same machine has them already); then the files' bytes follow, sent
with ``sendfile`` (no copy through user space). A host file is written at its own path.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from xmig.wire import Connection, WireError, client_handshake, server_handshake

CHUNK = 8 * 2**20


class StreamError(RuntimeError):
    """The images could not be sent or received."""


class ImageServer:
    """Serves ``folder``'s files to one authenticated client, then stops (or at ``timeout``)."""

    def __init__(self, folder: str | os.PathLike[str], token: str, host: str,
                 timeout: float, host_files: Sequence[str] = ()) -> None:  # fmt: skip
        self.folder = Path(folder)
        self.host_files = [Path(p) for p in host_files]
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
        host_files = [[str(p), p.stat().st_size] for p in self.host_files]
        conn.send({"files": [[p.name, p.stat().st_size] for p in files],
                   "host_files": host_files})  # fmt: skip
        offered = {str(p) for p in self.host_files}
        wanted = conn.recv().get("want", [])
        if not isinstance(wanted, list) or not set(wanted) <= offered:
            raise OSError(f"the receiver asked for host files not offered: {wanted!r}")
        for path in [*files, *(Path(w) for w in wanted)]:
            with path.open("rb") as source:
                size, offset = os.fstat(source.fileno()).st_size, 0
                while offset < size:
                    offset += os.sendfile(conn.sock.fileno(), source.fileno(), offset,
                                          min(CHUNK, size - offset))  # fmt: skip
        if conn.recv().get("ok") is not True:
            raise OSError("the receiver did not confirm the images")


def _present(path: str, size: int) -> bool:
    """Whether this machine has the host file (a target on the source's machine has it: its
    name is unique to one process's move)."""
    return os.path.exists(path) and os.path.getsize(path) == size


def _receive(sock: socket.socket, view: memoryview, path: Path, size: int,
             shared_dir: bool = False) -> None:  # fmt: skip
    """``size`` bytes from ``sock`` into a new file at ``path``. ``shared_dir``: in a folder
    every user may write to (``/dev/shm``): the file must not exist yet (a link planted
    there is not followed) and only its owner may read it (it holds a model's state)."""
    if shared_dir:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with os.fdopen(fd, "wb") as out:
        left = size
        while left:
            got = sock.recv_into(view, min(len(view), left))
            if not got:
                raise StreamError(f"the image server closed during {path.name}")
            out.write(view[:got])
            left -= got


def fetch_images(
    address: tuple[str, int],
    token: str,
    folder: str | os.PathLike[str],
    timeout: float,
    accept: Callable[[str], bool] = lambda _path: False,
) -> tuple[int, float]:
    """Receive the served images into ``folder``, and the served host files this machine
    lacks at their own paths (only those ``accept`` allows); returns (bytes, seconds)."""
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
        manifest = conn.recv()
        for name, _ in manifest["files"]:
            if "/" in name or name in (".", ".."):
                raise StreamError(f"refusing an image named {name!r}")
        missing = []
        for path, size in manifest.get("host_files", []):
            if not accept(path):
                raise StreamError(f"refusing a host file at {path!r}")
            if not _present(path, int(size)):
                missing.append([path, int(size)])
        conn.send({"want": [path for path, _ in missing]})
        view = memoryview(bytearray(CHUNK))
        for name, size in manifest["files"]:
            _receive(sock, view, target / name, int(size))
            total += int(size)
        for path, size in missing:  # whole, or not there at all
            partial = Path(f"{path}.partial")
            _receive(sock, view, partial, size, shared_dir=True)
            os.replace(partial, path)
            total += size
        conn.send({"ok": True})
    except (OSError, WireError, KeyError, ValueError) as exc:
        raise StreamError(f"receiving the images failed: {exc}") from exc
    finally:
        conn.close()
    return total, time.monotonic() - started
