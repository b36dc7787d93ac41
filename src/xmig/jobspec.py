"""The job's spec: what ``xmig run`` was asked to run, and every default of it.

One frozen value, validated once when it is made, shared by every process of a job: the
launcher builds it from the command line, the coordinator gets it as JSON on its stdin, each
agent from the coordinator (``agent_hello``'s reply), each worker through the environment its
agent builds from it (``xmig.jobenv.WorkerEnv.for_rank``). Nothing changes it in place: a
changed spec is a new one (``dataclasses.replace``, which validates it again).

The defaults below are the only ones: the command line's options, the worker's environment and
the agent read them from here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xmig.faults.spec import FaultSpec

DEFAULT_NNODES = 1
DEFAULT_NPROC_PER_NODE = 1
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 0  # 0: the coordinator picks a free port
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
DEFAULT_STOP_GRACE_S = 3.0
DEFAULT_AGENT_CONNECT_TIMEOUT_S = 60.0
# hosts started each by its own launcher come up when their scheduler starts them (a pod's
# image pulled, a Slurm step started): torchrun waits as long for its rendezvous
DEFAULT_HOST_JOIN_TIMEOUT_S = 600.0
DEFAULT_KEEP_LOG = True
# off: a fault behind an update queued at a shut gate still hangs its recovery on the GPU
DEFAULT_GPU_GATE = False
DEFAULT_RECOVERY_TIMEOUT_S = 120.0
DEFAULT_MAX_RECOVERIES = 10
DEFAULT_HOT_SPARES = 1
DEFAULT_SPARE_NODES = 0
DEFAULT_SIMULATE_HOSTS = False
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_COORDINATOR_RESTARTS = 3
# how long agents try to reach a coordinator that went away, and a restarted one waits for
# them: its start (an interpreter, torch for the store) takes seconds on a loaded host
DEFAULT_REJOIN_TIMEOUT_S = 30.0
DEFAULT_STRICT = False

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""The levels ``--log-level`` takes, most detailed first."""

MAX_PORT = 65535

# in the JSON form beside the fields: derived, so ignored when read back
_DERIVED = ("world_size",)


class JobSpecError(ValueError):
    """A job spec that cannot run; the message names the ``xmig run`` option at fault."""


