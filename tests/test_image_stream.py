"""Checkpoint images from one agent to another: intact, authenticated, bounded."""

import os
import socket
import threading

import pytest

from xmig.migrate import stream
from xmig.migrate.stream import ImageServer, StreamError, fetch_images
from xmig.wire import Connection, server_handshake

TOKEN = "t" * 64


def _images(folder):
    folder.mkdir()
    files = {"pages-1.img": os.urandom(3 * 2**20 + 17), "inventory.img": b"x", "empty.img": b""}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def test_images_arrive_intact(tmp_path):
    files = _images(tmp_path / "source")
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30)
    size, seconds = fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30)
    assert size == sum(len(d) for d in files.values()) and seconds >= 0
    for name, data in files.items():
        assert (tmp_path / "target" / name).read_bytes() == data
    assert server.sent.wait(10) and server.error is None


def test_a_wrong_token_gets_nothing_and_the_target_still_can(tmp_path):
    _images(tmp_path / "source")
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30)
    with pytest.raises(StreamError):
        fetch_images(server.address, "u" * 64, tmp_path / "intruder", timeout=10)
    assert not any((tmp_path / "intruder").iterdir())
    fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30)
    assert (tmp_path / "target" / "inventory.img").read_bytes() == b"x"


def test_the_server_gives_up_when_nobody_comes(tmp_path):
    _images(tmp_path / "source")
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=0.3)
    assert server.sent.wait(10)
    assert server.error is not None
    with pytest.raises(StreamError, match="cannot reach"):
        fetch_images(server.address, TOKEN, tmp_path / "target", timeout=5)


def test_a_hostile_manifest_is_refused(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))

    def evil_server():
        client, _ = listener.accept()
        conn = Connection(client)
        server_handshake(conn, TOKEN)
        conn.send({"files": [["../escape.img", 1]]})
        client.sendall(b"x")
        conn.close()

    thread = threading.Thread(target=evil_server, daemon=True)
    thread.start()
    with pytest.raises(StreamError, match="refusing an image named"):
        fetch_images(listener.getsockname()[:2], TOKEN, tmp_path / "target", timeout=10)
    thread.join(10)
    listener.close()
    assert not (tmp_path / "escape.img").exists()


def test_a_host_file_the_target_lacks_is_sent_to_its_own_path(tmp_path, monkeypatch):
    files = _images(tmp_path / "source")
    shm = tmp_path / "shm"
    shm.mkdir()
    parked = shm / "xmig-park-job-rank0"
    parked.write_bytes(os.urandom(2 * 2**20 + 5))
    data = parked.read_bytes()
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30,
                         host_files=[str(parked)])  # fmt: skip
    # the target as on another machine: the file is not there (here both share the disk)
    monkeypatch.setattr(stream, "_present", lambda path, size: False)
    size, _ = fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30,
                           accept=lambda path: path.startswith(str(shm)))  # fmt: skip
    assert parked.read_bytes() == data and parked.stat().st_mode & 0o777 == 0o600
    assert size == sum(len(d) for d in files.values()) + len(data)
    assert server.sent.wait(10) and server.error is None


def test_a_host_file_the_target_has_is_not_sent(tmp_path):
    files = _images(tmp_path / "source")
    parked = tmp_path / "xmig-park-job-rank0"
    parked.write_bytes(b"p" * 4096)
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30,
                         host_files=[str(parked)])  # fmt: skip
    size, _ = fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30,
                           accept=lambda path: True)  # fmt: skip
    assert size == sum(len(d) for d in files.values())  # the images only: same machine
    assert parked.read_bytes() == b"p" * 4096
    assert server.sent.wait(10) and server.error is None


def test_a_host_file_outside_what_the_target_accepts_is_refused(tmp_path):
    _images(tmp_path / "source")
    victim = tmp_path / "victim"
    victim.write_bytes(b"v")
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30,
                         host_files=[str(victim)])  # fmt: skip
    with pytest.raises(StreamError, match="refusing a host file"):
        fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30)
    assert victim.read_bytes() == b"v" and not (tmp_path / "victim.partial").exists()


def test_a_link_planted_where_a_host_file_arrives_is_not_followed(tmp_path, monkeypatch):
    _images(tmp_path / "source")
    shm = tmp_path / "shm"
    shm.mkdir()
    parked = shm / "xmig-park-job-rank0"
    parked.write_bytes(b"p" * 4096)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v")
    (shm / "xmig-park-job-rank0.partial").symlink_to(victim)  # another local user's trap
    server = ImageServer(tmp_path / "source", TOKEN, "127.0.0.1", timeout=30,
                         host_files=[str(parked)])  # fmt: skip
    monkeypatch.setattr(stream, "_present", lambda path, size: False)
    with pytest.raises(StreamError):
        fetch_images(server.address, TOKEN, tmp_path / "target", timeout=30,
                     accept=lambda path: path.startswith(str(shm)))  # fmt: skip
    assert victim.read_bytes() == b"v"
