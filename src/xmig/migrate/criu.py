"""A thin wrapper over the ``criu`` binary: find it, check it, dump and restore process trees.

CRIU older than 4.2 does not work on current kernels (3.17 cannot start on >= 6.13, 4.1 cannot
dump a process holding an IPv4 socket on >= 6.16); ``scripts/install-criu.sh`` builds 4.2.1.

What the dumped tree needs: to be a session leader (``setsid``; otherwise pass
``shell_job=True`` to both calls), its stdin/stdout/stderr on files or ``/dev/null``, and its
connections to peers that stay behind closed (they are reset on a move to another namespace).
A restore reuses the original PIDs: a parent that dumped its own child must reap it first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from xmig.procs import kill_group

MIN_VERSION: tuple[int, int] = (4, 2)
"""The oldest CRIU that works on the kernels this runs on."""

ENV_VAR = "XMIG_CRIU"
"""Environment variable naming the criu binary to use (no fallback when set)."""

DEFAULT_PATH = "/usr/local/sbin/criu"
"""Where ``scripts/install-criu.sh`` installs criu by default."""

INSTALL_HINT = "install it with: sudo bash scripts/install-criu.sh"

_VERSION_RE = re.compile(r"^Version:\s*(\d+(?:\.\d+)*)", re.MULTILINE)
_PID_TAKEN_RE = re.compile(r"Can't fork for (\d+): File exists")
# printed on every run where criu may not raise its own open-file limit; not a failure
_HARMLESS = ("Can't setup RLIMIT_NOFILE",)
_LOG_TAIL_LINES = 15
# errors and warnings: debug logging (4) costs a dump or restore of a GPU process a large
# share of its time (measured: a restore 0.21 s at 2, 0.63-0.75 s at 4, 341 MB of images)
LOG_LEVEL = os.environ.get("XMIG_CRIU_LOG_LEVEL", "2")
KEEP_LOGS_ENV = "XMIG_CRIU_KEEP_LOGS"
"""A folder: every dump's and restore's log is copied there (``<pid>-dump.log``,
``<pid>-restore.log``) before its images go, to read where a move's time went."""
_PROBLEM_RE = re.compile(r"(?:Error|Warn)\s*\([^)]*\):\s*(.*)")


