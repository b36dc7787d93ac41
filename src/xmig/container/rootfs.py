"""A container's root filesystem: is it one, and which Python runs the workers in it."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

VENV_PYTHON = "/opt/xmig/venv/bin/python"
"""Where ``scripts/make-rootfs.sh`` puts the environment with xmig's dependencies."""

PYTHONS = (VENV_PYTHON, "/usr/local/bin/python3", "/usr/bin/python3")
"""The interpreters looked for in a rootfs, in this order."""

_MAX_LINKS = 40


class RootfsError(ValueError):
    """Not a rootfs xmig can run workers in; the message is the line to say."""


def resolve_inside(rootfs: Path, path: str) -> Path | None:
    """The host path of ``path`` as seen inside ``rootfs`` (its symbolic links followed
    within the rootfs, as the container sees them), or None when it leads nowhere."""
    parts = list(PurePosixPath(path).parts[1:])
    here = PurePosixPath("/")
    links = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            here = here.parent
            continue
        candidate = rootfs / str(here / part).lstrip("/")
        if candidate.is_symlink():
            links += 1
            if links > _MAX_LINKS:
                return None
            target = PurePosixPath(os.readlink(candidate))
            if target.is_absolute():
                here = PurePosixPath("/")
                parts = list(target.parts[1:]) + parts
            else:
                parts = list(target.parts) + parts
            continue
        if not candidate.exists():
            return None
        here = here / part
    return rootfs / str(here).lstrip("/")


def find_python(rootfs: str | os.PathLike[str], wanted: str | None = None) -> str:
    """The interpreter (its path inside the rootfs) that runs the workers: ``wanted`` when
    given, else the first of :data:`PYTHONS` there. RootfsError saying what is missing."""
    root = Path(rootfs)
    if not root.is_dir():
        raise RootfsError(f"--container {rootfs}: no such folder")
    if not any(resolve_inside(root, d) is not None for d in ("/usr", "/bin")):
        raise RootfsError(f"--container {rootfs}: not a root filesystem (no /usr or /bin); "
                          "make one with: sudo bash scripts/make-rootfs.sh DIR")  # fmt: skip
    for candidate in (wanted,) if wanted else PYTHONS:
        found = resolve_inside(root, candidate)
        if found is not None and found.is_file() and os.access(found, os.X_OK):
            return candidate
    looked = wanted or ", ".join(PYTHONS)
    raise RootfsError(f"--container {rootfs}: the rootfs has no Python (looked for {looked}); "
                      "make one with: sudo bash scripts/make-rootfs.sh DIR")  # fmt: skip