@dataclass(frozen=True)
class JobSpec:
    """Everything the coordinator, the agents and the workers need to run a job.

    ``args`` and ``faults`` are tuples (``faults``: the ``FaultSpec.to_json()`` dicts of the
    faults to inject); lists given for them are made tuples.
    """

    job_id: str
    script: str
    args: tuple[str, ...]
    cwd: str
    nnodes: int = DEFAULT_NNODES
    nproc_per_node: int = DEFAULT_NPROC_PER_NODE
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    faults: tuple[dict[str, Any], ...] = ()
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    stop_grace: float = DEFAULT_STOP_GRACE_S
    agent_connect_timeout: float = DEFAULT_AGENT_CONNECT_TIMEOUT_S
    keep_log: bool = DEFAULT_KEEP_LOG
    # on GPUs, a bucket all-reduce's result is handed over at once behind a gate on the GPU
    # that opens there once it has ended (``xmig.proxy.gate``) instead of once the host has
    # seen it end
    gpu_gate: bool = DEFAULT_GPU_GATE
    recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT_S
    max_recoveries: int = DEFAULT_MAX_RECOVERIES
    hot_spares: int = DEFAULT_HOT_SPARES
    spare_nodes: int = DEFAULT_SPARE_NODES
    # a lost node whose ranks have no spare node: "stop" (the state saved) or "shrink" (go
    # on without its ranks, down to ``min_world_size``)
    on_no_spare: str = "stop"
    min_world_size: int = 1
    simulate_hosts: bool = DEFAULT_SIMULATE_HOSTS
    log_level: str = DEFAULT_LOG_LEVEL
    strict: bool = DEFAULT_STRICT  # a recovery shown not to be bit-identical stops the job
    trace_dir: str | None = None  # where workers write what they issue (``xmig check``)
    # where a just-in-time checkpoint goes when a fault cannot be recovered (the launcher
    # sets the job's folder when none is asked for)
    checkpoint_dir: str | None = None
    resume: str | None = None  # the checkpoint this job resumes from
    # one launcher per host (``--rdzv-endpoint``): the coordinator's control port, and the
    # hosts' own launch each agent says it was given (compared with the coordinator's)
    multi_host: bool = False
    coord_port: int = 0
    # a coordinator that dies is started again by its launcher, this many times a job
    coordinator_restarts: int = DEFAULT_COORDINATOR_RESTARTS
    rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT_S
    # the HA control plane: the etcd cluster that says who leads and keeps the job's
    # snapshot, and how many coordinators campaign for the lead (one leads, the others wait)
    control_plane: str | None = None
    coordinators: int = 1
    # container mode: every worker (and hot spare) in a runc container of this root filesystem,
    # with more host folders mounted at their paths (``PATH``, writable, or ``PATH:ro``)
    container: str | None = None
    container_mounts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # frozen: the one place that may still set a field
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "container_mounts", tuple(self.container_mounts))
        self._validate()

    def _validate(self) -> None:
        """The checks ``xmig run`` makes of its options, in the order it makes them."""
        if self.nnodes < 1:
            raise JobSpecError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nproc_per_node < 1:
            raise JobSpecError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if not 0 <= self.master_port <= MAX_PORT:
            raise JobSpecError(f"--master-port must be 0..{MAX_PORT}, got {self.master_port}")
        if not 0 <= self.coord_port <= MAX_PORT:
            raise JobSpecError(f"--rdzv-endpoint's port must be 0..{MAX_PORT}, got "
                               f"{self.coord_port}")  # fmt: skip
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise JobSpecError("need 0 < --heartbeat-interval < --heartbeat-timeout")
        if self.stop_grace < 0:
            raise JobSpecError("--stop-grace must not be negative")
        if self.recovery_timeout <= 0:
            raise JobSpecError("--recovery-timeout must be positive")
        if self.max_recoveries < 0:
            raise JobSpecError("--max-recoveries must not be negative")
        if self.on_no_spare not in ("stop", "shrink"):
            raise JobSpecError(f"--on-no-spare must be stop or shrink, got {self.on_no_spare!r}")
        if not 1 <= self.min_world_size <= self.nnodes * self.nproc_per_node:
            raise JobSpecError(
                f"--min-world-size must be 1..{self.nnodes * self.nproc_per_node} "
                f"(the world size), got {self.min_world_size}"
            )
        if self.coordinator_restarts < 0:
            raise JobSpecError("--coordinator-restarts must not be negative")
        if self.rejoin_timeout <= 0:
            raise JobSpecError("--rejoin-timeout must be positive")
        if self.coordinators < 1 or (self.coordinators > 1 and self.control_plane is None):
            raise JobSpecError("--coordinators N needs N >= 1, and --control-plane for more "
                               "than one")  # fmt: skip
        if self.hot_spares < 0:
            raise JobSpecError("--hot-spares must not be negative")
        if self.spare_nodes < 0:
            raise JobSpecError("--spare-nodes must not be negative")
        if self.agent_connect_timeout <= 0:
            raise JobSpecError("the agents' connect timeout must be positive")
        if self.log_level not in LOG_LEVELS:
            raise JobSpecError(
                f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        for data in self.faults:
            self._check_fault(data)
        if self.container_mounts and self.container is None:
            raise JobSpecError("--container-mount goes with --container")
        for mount in self.container_mounts:
            path = mount.removesuffix(":ro")
            if not os.path.isabs(path) or os.path.normpath(path) == "/":
                raise JobSpecError(f"--container-mount {mount}: an absolute path other than /, "
                                   "optionally followed by :ro")  # fmt: skip

    def _check_fault(self, data: dict[str, Any]) -> None:
        try:
            fault = FaultSpec.from_json(data)
        except TypeError as exc:
            raise JobSpecError(f"bad --inject: not a fault: {data!r} ({exc})") from None
        if fault.rank >= self.world_size:
            raise JobSpecError(
                f"bad --inject: rank {fault.rank} does not exist in {str(fault)!r} "
                f"(world size {self.world_size})"
            )
        if fault.to is not None and fault.to >= self.all_nodes:
            raise JobSpecError(
                f"bad --inject: node {fault.to} does not exist in {fault} "
                f"(nodes 0..{self.all_nodes - 1})"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def script_path(self) -> str:
        """The script as an absolute path (what a checkpoint records and a resume compares)."""
        return os.path.abspath(os.path.join(self.cwd, self.script))

    @property
    def all_nodes(self) -> int:
        """Nodes with workers plus the spare ones."""
        return self.nnodes + self.spare_nodes

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["args"] = list(self.args)
        data["faults"] = [dict(f) for f in self.faults]
        data["world_size"] = self.world_size
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobSpec:
        """The spec ``to_json`` wrote; JobSpecError for unknown or missing fields."""
        data = {k: v for k, v in data.items() if k not in _DERIVED}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise JobSpecError(f"unknown job spec field(s): {', '.join(unknown)}")
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise JobSpecError(f"missing job spec field(s): {', '.join(missing)}")
        return cls(**data)


# what every host's command line must agree on: the computation (a host whose script or
# arguments differ would train something else, silently) and the world's shape
HOST_LAUNCH_FIELDS = ("script_sha256", "args", "nproc_per_node", "nnodes", "spare_nodes",
                      "keep_log", "faults", "resume")  # fmt: skip


@dataclass(frozen=True)
class HostLaunch:
    """What one host's launcher was given: its agent says it in its hello, the coordinator
    compares it with its own (``differences``), and the agent runs the script from its own
    path and folder (hosts need not mount the job at the same place)."""

    script: str
    script_sha256: str
    args: tuple[str, ...]
    cwd: str
    nproc_per_node: int
    nnodes: int
    spare_nodes: int
    keep_log: bool
    faults: tuple[dict[str, Any], ...]
    resume: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "faults", tuple(dict(f) for f in self.faults))

    @classmethod
    def of(cls, spec: JobSpec) -> HostLaunch:
        """This host's launch, from its spec (the script hashed here)."""
        import hashlib

        try:
            with open(spec.script_path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            raise JobSpecError(f"cannot read the script {spec.script_path}: {exc}") from None
        return cls(script=spec.script_path, script_sha256=digest, args=spec.args, cwd=spec.cwd,
                   nproc_per_node=spec.nproc_per_node, nnodes=spec.nnodes,
                   spare_nodes=spec.spare_nodes, keep_log=spec.keep_log, faults=spec.faults,
                   resume=spec.resume)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["args"], data["faults"] = list(self.args), [dict(f) for f in self.faults]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostLaunch:
        """The launch ``to_json`` wrote; JobSpecError for anything else."""
        try:
            return cls(**data)
        except TypeError as exc:
            raise JobSpecError(f"not a host's launch: {exc}") from None

    def differences(self, other: HostLaunch) -> list[str]:
        """What of ``other`` (another host's) differs from this one, as ``name: A vs B``."""
        found = []
        for name in HOST_LAUNCH_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                if name == "script_sha256":
                    found.append(f"the script's content ({Path(other.script).name}: sha256 "
                                 f"{theirs[:12]}… vs {mine[:12]}…)")  # fmt: skip
                else:
                    found.append(f"{name.replace('_', '-')}: {_short(theirs)} vs {_short(mine)}")
        return found


def _short(value: Any) -> str:
    text = repr(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= 80 else text[:77] + "..."
