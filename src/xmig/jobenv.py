"""The environment an agent hands to each worker: torchrun's variables plus xmig's own."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xmig.faults.spec import PLANNED, FaultSpec
from xmig.jobspec import (
    DEFAULT_GPU_GATE,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_KEEP_LOG,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_RECOVERY_TIMEOUT_S,
    DEFAULT_STRICT,
    JobSpec,
)

JOB_ID = "XMIG_JOB_ID"
TOKEN = "XMIG_TOKEN"
AGENT_ADDR = "XMIG_AGENT_ADDR"
COORD_ADDR = "XMIG_COORD_ADDR"
NODE_RANK = "XMIG_NODE_RANK"
HEARTBEAT_INTERVAL = "XMIG_HEARTBEAT_INTERVAL"
INJECT = "XMIG_INJECT"
ATTEMPT = "XMIG_ATTEMPT"
GENERATION = "XMIG_GENERATION"
KEEP_LOG = "XMIG_KEEP_LOG"
GPU_GATE = "XMIG_GPU_GATE"
RECOVERY_TIMEOUT = "XMIG_RECOVERY_TIMEOUT"
LOG_LEVEL = "XMIG_LOG_LEVEL"
STRICT = "XMIG_STRICT"
TRACE_DIR = "XMIG_TRACE_DIR"
RESUME = "XMIG_RESUME"
# how a planned pause closes its healthy NCCL communicators: "shutdown" (default) or "abort"
PAUSE_CLOSE = "XMIG_PAUSE_CLOSE"
# "0": closing an NCCL communicator does not wake NCCL's socket service thread (``ccl.wake``,
# on by default: a close then takes 0.02-0.03 s instead of up to 0.5 s)
NCCL_WAKE = "XMIG_NCCL_WAKE"
# where a GPU's replay log copies the bucket all-reduces' inputs (``log_route_for`` below):
# "inline" (the framework's stream, device memory), "host" (pinned host memory, the log's own
# stream) or "auto" (the default: "host" with the GPU gate, else "inline")
LOG_ROUTE = "XMIG_LOG_ROUTE"
# a host's own launch (``xmig.jobspec.HostLaunch`` JSON), from its launcher to its agent
HOST_LAUNCH = "XMIG_HOST_LAUNCH"
COORD_RESTART = "XMIG_COORD_RESTART"  # a coordinator started again: how many ran before
# (HA control plane) when this host's launcher started the run (wall time): an ended job's
# outcome in etcd is this run's if it ended later, an earlier run's under the same id if not
LAUNCHED_AT = "XMIG_LAUNCHED_AT"
JOIN_REFUSED_EXIT_CODE = 3  # an agent the job did not take (its line says why)

# where a GPU's replay log copies the bucket all-reduces' inputs (``XMIG_LOG_ROUTE``)
LOG_ROUTES = ("inline", "host")


def log_route_for(asked: str | None, gate: bool) -> str:
    """The route of a GPU's replay-log copies: the one asked for (``XMIG_LOG_ROUTE``; unset
    or "auto": the default), by default "host" behind the GPU gate, where it was measured
    faster, and "inline" without it."""
    route = (asked or "auto").strip().lower()
    if route == "auto":
        return "host" if gate else "inline"
    if route not in LOG_ROUTES:
        raise ValueError(f"{LOG_ROUTE}={asked!r}: expected auto, {', '.join(LOG_ROUTES)}")
    return route


ROLE_NAME = "default"  # torchrun's one role


@dataclass
class WorkerEnv:
    """What a worker learns from its environment."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    token: str | None = None
    agent_addr: str | None = None
    node_rank: int = 0
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S
    attempt: int = 0
    generation: int = 0
    keep_log: bool = DEFAULT_KEEP_LOG
    gpu_gate: bool = DEFAULT_GPU_GATE
    recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT_S
    log_level: str = DEFAULT_LOG_LEVEL
    strict: bool = DEFAULT_STRICT
    trace_dir: str | None = None
    resume: str | None = None  # the checkpoint a rank of a resumed job starts from
    faults: list[FaultSpec] = field(default_factory=list)
    # job-wide numbers torchrun also hands its workers; left out of the environment when unknown
    nnodes: int | None = None
    local_world_size: int | None = None
    # torchrun's restarts of the whole worker group, which xmig never does: a fault stops a
    # script without xmig, and an xmig script's ranks are replaced one by one instead
    max_restarts: int = 0

    @classmethod
    def for_rank(
        cls,
        spec: JobSpec,
        rank: int,
        local_rank: int,
        *,
        node_rank: int,
        token: str | None = None,
        agent_addr: str | None = None,
        attempt: int = 0,
        generation: int = 0,
        fired: Iterable[dict] = (),
        world_size: int | None = None,
        launched_as: int | None = None,
    ) -> WorkerEnv:
        """The environment of ``rank``'s worker in the job ``spec`` describes, in a world of
        ``world_size`` ranks (None: the launch's): the faults to inject into it are the
        spec's for the rank it was launched as (``launched_as``, None: ``rank``; -1: none, a
        rank a resize added), less those already carried out (``fired``) and planned events
        (the coordinator carries those out)."""
        fired = list(fired)
        named = rank if launched_as is None else launched_as
        faults = [FaultSpec.from_json(f) for f in spec.faults if f["rank"] == named
                  and f not in fired and f["kind"] not in PLANNED]  # fmt: skip
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size or spec.world_size,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            job_id=spec.job_id,
            token=token,
            agent_addr=agent_addr,
            node_rank=node_rank,
            heartbeat_interval=spec.heartbeat_interval,
            attempt=attempt,
            generation=generation,
            keep_log=spec.keep_log,
            gpu_gate=spec.gpu_gate,
            recovery_timeout=spec.recovery_timeout,
            log_level=spec.log_level,
            strict=spec.strict,
            trace_dir=spec.trace_dir,
            # the first process of each rank; a later one replaces a rank that failed after
            # the resume, and pulls its state from a peer like any replacement
            resume=spec.resume if attempt == 0 else None,
            faults=faults,
            nnodes=spec.nnodes,
            local_world_size=spec.nproc_per_node,
        )

    @property
    def replacement(self) -> bool:
        """True for a process started to replace a failed rank (it joins a later generation)."""
        return self.attempt > 0

    @property
    def managed(self) -> bool:
        """True when an xmig agent started this worker."""
        return self.agent_addr is not None

    def to_environ(self) -> dict[str, str]:
        """torchrun's variables (so a script written for torchrun runs unchanged) and xmig's."""
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            NODE_RANK: str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "ROLE_NAME": ROLE_NAME,
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            # every rank is a client of the store the coordinator hosts on MASTER_PORT: with
            # this, env:// in dist.init_process_group() does not try to host it on rank 0
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            HEARTBEAT_INTERVAL: str(self.heartbeat_interval),
            ATTEMPT: str(self.attempt),
            GENERATION: str(self.generation),
            KEEP_LOG: "1" if self.keep_log else "0",
            GPU_GATE: "1" if self.gpu_gate else "0",
            RECOVERY_TIMEOUT: str(self.recovery_timeout),
            LOG_LEVEL: self.log_level,
            STRICT: "1" if self.strict else "0",
            INJECT: json.dumps([f.to_json() for f in self.faults]),
        }
        if self.nnodes is not None:
            env["GROUP_WORLD_SIZE"] = str(self.nnodes)
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.job_id:
            env[JOB_ID] = self.job_id
            env["TORCHELASTIC_RUN_ID"] = self.job_id
        if self.token:
            env[TOKEN] = self.token
        if self.agent_addr:
            env[AGENT_ADDR] = self.agent_addr
        if self.trace_dir:
            env[TRACE_DIR] = self.trace_dir
        if self.resume:
            env[RESUME] = self.resume
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        faults = [FaultSpec.from_json(f) for f in json.loads(env.get(INJECT, "[]"))]
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
            master_port=int(env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))),
            job_id=env.get(JOB_ID),
            token=env.get(TOKEN),
            agent_addr=env.get(AGENT_ADDR),
            node_rank=int(env.get(NODE_RANK, "0")),
            heartbeat_interval=float(env.get(HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_INTERVAL_S)),
            attempt=int(env.get(ATTEMPT, "0")),
            generation=int(env.get(GENERATION, "0")),
            keep_log=env.get(KEEP_LOG, "1" if DEFAULT_KEEP_LOG else "0") != "0",
            gpu_gate=env.get(GPU_GATE, "1" if DEFAULT_GPU_GATE else "0") != "0",
            recovery_timeout=float(env.get(RECOVERY_TIMEOUT, DEFAULT_RECOVERY_TIMEOUT_S)),
            log_level=env.get(LOG_LEVEL, DEFAULT_LOG_LEVEL),
            strict=env.get(STRICT, "1" if DEFAULT_STRICT else "0") == "1",
            trace_dir=env.get(TRACE_DIR) or None,
            resume=env.get(RESUME) or None,
            faults=faults,
            nnodes=_int_or_none(env.get("GROUP_WORLD_SIZE")),
            local_world_size=_int_or_none(env.get("LOCAL_WORLD_SIZE")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        )


def _int_or_none(text: str | None) -> int | None:
    return None if text is None else int(text)
