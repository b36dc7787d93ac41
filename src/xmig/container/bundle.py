"""A worker's container, as an OCI runtime config (``config.json``): pure, from what it runs.

The root filesystem is shared by every container of a job and mounted read-only; ``/tmp`` is
a tmpfs of the container's own. The paths the job needs (the project, xmig's code, the job's
folder, the checkpoint folder...) are bind mounts at the same path as on the host, so that
every path a script or xmig passes means the same inside; ``/dev/shm`` is the host's (as
``--ipc=host``: a parked tensor's file is then one CRIU keeps by reference). The container
joins its node's network namespace (the agent's), and has a PID namespace of its own: the
worker is its init, PID 1, before and after a move.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OCI_VERSION = "1.0.2-dev"
HOSTNAME = "xmig"
# a checkpoint closes the worker's TCP connections (it reconnects, as a bare process does)
# and takes no network lock: the namespace is the node's, shared with its other ranks
CRIU_CONFIG = "tcp-close\nnetwork-lock skip\n"
CRIU_CONFIG_ANNOTATION = "org.criu.config"
# runc's defaults: the few capabilities a process needs, /proc's risky files hidden
CAPABILITIES = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
MASKED_PATHS = ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                "/proc/sched_debug", "/sys/firmware", "/proc/scsi"]  # fmt: skip
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
# what a container never inherits from its agent's environment: paths of the host's own
# Python, which mean something else inside
HOST_ONLY_ENV = ("VIRTUAL_ENV", "PYTHONHOME", "TMPDIR", "LD_LIBRARY_PATH", "LD_PRELOAD")
CONTAINER_PATH = "/opt/xmig/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Bind:
    """A host path mounted at the same path inside."""

    path: str
    writable: bool = False


@dataclass(frozen=True)
class ContainerSpec:
    """What one container runs, and with what."""

    rootfs: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    netns: str  # the network namespace it joins (a path: /proc/PID/ns/net, /run/netns/NAME)
    binds: tuple[Bind, ...] = ()
    nofile: tuple[int, int] = (1024, 1024)  # soft, hard
    hostname: str = HOSTNAME
    annotations: Mapping[str, str] = field(default_factory=dict)


def container_env(base: Mapping[str, str], import_root: str) -> dict[str, str]:
    """A worker's environment inside its container: ``base`` (its agent's, with the worker's
    variables) less the host's own Python paths, with the container's PATH and xmig's code
    (at ``import_root``, mounted) first on PYTHONPATH."""
    env = {k: v for k, v in base.items() if k not in HOST_ONLY_ENV}
    env["PATH"] = CONTAINER_PATH
    paths = [import_root, *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("HOME", "/root")
    return env


def ordered_binds(binds: Sequence[Bind]) -> list[Bind]:
    """Each path once (writable if any asks so), parents before children, so that a
    writable folder inside a read-only one is mounted over it."""
    merged: dict[str, bool] = {}
    for bind in binds:
        path = os.path.normpath(bind.path)
        if path == "/":
            raise ValueError("the host's root cannot be mounted into a container")
        merged[path] = merged.get(path, False) or bind.writable
    return [Bind(p, w) for p, w in sorted(merged.items(), key=lambda kv: (kv[0].count("/"),
                                                                         kv[0]))]  # fmt: skip


def oci_config(spec: ContainerSpec) -> dict[str, Any]:
    """The runtime config (OCI 1.0) of ``spec``'s container."""
    caps = {kind: list(CAPABILITIES) for kind in ("bounding", "effective", "permitted",
                                                  "ambient")}  # fmt: skip
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "bind", "source": "/dev/shm",
         "options": ["rbind", "rw", "nosuid", "nodev"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777"]},
    ]  # fmt: skip
    for bind in ordered_binds(spec.binds):
        if bind.path == "/dev/shm":
            continue  # the host's already
        mounts.append({"destination": bind.path, "type": "bind", "source": bind.path,
                       "options": ["rbind", "rw" if bind.writable else "ro"]})  # fmt: skip
    soft, hard = spec.nofile
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.args),
            "env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
            "cwd": spec.cwd,
            "capabilities": caps,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": hard, "soft": soft}],
            "noNewPrivileges": True,
        },
        "root": {"path": spec.rootfs, "readonly": True},
        "hostname": spec.hostname,
        "mounts": mounts,
        "annotations": dict(spec.annotations),
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                           {"type": "mount"}, {"type": "network", "path": spec.netns}],
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
        },
    }  # fmt: skip


def write_bundle(folder: str | os.PathLike[str], spec: ContainerSpec) -> Path:
    """A bundle folder for ``spec``: its ``config.json`` and the CRIU config it names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    criu_config = folder / "criu.conf"
    criu_config.write_text(CRIU_CONFIG)
    annotations = {**spec.annotations, CRIU_CONFIG_ANNOTATION: str(criu_config)}
    config = oci_config(ContainerSpec(**{**spec.__dict__, "annotations": annotations}))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
