"""What the worker's parts share: its environment, process group, link, state and position."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch

from xmig import protocol
from xmig.agent.link import AgentLink
from xmig.faults import FaultSpec, Injector
from xmig.jobenv import WorkerEnv
from xmig.proxy import ProxyProcessGroup
from xmig.worker.backend import Comms, device_of
from xmig.worker.errors import exit_now
from xmig.worker.gates import QueuedUpdate
from xmig.worker.groups import Groups
from xmig.worker.orders import Orders
from xmig.worker.phase import Phase
from xmig.worker.registry import Registry
from xmig.worker.trace import Tracer

logger = logging.getLogger(__name__)

STATE_LOCK_TIMEOUT_S = 60.0
_UNKNOWN = object()


def dtensor_replicas(model: torch.nn.Module, rank: int) -> list[int] | None:
    """The ranks that hold the same parts of ``model``'s DTensor parameters as ``rank``
    (FSDP2, HSDP, tensor parallel): on each parameter's mesh, those whose coordinates equal
    this rank's along every dimension the parameter is not replicated over. None: no DTensor
    parameter."""
    members: set[int] | None = None
    for param in model.parameters():
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        grid = mesh.mesh
        where = (grid == rank).nonzero()
        if not len(where):
            continue
        mine = where[0].tolist()
        fixed = [d for d, p in enumerate(placements) if not p.is_replicate()]
        same = {int(grid[index]) for index in itertools.product(*map(range, grid.shape))
                if all(index[d] == mine[d] for d in fixed)}  # fmt: skip
        members = same if members is None else members & same
    return sorted(members) if members is not None else None


def dtensor_shard(model: torch.nn.Module, rank: int) -> str:
    """Which shard ``rank`` holds: its coordinates along the dimensions its first DTensor
    parameter is sharded over (``3``, or ``1,0`` on a mesh of several)."""
    for param in model.parameters():
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        where = (mesh.mesh == rank).nonzero()
        if len(where):
            mine = where[0].tolist()
            return ",".join(str(mine[d]) for d, p in enumerate(placements) if not p.is_replicate())
    return "?"


def _with_store(env: WorkerEnv, order: protocol.StoreRestarted) -> WorkerEnv:
    return dataclasses.replace(env, master_addr=order.master_addr, master_port=order.master_port)


class WorkerContext:
    """One worker's shared parts. The step loop writes the position (``step``,
    ``optimizer_stepped``...) under ``state_lock``; a recovery reads it under the same lock."""

    proxy: ProxyProcessGroup  # set once the process group exists
    orders: Orders  # set once the parts that handle them exist

    def __init__(self, env: WorkerEnv, seed: int, backend: str, timeout: timedelta) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.seed = seed
        self.backend = backend
        self.timeout = timeout
        self.device = device_of(backend, env.local_rank)
        self.comms = Comms(env, backend, timeout)
        self.registry = Registry()
        self.groups = Groups()  # every process group's proxy; ``proxy`` is the world's
        self.prologue_local = env.replacement  # a replacement's ops before it joins: local
        # the parts load and read the state through the Session (a script may wrap it)
        self.load_state: Callable[[dict[str, Any]], None] = self.registry.load_state
        self.state_dict: Callable[[], dict[str, Any]] = self.registry.state_dict
        self.phase = Phase()
        # held while the optimizer steps and while a recovery reads or replaces the state
        self.state_lock = threading.Lock()
        self.step: int | None = None
        self.first_step: int | None = None
        self.total: int | None = None
        self.completed_steps = 0
        self.optimizer_stepped = False
        self.optimizer_waiting = False
        # the step's optimizer update, queued on the GPU behind a shut gate (``gates``)
        self.queued_update: QueuedUpdate | None = None
        # a hook trims the communication logs once a step's forward is queued (``hooks``)
        self.trims_after_forward = False
        self.finished = False  # the loop is done: the rank stays to serve peers until released
        self.recoveries_started = 0
        self._replicas: list[int] | None | object = _UNKNOWN
        self.injector = Injector(env.rank, self._announce, current_step=lambda: self.step)
        for fault in env.faults:
            self.injector.add(fault)
        self.link: AgentLink | None = None
        self.tracer = (Tracer(env.trace_dir, env.rank, env.attempt, env.generation)
                       if env.trace_dir else None)  # fmt: skip

    @property
    def state_step(self) -> int | None:
        """The step whose start this rank's state is."""
        if self.step is None:
            return None
        return self.step + 1 if self.optimizer_stepped and not self.update_queued() else self.step

    def update_queued(self) -> bool:
        """Whether the step's optimizer update waits on the GPU behind a shut gate."""
        queued = self.queued_update
        return queued is not None and queued.pending()

    def recovery_state(self) -> dict[str, Any]:
        """The state a peer pulls or a checkpoint keeps: as of the start of ``state_step``."""
        queued = self.queued_update
        if queued is not None and queued.pending():
            return queued.state(self.state_dict())
        return self.state_dict()

    def replicas(self) -> list[int] | None:
        """The ranks whose registered state is this rank's, by construction: the ranks of the
        group its DDP trains over (None: every rank, or no replica known). Taken once the
        step loop begins and kept: inside a step FSDP2 swaps in unsharded parameters, whose
        meshes (a tensor-parallel one alone) no longer show the data-parallel replicas."""
        if self._replicas is not _UNKNOWN:
            return self._replicas  # type: ignore[return-value]
        return self._find_replicas()

    def keep_replicas(self) -> list[int] | None:
        """Take the replicas as they are now (parameters sharded: the step loop's start)."""
        self._replicas = self._find_replicas()
        return self._replicas

    def _find_replicas(self) -> list[int] | None:
        ddp = self.registry.ddp
        if ddp is None:
            model = self.registry.model()
            return dtensor_replicas(model, self.rank) if model is not None else None
        group = self.groups.of(getattr(ddp, "process_group", None))
        if group is None or len(group.ranks) == self.world_size:
            return None
        return list(group.ranks)

    def connect(self, env: WorkerEnv | None = None) -> None:
        """Connect to this node's agent (again, after a move: ``env`` says where)."""
        if env is not None:
            self.env = env
        self.link = AgentLink(self.env, on_inject=self.injector.add, on_order=self.orders.put)

    def store_restarted(self, order: protocol.StoreRestarted) -> None:
        """A restarted coordinator hosts the job's store anew: the next communicators are
        built through a connection to it (those built go on without the store)."""
        self.env = _with_store(self.env, order)
        self.comms.reconnect(_with_store(self.comms.env, order))
        logger.info("rank %d: reconnected to the job's store at %s:%d", self.rank,
                    order.master_addr, order.master_port)  # fmt: skip

    def send(self, msg: protocol.Message) -> None:
        """A report to the agent or the coordinator; nothing without an agent."""
        if self.link is not None:
            self.link.send(msg)

    def _announce(self, spec: FaultSpec) -> None:
        if self.link is not None:
            step = self.link.step
            self.link.ask(protocol.Injecting(fault=spec.to_json(), step=step, t=time.time()),
                          timeout=5.0)  # fmt: skip
        logger.info("rank %d injecting fault %s", self.rank, spec)

    def die(self, text: str) -> NoReturn:
        """Stop this worker: the coordinator hears why (and stops the job)."""
        logger.error("rank %d: %s", self.rank, text)
        self.send(protocol.RecoveryFailed(error=text, t=time.time()))
        time.sleep(0.2)
        exit_now(1)
