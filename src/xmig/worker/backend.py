"""The ``xmig`` c10d backend: every process group is a proxy over the generation's real
communicator, met through the job's store."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from xmig.ccl import Communicator, store_namespace
from xmig.jobenv import WorkerEnv
from xmig.proxy import ProxyProcessGroup
from xmig.worker.errors import XmigError
from xmig.worker.groups import install_split_group

BACKEND_NAME = "xmig"
# NCCL errors and timeouts must come back to the proxy, not end the process from torch's
# watchdog; read by ProcessGroupNCCL when a communicator is created
NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}

# (c10d's name of the group, its members' global ranks or None for the default group, this
# rank's rank in it, its size) -> the group's proxy
GroupFactory = Callable[[str, list[int] | None, int, int], ProxyProcessGroup]


def device_of(backend: str, local_rank: int) -> torch.device:
    """A rank's device: its local GPU under NCCL, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


class Comms:
    """The job's c10d store and the communicators this rank builds through it."""

    def __init__(self, env: WorkerEnv, backend: str, timeout: timedelta) -> None:
        self.env = env
        self.backend = backend
        self.timeout = timeout
        self.store: dist.Store | None = None

    def job_store(self) -> dist.Store:
        """A client of the job's store (the coordinator hosts it), under the job's own
        unpredictable key prefix."""
        assert self.env.token is not None
        client = dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=False,
                               timeout=self.timeout)  # fmt: skip
        return dist.PrefixStore(store_namespace(self.env.token), client)

    def reconnect(self, env: WorkerEnv) -> None:
        """After a move: the store's connection came back closed; a new one, from here."""
        self.env = env
        self.store = self.job_store()

    def communicator(self, group: str, generation: int, rank: int, size: int,
                     store: dist.Store | None = None) -> Communicator:  # fmt: skip
        """``store``: a client of the job's store for this communicator alone. A thread that
        builds one while another thread builds another needs its own: a store client
        serves one request at a time, and gloo's meeting waits inside one until the peers
        are there (one that waits for a peer that waits for the other thread never ends)."""
        store = store if store is not None else self.store
        assert store is not None
        where = f"the job's c10d store at {self.env.master_addr}:{self.env.master_port}"
        return Communicator(self.backend, group, generation, store, rank, size,
                            self.timeout, where=where)  # fmt: skip


def init_process_group(comms: Comms, make_group: GroupFactory) -> ProxyProcessGroup:
    """Create the default process group, an ``xmig`` group whose backend is the proxy
    ``make_group`` builds; every group the script makes later with the ``xmig`` backend
    (``new_group``, a ``DeviceMesh``) gets its proxy the same way."""
    env = comms.env
    if dist.is_initialized():
        raise XmigError(
            "torch.distributed is already initialized: call xmig.init() instead of "
            "dist.init_process_group(), it sets up the process group itself"
        )
    if comms.backend == "nccl":
        for name, value in NCCL_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
    _register_backend(comms.backend)
    created: list[ProxyProcessGroup] = []
    raw_store = comms.job_store() if env.managed else None

    def create(options: Any, _backend_options: Any) -> Any:
        if not created:
            # c10d hands a store with a prefix of its own choosing; xmig's communicators use
            # the job's store directly, so a process that reconnects (after a migration)
            # finds their keys with a store client of its own
            comms.store = raw_store if raw_store is not None else options.store
            proxy = make_group(str(options.group_id), None, options.group_rank,
                               options.group_size)  # fmt: skip
            created.append(proxy)
            return proxy
        ranks = [int(r) for r in options.global_ranks_in_group]
        return make_group(str(options.group_id), ranks, options.group_rank, options.group_size)

    global _create_group
    _create_group = create
    if raw_store is not None:
        dist.init_process_group(BACKEND_NAME, store=raw_store, rank=env.rank,
                                world_size=env.world_size, timeout=comms.timeout)  # fmt: skip
    elif env.master_port:
        dist.init_process_group(BACKEND_NAME, rank=env.rank, world_size=env.world_size,
                                timeout=comms.timeout)  # fmt: skip
    else:
        if env.world_size != 1:
            raise XmigError("WORLD_SIZE > 1 but MASTER_PORT is not set: start with xmig run")
        dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=comms.timeout)  # fmt: skip
    install_split_group()
    if comms.backend == "nccl":
        torch.cuda.set_device(device_of(comms.backend, env.local_rank))
    return created[0]


# c10d keeps the creator it was registered with; this one hands over to the current process
# group's (one per process: xmig.init() runs once)
_create_group: Callable[..., Any] | None = None


def _create_from_session(options: Any, backend_options: Any) -> Any:
    assert _create_group is not None
    return _create_group(options, backend_options)


def _register_backend(backend: str) -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        devices = ["cuda"] if backend == "nccl" else ["cpu"]
        # the extended API: a group's creator learns its name and its members' global ranks
        dist.Backend.register_backend(BACKEND_NAME, _create_from_session, extended_api=True,
                                      devices=devices)  # fmt: skip
