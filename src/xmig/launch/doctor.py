"""``xmig doctor``: whether this machine has what moving a process needs (and containers).

Checks CRIU, root, network namespaces through ``ip netns``, the folder a moving rank parks
its tensors in, the folder CRIU's images go to, the kernel's transparent huge pages and
the largest pipe CRIU may fill (advice),
on a GPU machine the CUDA checkpoint API, and runc for container mode.
Every check reports instead of raising.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from xmig.migrate.criu import criu_status
from xmig.paths import huge_pages, local_images_root, park_dir

Check = tuple[str, bool, str]
"""(check name, ok, detail)."""

CUDA_CHECKPOINT_MIN = 12080
"""Oldest CUDA driver API version (``cuDriverGetVersion``) with the ``cuCheckpointProcess*``
entry points: CUDA 12.8, driver branch r570. (The ``cuda-checkpoint`` tool works from r550,
through an interface that is not public.)"""


def check_criu() -> Check:
    """CRIU >= 4.2 found and ``criu check`` passes."""
    ok, detail = criu_status()
    return "CRIU", ok, detail


def check_root() -> Check:
    """Running as root (CRIU and network namespaces need it)."""
    uid = os.geteuid()
    if uid == 0:
        return "root", True, "running as root"
    return "root", False, f"running as uid {uid}: CRIU and network namespaces need root"


def _folder(
    folder: Path, label: str, unwritable: str, on_disk: str, small_pages: str
) -> tuple[bool, str]:
    """A folder xmig keeps a move's data in: not ok (``unwritable`` said) if it is not a
    writable folder; else ok, with its free room and pages, and ``on_disk`` or
    ``small_pages`` as advice where it is not a tmpfs or has no huge pages."""
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return False, f"{label} is not a writable folder: {unwritable}"
    room = os.statvfs(folder)
    free = f"{room.f_bavail * room.f_frsize / 2**30:.1f} GiB free"
    policy = huge_pages(folder)
    if policy is None:
        return True, f"{label}: {free}, but not a tmpfs: {on_disk}"
    if policy == "never":
        return True, f"{label}: tmpfs, {free}, 4 KiB pages; {small_pages}"
    return True, f"{label}: tmpfs, {free}, huge pages ({policy})"


def check_park_dir() -> Check:
    """The folder a moving rank parks its tensors in (``XMIG_PARK_DIR``): there, writable,
    memory-backed, and whether it has huge pages (a GPU rank's large parking file pins and is
    torn down seconds faster on them)."""
    folder = park_dir()
    ok, detail = _folder(
        folder, str(folder),
        unwritable="a moving rank keeps its tensors in its process (slower); set XMIG_PARK_DIR",
        on_disk="parked tensors go to its disk",
        small_pages="for GPU ranks mount a tmpfs with huge=within_size and set XMIG_PARK_DIR "
                    "to it",
    )  # fmt: skip
    return "parking folder", ok, detail


def check_images_dir() -> Check:
    """The folder each node keeps a move's CRIU images in (``XMIG_IMAGES_DIR``, else the
    temp dir): there and writable (else every move's dump fails), and whether it is a tmpfs
    with huge pages (a 1.5 GB GPU rank moved in 2.86-2.93 s with its images there against
    3.21-3.46 s in /tmp on ext4, H100)."""
    folder = local_images_root()
    named = "XMIG_IMAGES_DIR" if os.environ.get("XMIG_IMAGES_DIR") else "the temp dir"
    ok, detail = _folder(
        folder, f"{folder} ({named})",
        unwritable="a move's CRIU dump would fail there; set XMIG_IMAGES_DIR to one",
        on_disk="a tmpfs with huge=within_size in XMIG_IMAGES_DIR writes images faster",
        small_pages="one mounted with huge=within_size writes images faster",
    )  # fmt: skip
    return "images folder", ok, detail


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def check_transparent_huge_pages(setting: Path = THP_ENABLED) -> Check:
    """The kernel's transparent huge pages: with ``always``, CRIU's restore of a moving rank
    faults its memory in 2 MiB pages; otherwise in 4 KiB ones, which took a 1.5 GB GPU rank's
    restore 0.84-0.90 s against 0.57-0.60 s (H100). Advice only: the setting is the
    machine's, for every process on it."""
    name = "transparent huge pages"
    try:
        text = setting.read_text()
    except OSError:
        return name, True, "not in this kernel: a restored rank's memory is in 4 KiB pages"
    chosen = re.search(r"\[(\w+)\]", text)
    mode = chosen.group(1) if chosen else text.strip()
    if mode == "always":
        return name, True, "always: CRIU restores a moving rank's memory in huge pages"
    return name, True, (f"{mode}: CRIU restores a moving rank's memory in 4 KiB pages; "
                        f"`echo always > {setting}` on nodes that receive moves cut a 1.5 GB GPU "
                        "rank's downtime by about 0.3 s (H100), if the node's other work "
                        "allows it")  # fmt: skip


PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")
CRIU_PIPE_BYTES = 4 << 20
"""The largest pipe CRIU's dump fills with a process's pages (1024 pages: its own cap,
``PIPE_MAX_SIZE`` in its ``page-pipe.h``, rounded up by the kernel)."""
CAP_SYS_RESOURCE = 24


def check_pipe_size(setting: Path = PIPE_MAX_SIZE, status: Path = Path("/proc/self/status")
                    ) -> Check:  # fmt: skip
    """Whether CRIU's dump can fill pipes of 4 MiB. Without ``CAP_SYS_RESOURCE`` (root in a
    container often lacks it) a pipe grows only to ``fs.pipe-max-size``, 1 MiB by default,
    and the dump hands a process's pages over in four times as many rounds: 0.13-0.17 s per
    GiB against 0.04-0.06 s (CPU machine, ``bench/criu_pipes.py``); a 1.5 GB GPU rank moved in
    1.85 s against 1.95 s (H100, median of 8 and 7 moves, ``bench/move_pairs.py``). On the
    2-core CPU machine, larger pipes into a tmpfs mounted ``huge=within_size`` made every other
    dump's writing slow (huge pages slow to come by there). Information only: the limit is
    the machine's."""
    name = "pipe size"
    try:
        limit = int(setting.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return name, True, f"{setting} cannot be read: CRIU's pipes are the kernel's default"
    if _has_capability(status, CAP_SYS_RESOURCE):
        return name, True, "CAP_SYS_RESOURCE held: CRIU's dump grows its pipes past the limit"
    if limit >= CRIU_PIPE_BYTES:
        return name, True, f"fs.pipe-max-size is {limit}: CRIU's dump fills pipes of 4 MiB"
    return name, True, (f"fs.pipe-max-size is {limit} and CAP_SYS_RESOURCE is not held: CRIU's "
                        f"dump fills pipes of {limit >> 10} KiB. Pipes of 4 MiB (`sysctl -w "
                        f"fs.pipe-max-size={CRIU_PIPE_BYTES}`) moved a 1.5 GB GPU rank in 1.85 s "
                        "against 1.95 s on an H100 (median); on a 2-core machine with images on "
                        "a tmpfs with huge pages, every other dump's writing took 1 s instead of "
                        "0.15 s: measure with bench/criu_pipes.py")  # fmt: skip


def _has_capability(status: Path, bit: int) -> bool:
    """Whether this process's effective capabilities (``CapEff`` in ``status``) hold ``bit``
    (False where it cannot be read)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_netns(timeout: float = 10.0) -> Check:
    """``ip netns`` works; as root, a namespace is really added and deleted."""
    name = "network namespaces"
    ip = shutil.which("ip")
    if ip is None:
        return name, False, "no 'ip' command: install iproute2"

    def ip_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ip, "netns", *args], capture_output=True, text=True, timeout=timeout, check=False
        )

    listed = ip_run("list")
    if listed.returncode != 0:
        return name, False, f"'ip netns list' failed: {_last_line(listed.stderr)}"
    if os.geteuid() != 0:
        return name, False, "'ip netns list' works, but adding a namespace needs root"
    probe = f"xmigdoctor-{secrets.token_hex(3)}"
    added = ip_run("add", probe)
    if added.returncode != 0:
        return name, False, f"'ip netns add' failed: {_last_line(added.stderr)}"
    deleted = ip_run("delete", probe)
    if deleted.returncode != 0:
        return name, False, f"'ip netns delete {probe}' failed: {_last_line(deleted.stderr)}"
    return name, True, f"{ip}: a namespace was added and deleted"


def check_cuda_checkpoint() -> Check:
    """On a GPU machine: cuda-bindings with ``cuCheckpointProcessLock`` and a new enough driver."""
    name = "CUDA checkpoint API"
    try:
        import torch
    except ImportError:
        return name, True, "not a GPU machine (torch is not installed)"
    if not torch.cuda.is_available():
        return name, True, "not a GPU machine (torch sees no CUDA device); not needed"
    try:
        from cuda.bindings import driver
    except ImportError:
        return name, False, "cuda-bindings is not installed (pip install cuda-bindings)"
    if not hasattr(driver, "cuCheckpointProcessLock"):
        return name, False, "cuda-bindings is too old: it has no cuCheckpointProcessLock"
    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        return name, False, f"cuInit failed: {err}"
    err, version = driver.cuDriverGetVersion()
    if err != driver.CUresult.CUDA_SUCCESS:
        return name, False, f"cuDriverGetVersion failed: {err}"
    have = f"driver {_kernel_driver_version() or '?'} (CUDA {_cuda_version_str(version)})"
    if version < CUDA_CHECKPOINT_MIN:
        need = _cuda_version_str(CUDA_CHECKPOINT_MIN)
        return name, False, f"{have}: the checkpoint API needs CUDA {need} (r570) or newer"
    try:
        # a read-only call: fails with "not found" when the driver lacks the entry point
        driver.cuCheckpointProcessGetState(os.getpid())
    except RuntimeError as exc:
        return name, False, f"{have}: cuCheckpointProcessGetState unusable: {exc}"
    return name, True, f"{have}, cuda-bindings has cuCheckpointProcessLock"


def _cuda_version_str(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _kernel_driver_version() -> str | None:
    """The NVIDIA kernel driver's version (``580.159.03``), where the system shows it."""
    try:
        return Path("/sys/module/nvidia/version").read_text().strip()
    except OSError:
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def check_runc(timeout: float = 10.0) -> Check:
    """runc, for container mode (``--container``); its absence fails nothing else."""
    from xmig.container.runc import INSTALL_HINT, find_runc

    found = find_runc()
    if found is None:
        return "runc", True, f"not installed: only --container needs it; {INSTALL_HINT}"
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True,
                             timeout=timeout, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return "runc", False, f"{found} does not run: {exc}"
    if out.returncode != 0:
        return "runc", False, f"{found} does not run: {_last_line(out.stderr + out.stdout)}"
    first = (out.stdout.strip().splitlines() or ["runc"])[0]
    return "runc", True, f"{first} at {found}: --container can run workers in containers"


CHECKS: tuple[Callable[[], Check], ...] = (
    check_criu,
    check_root,
    check_netns,
    check_park_dir,
    check_images_dir,
    check_transparent_huge_pages,
    check_pipe_size,
    check_cuda_checkpoint,
    check_runc,
)


def doctor_report() -> list[Check]:
    """Every check's (name, ok, detail); a check that raises is reported as failed."""
    report: list[Check] = []
    for check in CHECKS:
        label = check.__name__.removeprefix("check_").replace("_", " ")
        try:
            report.append(check())
        except Exception as exc:  # a broken check must not hide the others
            report.append((label, False, f"the check itself failed: {type(exc).__name__}: {exc}"))
    return report


def run_doctor() -> int:
    """Print the report as a table; 0 when everything checked is usable, else 1."""
    report = doctor_report()
    width = max(len(name) for name, _, _ in report)
    print("xmig doctor: what this machine can do for process migration")
    for name, ok, detail in report:
        print(f"  [{' ok ' if ok else 'FAIL'}] {name:<{width}}  {detail}")
    failed = [name for name, ok, _ in report if not ok]
    if failed:
        print(f"not ready: {', '.join(failed)}")
        return 1
    print("ready")
    return 0


if __name__ == "__main__":
    sys.exit(run_doctor())
