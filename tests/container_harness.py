"""A rootfs for the container tests, made by ``scripts/make-rootfs.sh`` once and kept.

``XMIG_TEST_ROOTFS`` names one to use; otherwise it is made under ``/var/tmp`` in a folder
named by what goes into it (the script, the requirements, the torch build), so that a later
run on the same machine reuses it. Made aside and renamed: a half-made one is never used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from xmig.container import runc

from helpers import REPO

SCRIPT = REPO / "scripts" / "make-rootfs.sh"
MAKE_TIMEOUT_S = 900.0
CACHE = Path(os.environ.get("XMIG_TEST_ROOTFS_CACHE", "/var/tmp"))

why_not = None
if os.geteuid() != 0:
    why_not = "containers need root"
elif runc.find_runc() is None:
    why_not = "runc is not installed (apt install runc)"
elif shutil.which("debootstrap") is None and not os.environ.get("XMIG_TEST_ROOTFS"):
    why_not = "debootstrap is not installed (apt install debootstrap)"
needs_containers = pytest.mark.skipif(why_not is not None, reason=str(why_not))


def bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` to its end in a session of its own; on ``timeout`` its whole process group is
    killed (debootstrap's and podman's children too) and the test fails saying so."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not end within {timeout:.0f} s:\n"
                             f"{out[-3000:]}\n{err[-3000:]}") from None  # fmt: skip
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _key() -> str:
    digest = hashlib.sha256(SCRIPT.read_bytes())
    digest.update((SCRIPT.parent / "requirements.sh").read_bytes())
    digest.update((REPO / "pyproject.toml").read_bytes())
    digest.update(os.environ.get("TORCH_SPEC", "torch==2.13.0").encode())
    return digest.hexdigest()[:12]


def made_rootfs() -> tuple[Path, float]:
    """The test rootfs, and the seconds it took to make (0 when it was there already)."""
    given = os.environ.get("XMIG_TEST_ROOTFS")
    if given:
        return Path(given), 0.0
    folder = CACHE / f"xmig-test-rootfs-{_key()}"
    if (folder / "etc" / "xmig-rootfs").is_file():
        return folder, 0.0
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.monotonic()
    done = bounded(["bash", str(SCRIPT), str(partial)], MAKE_TIMEOUT_S)
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise AssertionError(f"make-rootfs.sh failed:\n{done.stdout}\n{done.stderr}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder, time.monotonic() - started


def job_containers(job_id: str) -> list[str]:
    """The job's containers runc still knows."""
    from xmig.agent.containers import job_prefix

    return runc.list_ids(job_prefix(job_id))
