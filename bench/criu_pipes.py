"""CRIU's dump with pipes of 1 MiB against 4 MiB: a process holding MIB MiB, dumped into a
tmpfs and restored on the same machine, ``fs.pipe-max-size`` set to each value in turn (ABBA).

    python bench/criu_pipes.py [--mib 1024] [--rounds 4] [--dir /dev/shm]   (root, CRIU >= 4.2)

Without ``CAP_SYS_RESOURCE`` CRIU's dump grows its page pipes only up to that limit (1 MiB
by default; CRIU's own cap is 1024 pages, 4 MiB), so it moves the pages in four times as
many rounds between its parasite and the image. Per dump: CRIU's own times (its
``stats-dump``: frozen, collecting the memory, writing it) and the wall time of dump and
restore; every restored process checks its memory's digest. The limit is set back as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from xmig.migrate import criu  # noqa: E402

PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")
LIMITS = (1 << 20, 4 << 20)
READY_S = 60.0

HOLDER = Path(__file__).resolve().parent / "memory_holder.py"


def wait_for(path: Path, bound: float) -> None:
    deadline = time.monotonic() + bound
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {bound:.0f} s")
        time.sleep(0.01)


def one_move(work: Path, mib: int, limit: int) -> dict[str, float | bool]:
    """Start a holder, dump it with ``limit`` as the pipe limit, restore it, check it."""
    for name in ("ready", "go", "done"):
        (work / name).unlink(missing_ok=True)
    images = work / "images"
    shutil.rmtree(images, ignore_errors=True)
    holder = subprocess.Popen([sys.executable, str(HOLDER), str(work), str(mib)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    pid = holder.pid
    try:
        wait_for(work / "ready", READY_S)
        PIPE_MAX_SIZE.write_text(str(limit))
        started = time.monotonic()
        criu.dump(pid, images)
        dumped = time.monotonic()
        holder.wait(timeout=10)  # the dump ended it; reap it so its PID is free again
        criu.restore(images)
        restored = time.monotonic()
        stats = criu.dump_stats(images)
        (work / "go").touch()
        wait_for(work / "done", READY_S)
        same = (work / "done").read_text().split()[0] == "True"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the restored one, if it runs on
            os.kill(pid, signal.SIGKILL)
        if holder.poll() is None:
            holder.wait(timeout=10)
    return {"dump_s": dumped - started, "restore_s": restored - dumped, "intact": same,
            **stats}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds (4 dumps each)")
    parser.add_argument("--dir", default="/dev/shm", help="where the images go (a tmpfs)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (CRIU, and the pipe limit is set per dump)", file=sys.stderr)
        return 2
    usable, detail = criu.criu_status()
    if not usable:
        print(f"CRIU is not usable here: {detail}", file=sys.stderr)
        return 2
    original = PIPE_MAX_SIZE.read_text().strip()
    status = Path("/proc/self/status").read_text()
    cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff"))
    print(f"{detail}; CapEff {cap_eff} (CAP_SYS_RESOURCE "
          f"{'held' if int(cap_eff, 16) >> 24 & 1 else 'not held'}); "
          f"fs.pipe-max-size {original}; {args.mib} MiB; images in {args.dir}")  # fmt: skip
    rows: dict[int, list[dict[str, float | bool]]] = {limit: [] for limit in LIMITS}
    work = Path(tempfile.mkdtemp(prefix="xmig-pipes-", dir=args.dir))
    try:
        one_move(work, args.mib, LIMITS[0])  # warms the tmpfs and the page cache
        for _ in range(args.rounds):
            for limit in (*LIMITS, *reversed(LIMITS)):
                row = one_move(work, args.mib, limit)
                rows[limit].append(row)
                print(f"{limit >> 10:>5} KiB: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in row.items()), flush=True)  # fmt: skip
    finally:
        PIPE_MAX_SIZE.write_text(original)
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        "| fs.pipe-max-size | dumps | CRIU frozen s | collecting s | writing s | "
        "collecting less writing s | dump wall s | restore wall s | intact |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for limit, runs in rows.items():

        def med(key: str, runs=runs) -> str:
            values = [float(r[key]) for r in runs if key in r]
            return f"{statistics.median(values):.3f}" if values else "-"

        gap = statistics.median(float(r["memdump_s"]) - float(r["memwrite_s"])
                                for r in runs)  # fmt: skip
        print(f"| {limit >> 10} KiB | {len(runs)} | {med('frozen_s')} | {med('memdump_s')} | "
              f"{med('memwrite_s')} | {gap:.3f} | {med('dump_s')} | {med('restore_s')} | "
              f"{all(r['intact'] for r in runs)} |")  # fmt: skip
    return 0 if all(r["intact"] for runs in rows.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
