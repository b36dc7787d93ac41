"""Where a job keeps its files on this machine."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def jobs_dir() -> Path:
    """Where running jobs leave their address and token (readable by their owner only), and
    each job its folder."""
    return Path(os.environ.get("XMIG_JOBS_DIR", Path.home() / ".xmig" / "jobs"))


def job_folder(job_id: str) -> Path:
    """The job's own folder: its event log (``events.jsonl``)."""
    return jobs_dir() / job_id


PARK_PREFIX = "xmig-park-"


def park_dir() -> Path:
    """Where a moving rank parks its tensors (``worker.parking``): a memory-backed folder,
    ``/dev/shm`` unless ``XMIG_PARK_DIR`` names another (every node of a job reads the same
    variable)."""
    return Path(os.environ.get("XMIG_PARK_DIR", "/dev/shm"))


def local_images_root() -> Path:
    """Where each node keeps its moves' images when no shared directory is set:
    ``XMIG_IMAGES_DIR`` (the same path on every node), else the temp dir. A tmpfs with huge
    pages there writes CRIU's images faster than a disk's page cache (a 1.5 GiB process's
    dump 0.45-0.49 s against 0.65-0.69 s on ext4, CPU machine); the images of a move are
    removed once it has been restored."""
    return Path(os.environ.get("XMIG_IMAGES_DIR") or tempfile.gettempdir())


def huge_pages(folder: Path, mounts: str | None = None) -> str | None:
    """The huge page policy of the tmpfs that holds ``folder`` (its ``huge=`` option:
    ``always``, ``within_size``, ``advise``; ``never`` when it has none), or None if it is not
    a tmpfs. A parking file on huge pages is pinned for the GPU and torn down many times
    faster than one on 4 KiB pages (measured: ``bench/results/gpu-speed.md``).
    ``mounts``: the text of ``/proc/self/mounts`` (tests)."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    target = os.path.realpath(folder)
    best: tuple[int, str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):  # the last mount over it wins
            best = (len(point), fields[2], fields[3])
    if best is None or best[1] != "tmpfs":
        return None
    options = dict(o.split("=", 1) if "=" in o else (o, "") for o in best[2].split(","))
    return options.get("huge", "never")


def parking_files(job_id: str, folder: Path | None = None) -> list[Path]:
    """The parking files of job ``job_id`` on this machine (a crashed worker's)."""
    folder = folder or park_dir()
    if not folder.is_dir():
        return []
    return sorted(folder.glob(f"{PARK_PREFIX}{job_id}-*"))


def is_parking_file(path: str, folder: Path | None = None) -> bool:
    """Whether ``path`` names a parking file: the only files an agent writes for a restore
    outside its own folder."""
    candidate = Path(path)
    return (candidate.parent == (folder or park_dir())
            and candidate.name.startswith(PARK_PREFIX) and ".." not in candidate.name)  # fmt: skip


def machine_id() -> str:
    """This machine and filesystem view: its boot id and its mount namespace. Two processes
    with the same id see the same files (agents of simulated hosts on one machine do)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mounts = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return ""
    return f"{boot}:{mounts}"
