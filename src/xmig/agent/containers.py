"""A node's containers (``xmig run --container ROOTFS``): each worker and hot spare in its own.

:class:`NodeContainers` turns what the agent would start as a process (a worker's script, a
spare's interpreter, with their environment) into a container of the job's rootfs: the same
command, run by the rootfs's Python, with the paths the job uses mounted at the same place,
in this node's network namespace. It also restores a moved rank's container here.
"""

from __future__ import annotations

import os
import re
import resource
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import xmig
from xmig.agent.spare import READY_FD
from xmig.container import process, rootfs, runc
from xmig.container.bundle import Bind, ContainerSpec, container_env
from xmig.jobspec import JobSpec
from xmig.paths import job_folder, jobs_dir, local_images_root, park_dir

ENTRY = ("-m", "xmig.container.entry")  # runs the script as the container's init
PROBE_TIMEOUT_S = 120.0


class ContainerError(RuntimeError):
    """The job's containers cannot run here; the message is the line to say."""


def import_root() -> str:
    """The folder xmig's package is imported from (mounted into every container)."""
    return str(Path(xmig.__file__).resolve().parent.parent)


def job_prefix(job_id: str) -> str:
    """What every container ID of the job begins with."""
    return "xmig-" + re.sub(r"[^A-Za-z0-9_.-]", "_", job_id) + "-"


def job_binds(job: JobSpec) -> list[Bind]:
    """The host paths a job's containers see at the same place: the project and xmig's code
    read-only, what the workers write (the job's folder, checkpoints, traces, the images
    and rejoin files of a move, the parking folder) writable."""
    migrate = local_images_root() / "xmig-migrate" / job.job_id
    writable = [job_folder(job.job_id), migrate, park_dir()]
    if os.environ.get("XMIG_MIGRATE_DIR"):
        writable.append(Path(os.environ["XMIG_MIGRATE_DIR"]) / "xmig-migrate" / job.job_id)
    writable += [Path(p) for p in (job.checkpoint_dir, job.trace_dir) if p]
    for folder in writable:
        folder.mkdir(parents=True, exist_ok=True)
    read_only = [Path(import_root()), Path(job.cwd), Path(job.script_path).parent]
    if job.resume:
        read_only.append(Path(job.resume))
    # the host's name resolves inside as outside (gloo binds to the address it resolves to)
    read_only += [Path(p) for p in ("/etc/hosts", "/etc/resolv.conf") if os.path.isfile(p)]
    asked = [Bind(m.removesuffix(":ro"), writable=not m.endswith(":ro"))
             for m in job.container_mounts]  # fmt: skip
    return ([Bind(str(p)) for p in read_only] + asked
            + [Bind(str(p), writable=True) for p in writable if str(p) != "/dev/shm"])  # fmt: skip


class NodeContainers:
    """Builds and starts one node's containers; the agent keeps the processes."""

    def __init__(self, job: JobSpec, node_rank: int) -> None:
        assert job.container is not None
        self.job = job
        self.node_rank = node_rank
        self.python = rootfs.find_python(job.container)
        self.prefix = job_prefix(job.job_id)
        self.folder = job_folder(job.job_id) / "containers"
        self.binds = tuple(job_binds(job))
        self._count = 0
        self.held: set[str] = set()  # the containers this node started or restored

    @staticmethod
    def env(environ: Mapping[str, str]) -> dict[str, str]:
        """A process's environment (as the agent would start it bare) for inside."""
        env = container_env(environ, import_root())
        env.update({"XMIG_JOBS_DIR": str(jobs_dir()), "XMIG_PARK_DIR": str(park_dir())})
        return env

    def _spec(self, args: Sequence[str], environ: Mapping[str, str]) -> ContainerSpec:
        env = self.env(environ)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert self.job.container is not None
        return ContainerSpec(rootfs=str(Path(self.job.container).resolve()),
                             args=(self.python, *args), env=env, cwd=self.job.cwd,
                             netns=f"/proc/{os.getpid()}/ns/net", binds=self.binds,
                             nofile=(soft, hard), hostname=socket.gethostname())  # fmt: skip

    def _new_id(self, what: str) -> str:
        self._count += 1
        return f"{self.prefix}n{self.node_rank}-{what}-{self._count}"

    def start_worker(self, rank: int, attempt: int,
                     environ: dict[str, str]) -> process.ContainerProcess:  # fmt: skip
        """Rank ``rank``'s worker (its ``attempt``-th process) in a container of its own."""
        container_id = self._new_id(f"r{rank}a{attempt}")
        spec = self._spec([*ENTRY, self.job.script, *self.job.args], environ)
        self.held.add(container_id)
        return process.start(container_id, spec, self.folder / container_id)

    def start_spare(self, command: Sequence[str], environ: dict[str, str],
                    ready_fd: int) -> process.ContainerProcess:  # fmt: skip
        """A hot spare's interpreter (``command``'s arguments after the Python) in a
        container; its ready pipe becomes its fd 3."""
        container_id = self._new_id("spare")
        environ = {**environ, READY_FD: "3"}
        spec = self._spec(list(command[1:]), environ)
        self.held.add(container_id)
        return process.start(container_id, spec, self.folder / container_id, stdin=True,
                             extra_fds=(ready_fd,))  # fmt: skip

    def restore(self, container_id: str,
                images: str) -> tuple[process.ContainerProcess, float]:  # fmt: skip
        """The container checkpointed into ``images`` restored here, under its own ID (its
        process keeps its memory, environment included: the config gives its mounts and this
        node's network namespace)."""
        spec = self._spec([*ENTRY, self.job.script], {})
        self.held.add(container_id)
        return process.restore(container_id, spec, self.folder / f"{container_id}.restored",
                               images)  # fmt: skip

    def moved_away(self, container_id: str) -> None:
        """The container was checkpointed: another node holds it now."""
        self.held.discard(container_id)

    def remove_all(self) -> list[str]:
        """Remove what is left of the containers this node holds (as the agent ends)."""
        left = sorted(self.held & set(process.remove_all(self.prefix, only=self.held)))
        self.held.clear()
        return left


def check_can_run(job: JobSpec) -> str:
    """Before anything starts: root, runc, a rootfs with a Python, and a container of it that
    imports xmig's worker side; the Python it found. ContainerError with one line."""
    assert job.container is not None
    if os.geteuid() != 0:
        raise ContainerError("--container needs root (runc, and CRIU to move a container)")
    try:
        runc.require_runc()
        python = rootfs.find_python(job.container)
    except (runc.RuncError, rootfs.RootfsError) as exc:
        raise ContainerError(str(exc)) from None
    for mount in job.container_mounts:
        if not os.path.exists(mount.removesuffix(":ro")):
            raise ContainerError(f"--container-mount {mount}: no such file or folder")
    containers = NodeContainers(job, node_rank=0)
    container_id = f"{containers.prefix}probe-{os.getpid()}"
    spec = containers._spec(["-c", "import xmig.session"], dict(os.environ))
    folder = containers.folder / container_id
    try:
        code, output = process.run_to_end(container_id, spec, folder, PROBE_TIMEOUT_S)
    except runc.RuncError as exc:
        raise ContainerError(f"--container {job.container}: {exc}") from None
    if code != 0:
        said = [line.strip() for line in output.strip().splitlines() if line.strip()]
        why = f": {said[-1]}" if said else ""
        raise ContainerError(f"--container {job.container}: {python} in the rootfs cannot "
                             f"import xmig's worker side (exit {code}{why}); the rootfs "
                             "needs xmig's dependencies, as scripts/make-rootfs.sh installs "
                             "them")  # fmt: skip
    return python
