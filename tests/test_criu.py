"""The CRIU wrapper against the real criu: a counting process is dumped and restored (same PID,
also into another network namespace), and failures raise CriuError carrying CRIU's reason."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from xmig.migrate import criu
from xmig.migrate.criu import CriuError, criu_status, dump, restore

pytestmark = pytest.mark.timeout(120)

USABLE, STATUS = criu_status()
needs_criu = pytest.mark.skipif(not USABLE, reason=f"CRIU not usable here: {STATUS}")

# counts in a loop; each count replaces the file, so no file stays open across a dump. With
# "tcp", each count also makes a round trip through a TCP connection held open by the process.
COUNTER = """
import os, socket, sys, time
tcp = "tcp" in sys.argv
if tcp:
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
i = 0
while True:
    i += 1
    if tcp:
        a.sendall(f"{i}\\n".encode())
        i = int(b.recv(64).split()[-1])
    with open("count.tmp", "w") as f:
        f.write(f"{i} {os.getpid()}\\n")
    os.replace("count.tmp", "count")
    time.sleep(0.02)
"""


@dataclass
class Counter:
    proc: subprocess.Popen[bytes]
    file: Path
    marker: str

    def read(self) -> tuple[int, int]:
        """(count, PID that wrote it)."""
        count, pid = self.file.read_text().split()
        return int(count), int(pid)

    def wait_beyond(self, count: int, timeout: float = 10.0) -> tuple[int, int]:
        """Wait until the count passes ``count``; the latest (count, PID)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError):
                now = self.read()
                if now[0] > count:
                    return now
            assert time.monotonic() < deadline, f"count stayed at {count} for {timeout} s"
            time.sleep(0.02)