class CriuError(RuntimeError):
    """A criu command failed, or criu is missing or unusable.

    ``log_tail`` holds the last lines of CRIU's log (empty when there is none).
    """

    def __init__(self, message: str, *, log_tail: str = "", returncode: int | None = None):
        super().__init__(f"{message}\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail
        self.returncode = returncode


def parse_version(text: str) -> tuple[int, ...] | None:
    """The version in ``criu --version`` output (``Version: 4.2.1``), or None."""
    m = _VERSION_RE.search(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def format_version(version: Sequence[int]) -> str:
    """``(4, 2, 1)`` -> ``"4.2.1"``."""
    return ".".join(str(p) for p in version)


def version_ok(version: Sequence[int] | None) -> bool:
    """Whether ``version`` is at least :data:`MIN_VERSION`."""
    return version is not None and tuple(version) >= MIN_VERSION


def criu_version(path: str, *, timeout: float = 10.0) -> tuple[int, ...] | None:
    """The version the binary at ``path`` reports, or None when it does not run."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(out.stdout + out.stderr)


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_criu() -> str | None:
    """The criu binary to use, or None.

    ``$XMIG_CRIU`` when set (and nothing else then); otherwise ``criu`` on PATH, then
    :data:`DEFAULT_PATH`. Of those two, the first that is new enough wins; when neither is, the
    first that exists (so that callers can say which old version they found).
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return env if _executable(env) else None
    found: list[str] = []
    for cand in (shutil.which("criu"), DEFAULT_PATH):
        if cand and _executable(cand) and cand not in found:
            found.append(cand)
    for cand in found:
        if version_ok(criu_version(cand)):
            return cand
    return found[0] if found else None


def _where() -> str:
    env = os.environ.get(ENV_VAR)
    if env:
        return f"${ENV_VAR}={env}"
    return f"PATH and {DEFAULT_PATH}"


def _require_criu() -> str:
    """The criu binary, or CriuError saying why there is no usable one."""
    path = find_criu()
    if path is None:
        raise CriuError(f"criu not found (looked at {_where()}); {INSTALL_HINT}")
    version = criu_version(path)
    if not version_ok(version):
        raise CriuError(_too_old(path, version))
    return path


def _too_old(path: str, version: tuple[int, ...] | None) -> str:
    have = f"CRIU {format_version(version)}" if version else "a criu that reports no version"
    return f"{have} at {path}: need >= {format_version(MIN_VERSION)} on this kernel; {INSTALL_HINT}"


def criu_status(*, timeout: float = 30.0) -> tuple[bool, str]:
    """Whether CRIU is usable here, and a one-line reason. Never raises."""
    try:
        path = find_criu()
        if path is None:
            return False, f"criu not found (looked at {_where()}); {INSTALL_HINT}"
        version = criu_version(path)
        if not version_ok(version):
            return False, _too_old(path, version)
        head = f"CRIU {format_version(version or ())} at {path}"
        if os.geteuid() != 0:
            return False, f"{head}; not root: dump and restore need root"
        try:
            out = subprocess.run(
                [path, "check"], capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return False, f"{head}; 'criu check' did not finish in {timeout:g} s"
        lines = _meaningful(out.stdout + out.stderr)
        if out.returncode != 0:
            detail = "; ".join(lines[-3:]) or f"exit {out.returncode}"
            return False, f"{head}; 'criu check' failed: {detail}"
        return True, f"{head}; criu check: {lines[-1] if lines else 'ok'}"
    except Exception as exc:  # a status report must not take its caller down
        return False, f"checking CRIU failed: {type(exc).__name__}: {exc}"


KDAT_CACHE = Path("/run/criu.kdat")  # CRIU's own path for root (``kerndat.c``)
_KDAT_MARK = Path("/run/criu.kdat.xmig")  # what the cache was made for: boot and CRIU
_TMPFS_MAGIC = 0x01021994


def _is_tmpfs(path: Path) -> bool:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True,
                             text=True, timeout=5, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and out.stdout.strip() == f"{_TMPFS_MAGIC:x}"


def keep_kdat_cache(*, timeout: float = 30.0) -> str:
    """Give CRIU its cache of the kernel's features where it would keep none; says what was
    done. Every criu command first probes the kernel (a test interface in a new network
    namespace among its probes: 30-45 ms a command, measured on the CPU and GPU machines),
    and keeps what it found in ``/run/criu.kdat``, but only when ``/run`` is a tmpfs (gone at
    reboot). Where it is not, the cache is made by ``criu check`` in a private mount
    namespace with a tmpfs on ``/run``, and copied into place with what it was made for (the
    boot's ID and CRIU's version); a later boot or another CRIU makes it again. CRIU reads a
    cache on any file system. Never raises."""
    try:
        if os.geteuid() != 0:
            return "not root: CRIU keeps its own cache where it can"
        if _is_tmpfs(KDAT_CACHE.parent):
            return f"{KDAT_CACHE.parent} is a tmpfs: CRIU keeps its own cache"
        path = find_criu()
        unshare = shutil.which("unshare")
        if path is None or unshare is None:
            return "no criu or no unshare: no cache"
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=timeout, check=False).stdout.strip()  # fmt: skip
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        made_for = f"boot {boot}; {' '.join(version.split())}"
        with contextlib.suppress(OSError):
            if KDAT_CACHE.is_file() and _KDAT_MARK.read_text() == made_for:
                return f"{KDAT_CACHE} already made for this boot and CRIU"
        script = ('mount -t tmpfs xmig-kdat /run && "$0" check >/dev/null 2>&1; '
                  f'cat {KDAT_CACHE}')  # fmt: skip
        # a group of its own, ended whole past the bound (criu check is the shell's child)
        proc = subprocess.Popen([unshare, "--mount", "--propagation", "private", "sh", "-c",
                                 script, path], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        try:
            cache, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"criu check did not end in {timeout:g} s (killed): no cache"
        if proc.returncode != 0 or not cache:
            return "criu check made no cache: none kept"
        for target, data in ((KDAT_CACHE, cache), (_KDAT_MARK, made_for.encode())):
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.chmod(partial, 0o600)
            os.replace(partial, target)
        return f"{KDAT_CACHE} made ({len(cache)} bytes)"
    except Exception as exc:  # a cache is a speed-up: its absence must not stop anything
        return f"no cache: {type(exc).__name__}: {exc}"


def _meaningful(text: str) -> list[str]:
    return [
        ln.strip() for ln in text.splitlines() if ln.strip() and not any(h in ln for h in _HARMLESS)
    ]


def _log_tail(log: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if not any(h in ln for h in _HARMLESS)]
    return "\n".join(kept[-lines:])


def _run(
    argv: list[str], log: Path, what: str, timeout: float, pass_fds: Sequence[int] = ()
) -> subprocess.CompletedProcess[str]:
    """Run criu; CriuError on a timeout (criu is killed then)."""
    try:
        return subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            pass_fds=tuple(pass_fds),
        )
    except subprocess.TimeoutExpired as exc:
        raise CriuError(
            f"{what}: criu did not finish in {timeout:g} s (killed); log {log}",
            log_tail=_log_tail(log),
        ) from exc


def _keep_log(log: Path, name: str) -> None:
    folder = os.environ.get(KEEP_LOGS_ENV)
    if folder:
        with contextlib.suppress(OSError):
            os.makedirs(folder, exist_ok=True)
            shutil.copyfile(log, os.path.join(folder, name))


def _first_problem(text: str) -> str:
    """CRIU's first error (or warning) in ``text``, without timestamp and source location."""
    for line in text.splitlines():
        m = _PROBLEM_RE.search(line)
        if m and not any(h in line for h in _HARMLESS):
            return m.group(1).strip()
    return ""


def _failure(
    what: str, out: subprocess.CompletedProcess[str], log: Path, hint: str = ""
) -> CriuError:
    tail = _log_tail(log) or "\n".join(_meaningful(out.stdout + out.stderr)[-_LOG_TAIL_LINES:])
    try:
        full = log.read_text(errors="replace")
    except OSError:
        full = out.stdout + out.stderr
    problem = _first_problem(full)
    said = f": {problem}" if problem else ""
    return CriuError(
        f"{what} failed ({hint}criu exit {out.returncode}){said}; log {log}, last lines:",
        log_tail=tail,
        returncode=out.returncode,
    )


def _tcp_args(tcp_established: bool, tcp_close: bool) -> list[str]:
    if tcp_established and tcp_close:
        raise ValueError("tcp_established and tcp_close exclude each other")
    if tcp_established:
        # no iptables here: lock the network with nftables while connections are frozen
        return ["--tcp-established", "--network-lock", "nftables"]
    return ["--tcp-close"] if tcp_close else []


def dump(
    pid: int,
    images_dir: str | os.PathLike[str],
    *,
    leave_running: bool = False,
    tcp_established: bool = False,
    tcp_close: bool = False,
    shell_job: bool = False,
    extra: Sequence[str] = (),
    timeout: float = 300.0,
) -> None:
    """Checkpoint the process tree rooted at ``pid`` into ``images_dir`` (created if missing).

    The tree is killed after the dump unless ``leave_running``. ``tcp_established`` saves
    established TCP connections (restore with it too); ``tcp_close`` does not save them, and
    they come back closed. The log is ``images_dir/dump.log``.
    """
    criu = _require_criu()
    images = Path(images_dir).resolve()
    images.mkdir(parents=True, exist_ok=True)
    log = images / "dump.log"
    argv = [criu, "dump", "-t", str(pid), "-D", str(images), "-o", log.name, f"-v{LOG_LEVEL}"]
    if leave_running:
        argv.append("--leave-running")
    if shell_job:
        argv.append("--shell-job")
    argv += _tcp_args(tcp_established, tcp_close)
    argv += list(extra)
    what = f"criu dump of PID {pid}"
    out = _run(argv, log, what, timeout)
    _keep_log(log, f"{pid}-dump.log")
    if out.returncode != 0:
        missing = not os.path.exists(f"/proc/{pid}")
        raise _failure(what, out, log, "no process has that PID; " if missing else "")


def restore(
    images_dir: str | os.PathLike[str],
    *,
    join_netns: str | None = None,
    detached: bool = True,
    tcp_established: bool = False,
    tcp_close: bool = False,
    shell_job: bool = False,
    extra: Sequence[str] = (),
    timeout: float = 300.0,
    pid_wait: float = 5.0,
    inherit_fds: Mapping[int, str] | None = None,
    lazy: LazyPages | None = None,
) -> int:
    """Restore the tree dumped in ``images_dir``; returns the PID of its root (the dumped one).

    ``join_netns``: a network namespace name (``/run/netns/<name>``) or path to restore into;
    call this from the namespace the tree was dumped in. ``detached``: the restored tree is
    handed to init (or the nearest subreaper); otherwise its root becomes a child of this
    process (``--restore-sibling``), to be reaped with ``os.waitpid``. While one of the PIDs is
    still taken (it stays so for a moment after a dump), restore is retried for up to
    ``pid_wait`` seconds. ``inherit_fds`` maps a file descriptor of this process to a
    resource of the dumped tree (``pipe:[inode]``, ``socket:[inode]``, a path without its
    leading ``/``): the restored tree gets that descriptor instead (criu's own output is
    captured, so its stdout cannot stand in). ``lazy``: a started ``LazyPages`` of these
    images; the tree runs again before its memory is back, which it serves. The log is
    ``images_dir/restore.log``.
    """
    criu = _require_criu()
    images = Path(images_dir).resolve()
    if not (images / "inventory.img").is_file():
        raise CriuError(f"no CRIU images in {images} (inventory.img missing)")
    log = images / "restore.log"
    pidfile = images / "restore.pid"
    argv = [criu, "restore", "-D", str(images), "-o", log.name, f"-v{LOG_LEVEL}", "-d"]
    argv += ["--pidfile", str(pidfile)]
    if lazy is not None:
        argv.append("--lazy-pages")
    if not detached:
        argv.append("--restore-sibling")
    if join_netns is not None:
        ns = join_netns if "/" in join_netns else f"/run/netns/{join_netns}"
        if not os.path.exists(ns):
            raise CriuError(f"network namespace {ns} does not exist")
        argv += ["--join-ns", f"net:{ns}"]
    if shell_job:
        argv.append("--shell-job")
    argv += _tcp_args(tcp_established, tcp_close)
    inherit_fds = dict(inherit_fds or {})
    for fd, resource in inherit_fds.items():
        argv += ["--inherit-fd", f"fd[{fd}]:{resource}"]
    argv += list(extra)

    what = f"criu restore from {images}"
    deadline = time.monotonic() + pid_wait
    delay = 0.05
    while True:
        pidfile.unlink(missing_ok=True)
        out = _run(argv, log, what, timeout, pass_fds=list(inherit_fds))
        if out.returncode == 0:
            break
        taken = _PID_TAKEN_RE.search(_log_tail(log, 200))
        if taken is None:
            raise _failure(what, out, log)
        if lazy is not None:  # a server hands one restore its pages: a new one for the next
            lazy.stop()
            lazy.start()
        if time.monotonic() + delay > deadline:
            err = _failure(what, out, log)
            raise CriuError(
                f"{what}: PID {taken.group(1)} is still taken after {pid_wait:g} s"
                f"{_pid_hint(int(taken.group(1)))}",
                log_tail=err.log_tail,
                returncode=out.returncode,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    try:
        pid = int(pidfile.read_text().strip())
        _keep_log(log, f"{pid}-restore.log")
        return pid
    except (OSError, ValueError) as exc:
        raise CriuError(f"{what}: criu succeeded but wrote no PID to {pidfile}") from exc


class LazyPages:
    """``criu lazy-pages`` over one folder of images: it hands a lazily restored tree its
    memory as the tree touches it (userfaultfd), and the rest behind, then exits.

    Its end must be watched (``wait``): a tree whose server died before every page was
    handed over would read zeros where its memory was, so the caller ends that tree.
    """

    def __init__(self, images_dir: str | os.PathLike[str], *, timeout: float = 120.0) -> None:
        self.images = Path(images_dir).resolve()
        self.timeout = timeout
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, ready_within: float = 10.0) -> None:
        """Start the server; return once it listens (its socket is in the images' folder)."""
        criu = _require_criu()
        socket = self.images / "lazy-pages.socket"
        socket.unlink(missing_ok=True)
        argv = [criu, "lazy-pages", "-D", str(self.images), "-o", "lazy-pages.log",
                f"-v{LOG_LEVEL}"]  # fmt: skip
        self._process = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + ready_within
        while not socket.exists():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise CriuError(f"criu lazy-pages for {self.images} did not start",
                                log_tail=_log_tail(self.images / "lazy-pages.log"))  # fmt: skip
            time.sleep(0.002)

    def wait(self) -> str | None:
        """Wait (up to ``timeout``) until every page is handed over; None when it was, else
        what went wrong (the server is ended then)."""
        if self._process is None:
            return "criu lazy-pages was not started"
        try:
            code = self._process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return f"criu lazy-pages had not handed every page over after {self.timeout:g} s"
        if code != 0:
            problem = _first_problem(_log_tail(self.images / "lazy-pages.log", 200))
            return f"criu lazy-pages exited with {code}" + (f": {problem}" if problem else "")
        return None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


_STATS_MAGIC = 8  # two 32-bit magics before the entry's size and the entry


def _stats_entry(path: Path, number: int) -> dict[int, int | bytes]:
    """The fields of one part (``number``: 1 the dump's, 2 the restore's) of a CRIU stats
    image; empty when the file is missing or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    if len(data) < _STATS_MAGIC + 4:
        return {}
    size = int.from_bytes(data[_STATS_MAGIC : _STATS_MAGIC + 4], "little")
    part = _protobuf_fields(data[_STATS_MAGIC + 4 : _STATS_MAGIC + 4 + size]).get(number)
    return _protobuf_fields(part) if isinstance(part, bytes) else {}


def _in_seconds(fields: dict[int, int | bytes], names: dict[int, str]) -> dict[str, float]:
    # stats.proto's times are in microseconds
    return {name: int(value) / 1e6 for number, name in names.items()
            if isinstance(value := fields.get(number), int)}  # fmt: skip


def dump_stats(images_dir: str | os.PathLike[str]) -> dict[str, float]:
    """CRIU's own account of a dump (its ``stats-dump`` image): seconds the tree was being
    frozen and stayed frozen, spent collecting and writing its memory, and the pages it wrote.
    Empty when the file is missing or unreadable."""
    fields = _stats_entry(Path(images_dir) / "stats-dump", 1)
    names = {1: "freezing_s", 2: "frozen_s", 3: "memdump_s", 4: "memwrite_s"}
    stats = _in_seconds(fields, names)
    if isinstance(fields.get(7), int):
        stats["pages_written"] = float(fields[7])
    return stats


def restore_stats(images_dir: str | os.PathLike[str]) -> dict[str, float]:
    """CRIU's own account of a restore (its ``stats-restore`` image, written beside the
    images): seconds from its start to the tree's resumption, and the pages it read back.
    Empty when the file is missing or unreadable."""
    fields = _stats_entry(Path(images_dir) / "stats-restore", 2)
    stats = _in_seconds(fields, {4: "restore_s"})
    if isinstance(fields.get(5), int):
        stats["pages_restored"] = float(fields[5])
    return stats


def _protobuf_fields(data: bytes) -> dict[int, int | bytes]:
    """The varint and length-delimited fields of one protobuf message (the last of each
    number); stops at anything else."""
    fields: dict[int, int | bytes] = {}
    at = 0

    def varint() -> int:
        nonlocal at
        value, shift = 0, 0
        while at < len(data):
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise ValueError("truncated varint")

    try:
        while at < len(data):
            key = varint()
            number, kind = key >> 3, key & 7
            if kind == 0:
                fields[number] = varint()
            elif kind == 2:
                length = varint()
                fields[number] = data[at : at + length]
                at += length
            else:
                break
    except ValueError:
        pass
    return fields


def _pid_hint(pid: int) -> str:
    """Who holds ``pid``: a zombie waits for its parent to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
    state = fields.get("State", "").strip()
    ppid = fields.get("PPid", "").strip()
    if state.startswith("Z"):
        return f" (a zombie: its parent, PID {ppid}, must reap it before a restore)"
    return f" (held by a live process, {fields.get('Name', '?').strip()}, parent PID {ppid})"