def _kill(pid: int, marker: str, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` if it is still ours (its command line carries ``marker``); reap it."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if marker.encode() not in cmdline:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)  # ours when restored with detached=False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state == "Z":
            return
        time.sleep(0.05)


@pytest.fixture
def counter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Counter]:
    """A counting Python process in a session of its own, std streams on /dev/null
    (indirect parameter "tcp": counting through a TCP connection)."""
    marker = f"xmigtest-{secrets.token_hex(4)}"
    mode = getattr(request, "param", "plain")
    proc = subprocess.Popen(
        [sys.executable, "-c", COUNTER, marker, mode],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    c = Counter(proc, tmp_path / "count", marker)
    try:
        c.wait_beyond(2)
        yield c
    finally:
        _kill(proc.pid, marker)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace, deleted afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command (iproute2) to create a network namespace")
    name = f"xmigtest-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, timeout=10)


def _dump_and_reap(c: Counter, images: Path) -> tuple[int, float]:
    """Dump the counter (which kills it), reap it; (last count, seconds the dump took)."""
    t = time.monotonic()
    dump(c.proc.pid, images)
    took = time.monotonic() - t
    assert c.proc.wait(timeout=10) == -signal.SIGKILL
    frozen = c.read()[0]
    time.sleep(0.2)
    assert c.read()[0] == frozen, "the process still counts after its dump"
    return frozen, took


@needs_criu
def test_dump_restore_same_pid(counter: Counter, tmp_path: Path, measure) -> None:
    images = tmp_path / "images"
    frozen, dump_s = _dump_and_reap(counter, images)
    assert (images / "inventory.img").is_file()

    t = time.monotonic()
    pid = restore(images)
    restore_s = time.monotonic() - t
    assert pid == counter.proc.pid
    count, writer = counter.wait_beyond(frozen)
    assert writer == pid
    assert counter.wait_beyond(count)[0] > count
    measure(f"criu dump of a counting Python process: {dump_s:.2f} s, restore {restore_s:.2f} s")


@needs_criu
@pytest.mark.parametrize("counter", ["tcp"], indirect=True)
def test_established_tcp_connection_survives(counter: Counter, tmp_path: Path, measure) -> None:
    images = tmp_path / "images"
    t = time.monotonic()
    dump(counter.proc.pid, images, tcp_established=True)
    dump_s = time.monotonic() - t
    assert counter.proc.wait(timeout=10) == -signal.SIGKILL
    frozen = counter.read()[0]

    t = time.monotonic()
    pid = restore(images, tcp_established=True)
    restore_s = time.monotonic() - t
    assert pid == counter.proc.pid
    # the count goes on through the restored connection, from where it stopped
    count, writer = counter.wait_beyond(frozen)
    assert writer == pid and count <= frozen + 50
    assert counter.wait_beyond(count)[0] > count
    measure(f"criu dump with a TCP connection {dump_s:.2f} s, restore {restore_s:.2f} s")


@needs_criu
def test_restore_into_network_namespace(
    counter: Counter, netns: str, tmp_path: Path, measure
) -> None:
    images = tmp_path / "images"
    frozen, dump_s = _dump_and_reap(counter, images)

    t = time.monotonic()
    pid = restore(images, join_netns=netns, detached=False)
    restore_s = time.monotonic() - t
    assert pid == counter.proc.pid
    assert counter.wait_beyond(frozen)[1] == pid
    ns = os.stat(f"/proc/{pid}/ns/net").st_ino
    assert ns != os.stat("/proc/self/ns/net").st_ino
    assert ns == os.stat(f"/run/netns/{netns}").st_ino

    # detached=False: the restored process is this one's child
    os.kill(pid, signal.SIGKILL)
    waited, status = os.waitpid(pid, 0)
    assert waited == pid and os.WIFSIGNALED(status)
    measure(f"criu dump {dump_s:.2f} s, restore into another network namespace {restore_s:.2f} s")


@needs_criu
def test_restore_waits_for_the_pid(counter: Counter, tmp_path: Path) -> None:
    images = tmp_path / "images"
    dump(counter.proc.pid, images)
    # not reaped yet: the dumped PID is a zombie of this process
    with pytest.raises(CriuError, match="zombie") as err:
        restore(images, pid_wait=0.3)
    print(str(err.value).splitlines()[0])
    # reaped while restore retries
    reaper = threading.Timer(0.5, counter.proc.wait)
    reaper.start()
    try:
        pid = restore(images, pid_wait=10)
    finally:
        reaper.join(timeout=10)
    assert pid == counter.proc.pid
    counter.wait_beyond(counter.read()[0])


def _free_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free PID")


@needs_criu
def test_dump_of_missing_pid_fails_clearly(tmp_path: Path) -> None:
    pid = _free_pid()
    with pytest.raises(CriuError) as err:
        dump(pid, tmp_path / "images")
    msg = str(err.value)
    print(msg.splitlines()[0])
    assert f"criu dump of PID {pid} failed" in msg
    assert "no process has that PID" in msg
    assert str(tmp_path / "images" / "dump.log") in msg
    assert err.value.log_tail and err.value.returncode


@needs_criu
def test_restore_without_images_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(CriuError, match="no CRIU images"):
        restore(tmp_path)


def test_parse_version() -> None:
    assert criu.parse_version("Version: 4.2.1\nGitID: v4.2.1\n") == (4, 2, 1)
    assert criu.parse_version("Version: 4.2\n") == (4, 2)
    assert criu.parse_version("criu: command not found") is None
    assert criu.version_ok((4, 2, 1)) and criu.version_ok((5, 0))
    assert not criu.version_ok((4, 1, 1)) and not criu.version_ok((3, 17, 1))
    assert not criu.version_ok(None)


def test_missing_criu_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(criu.ENV_VAR, "/nonexistent/criu")
    assert criu.find_criu() is None
    ok, text = criu_status()
    assert not ok
    assert "criu not found" in text and "/nonexistent/criu" in text
    with pytest.raises(CriuError, match="criu not found"):
        dump(1, tmp_path)


def test_old_criu_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv(criu.ENV_VAR, str(fake))
    ok, text = criu_status()
    assert not ok
    assert "CRIU 3.17.1" in text and "need >= 4.2" in text
    with pytest.raises(CriuError, match="need >= 4.2"):
        restore(tmp_path)


# holds MIB MiB of random bytes untouched until "go" exists, then writes whether they are
# still what they were
HOLDER = """
import hashlib, os, sys, time
size = int(sys.argv[2]) << 20
memory = bytearray(os.urandom(1 << 20)) * (size >> 20)
digest = hashlib.sha256(memory).hexdigest()
open("ready.tmp", "w").write(str(os.getpid()))
os.replace("ready.tmp", "ready")
while not os.path.exists("go"):
    time.sleep(0.005)
open("done.tmp", "w").write(str(hashlib.sha256(memory).hexdigest() == digest))
os.replace("done.tmp", "done")
time.sleep(60)
"""


def _holder(folder: Path, mib: int) -> tuple[subprocess.Popen[bytes], str]:
    marker = f"xmigtest-{secrets.token_hex(4)}"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, marker, str(mib)], cwd=folder,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not (folder / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.01)
    return proc, marker


def _wait_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not come within {timeout} s"
        time.sleep(0.01)
    return path.read_text()


@needs_criu
def test_a_lazy_restore_hands_the_whole_memory_back(tmp_path: Path, measure) -> None:
    proc, marker = _holder(tmp_path, 64)
    images = tmp_path / "images"
    try:
        dump(proc.pid, images)
        proc.wait(timeout=10)
        stats = criu.dump_stats(images)
        # CRIU's own account: the 64 MiB went into the images, the tree frozen meanwhile
        assert stats["pages_written"] >= (64 << 20) // 4096, stats
        assert stats["memwrite_s"] > 0 and 0 < stats["frozen_s"] < 60, stats
        lazy = criu.LazyPages(images, timeout=30)
        lazy.start()
        started = time.monotonic()
        assert restore(images, lazy=lazy) == proc.pid
        restore_s = time.monotonic() - started
        (tmp_path / "go").touch()
        assert _wait_file(tmp_path / "done") == "True"  # every byte came back
        assert lazy.wait() is None  # and the server ended once it had handed them over
    finally:
        _kill(proc.pid, marker)
    measure(f"criu lazy restore of 64 MiB: {restore_s:.3f} s; dump stats {stats}")


@needs_criu
def test_a_lazily_restored_process_whose_pages_stop_coming_is_killed(tmp_path: Path) -> None:
    from xmig.migrate.mover import _watch_lazy_pages

    proc, marker = _holder(tmp_path, 64)
    images = tmp_path / "images"
    try:
        dump(proc.pid, images)
        proc.wait(timeout=10)
        lazy = criu.LazyPages(images, timeout=1.0)
        lazy.start()
        assert lazy._process is not None
        pid = restore(images, lazy=lazy)
        os.kill(lazy._process.pid, signal.SIGSTOP)  # the server hangs: no page comes
        (tmp_path / "go").touch()
        _watch_lazy_pages(lazy, pid)  # it gives up after its timeout and kills the process
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}"):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            assert time.monotonic() < deadline, "the process was not killed"
            time.sleep(0.02)
        assert not (tmp_path / "done").exists()  # it never read its memory
        assert not images.exists()  # the images went with it
    finally:
        _kill(proc.pid, marker)


def test_dump_stats_are_read_from_criu_s_image(tmp_path: Path) -> None:
    # a stats-dump image written by CRIU 4.2.1 (a 200 MB Python process)
    raw = bytes.fromhex(
        "4059105506330957290000000a2708860110"
        "9ae30918d9a10820fb9007289c9e0330"
        "0038b89d0340004800500858086000680070"
        "00"
    )
    (tmp_path / "stats-dump").write_bytes(raw)
    stats = criu.dump_stats(tmp_path)
    assert stats == {"freezing_s": 134e-6, "frozen_s": 160154e-6, "memdump_s": 135385e-6,
                     "memwrite_s": 116859e-6, "pages_written": 52920.0}  # fmt: skip
    assert criu.dump_stats(tmp_path / "missing") == {}
    (tmp_path / "stats-dump").write_bytes(raw[:10])
    assert criu.dump_stats(tmp_path) == {}


@needs_criu
def test_the_mover_restores_a_process_without_gpu_state_lazily(tmp_path: Path) -> None:
    from xmig.migrate.mover import ProcessMover

    proc, marker = _holder(tmp_path, 32)
    images = tmp_path / "images"
    mover = ProcessMover(lazy=True)
    try:
        dumped = mover.checkpoint(proc.pid, images)
        proc.wait(timeout=10)
        assert dumped.criu_stats["pages_written"] >= (32 << 20) // 4096
        restored = mover.restore(images, proc.pid, 0)
        assert restored.lazy
        (tmp_path / "go").touch()
        assert _wait_file(tmp_path / "done") == "True"
        deadline = time.monotonic() + 30  # the images go once every page is handed over
        while images.exists():
            assert time.monotonic() < deadline, "the images stayed"
            time.sleep(0.02)
    finally:
        _kill(proc.pid, marker)


@needs_criu
def test_the_mover_times_each_step_in_order_and_keeps_criu_s_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU process's trip through the mover, the driver's calls faked: the GPU state goes
    before CRIU's dump and comes back after its restore, each step is timed under its name,
    and with XMIG_CRIU_KEEP_LOGS both of CRIU's logs stay once the images are gone."""
    from xmig.migrate import cuda
    from xmig.migrate.mover import ProcessMover

    calls: list[str] = []

    class FakeCheckpoint:
        def __init__(self, pid: int) -> None:
            self.pid, self.times = pid, {}

        def save(self) -> float:
            calls.append(f"save {self.pid} alive={os.path.exists(f'/proc/{self.pid}')}")
            self.times = {"lock": 0.001, "checkpoint": 0.002}
            return 0.003

        def load(self, remap: dict[str, str] | None = None) -> float:
            calls.append(f"load {self.pid} alive={os.path.exists(f'/proc/{self.pid}')} {remap}")
            self.times = {"restore": 0.004, "unlock": 0.001}
            return 0.005

    gpu, other = (f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in (1, 2))
    monkeypatch.setattr(cuda, "GpuCheckpoint", FakeCheckpoint)
    monkeypatch.setattr(cuda, "process_gpu_bytes", lambda pid, uuid: 123)
    monkeypatch.setattr(cuda, "machine_gpus", lambda: [gpu, other])
    monkeypatch.setattr(cuda, "device_uuid", lambda ordinal: other)  # it lands on the other
    logs = tmp_path / "logs"
    monkeypatch.setenv(criu.KEEP_LOGS_ENV, str(logs))
    proc, marker = _holder(tmp_path, 8)
    images = tmp_path / "images"
    try:
        dumped = ProcessMover(lazy=False).checkpoint(proc.pid, images, gpu)
        proc.wait(timeout=10)
        assert list(dumped.steps) == ["gpu_query", "gpu_checkpoint", "criu_dump", "interface",
                                      "image_size"]  # fmt: skip
        assert dumped.steps["criu_dump"] == pytest.approx(dumped.dump_s, abs=1e-3)
        assert dumped.gpu_bytes == 123 and dumped.gpu_checkpoint_s == 0.003
        restored = ProcessMover(lazy=False).restore(images, proc.pid, 0, gpu=gpu,
                                                    gpus_before=[gpu, other])  # fmt: skip
        assert list(restored.steps) == ["criu_restore", "gpu_pairs", "gpu_restore", "criu_stats"]
        assert restored.steps["criu_restore"] <= restored.restore_s
        assert restored.gpu_restore_s == 0.005 and restored.gpu_times["restore"] == 0.004
        assert restored.to_gpu == other
        assert all(v >= 0 for v in [*dumped.steps.values(), *restored.steps.values()])
        # the driver's checkpoint came while the process lived, its restore once it lived again
        assert calls == [
            f"save {proc.pid} alive=True",
            f"load {proc.pid} alive=True {{{gpu!r}: {other!r}, {other!r}: {gpu!r}}}",
        ]
        assert sorted(p.name for p in logs.iterdir()) == [f"{proc.pid}-dump.log",
                                                          f"{proc.pid}-restore.log"]  # fmt: skip
        (tmp_path / "go").touch()
        assert _wait_file(tmp_path / "done") == "True"
    finally:
        _kill(proc.pid, marker)


def test_restore_stats_are_read_from_criu_s_image(tmp_path: Path) -> None:
    # a stats-restore image written by CRIU 4.2.1 (a 200 MB Python process)
    raw = bytes.fromhex("405910550633095710000000120e08001000180020ba960928b99d03")
    (tmp_path / "stats-restore").write_bytes(raw)
    assert criu.restore_stats(tmp_path) == {"restore_s": 150330e-6, "pages_restored": 52921.0}
    assert criu.dump_stats(tmp_path) == {}  # a restore's image has no dump part
    assert criu.restore_stats(tmp_path / "missing") == {}
    (tmp_path / "stats-restore").write_bytes(raw[:10])
    assert criu.restore_stats(tmp_path) == {}


@needs_criu
def test_criu_s_kernel_cache_is_made_where_run_is_no_tmpfs(tmp_path: Path) -> None:
    """CRIU keeps what it probed of the kernel only on a tmpfs ``/run``; elsewhere xmig makes
    the cache for it once per boot and CRIU, and a dump then loads it instead of probing."""
    if shutil.which("unshare") is None or criu._is_tmpfs(criu.KDAT_CACHE.parent):
        pytest.skip("no unshare, or /run is a tmpfs (CRIU keeps its cache itself)")
    kept = {p: p.read_bytes() for p in (criu.KDAT_CACHE, criu._KDAT_MARK) if p.is_file()}
    try:
        for p in (criu.KDAT_CACHE, criu._KDAT_MARK):
            p.unlink(missing_ok=True)
        assert "made" in criu.keep_kdat_cache()
        made = criu.KDAT_CACHE.read_bytes()
        assert len(made) > 0 and "boot " in criu._KDAT_MARK.read_text()
        assert "already made" in criu.keep_kdat_cache()
        criu._KDAT_MARK.write_text("boot another; Version: 0")  # another boot or CRIU
        said = criu.keep_kdat_cache()
        assert "made" in said and "already" not in said
        proc, marker = _holder(tmp_path, 1)
        try:
            subprocess.run([criu.find_criu(), "dump", "-t", str(proc.pid), "-D", str(tmp_path),
                            "-o", "dump.log", "-v3"], check=True, timeout=60)  # fmt: skip
            proc.wait(timeout=10)
        finally:
            _kill(proc.pid, marker)
        assert "Loaded kdat cache" in (tmp_path / "dump.log").read_text()
    finally:
        for p, data in kept.items():
            p.write_bytes(data)


def test_a_criu_check_past_its_bound_is_ended_with_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making the kernel cache never hangs an agent, nor leaves a criu behind it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")
    if criu._is_tmpfs(criu.KDAT_CACHE.parent):
        pytest.skip("/run is a tmpfs: no cache is made")
    marker = f"xmigtest-{secrets.token_hex(4)}"
    fake = tmp_path / "criu"
    sleeper = f'{sys.executable} -c "import time; time.sleep(60)" {marker}'
    fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "Version: 9.9"; exit 0; }}\n'
                    f"exec {sleeper}\n")  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setenv(criu.ENV_VAR, str(fake))
    kept = {p: p.read_bytes() for p in (criu.KDAT_CACHE, criu._KDAT_MARK) if p.is_file()}
    try:
        started = time.monotonic()
        said = criu.keep_kdat_cache(timeout=1.0)
        assert "did not end in 1 s" in said and time.monotonic() - started < 10
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
        assert left.stdout.strip() == "", "the sleeping check outlived its bound"
        assert {p: p.read_bytes() for p in kept} == kept  # nothing written
    finally:
        subprocess.run(["pkill", "-9", "-f", marker], check=False)
        for p, data in kept.items():
            p.write_bytes(data)
