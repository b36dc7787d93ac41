"""The worker-side entry: ``xmig.init()`` and the step boundary ``session.steps()``."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from xmig.agent.link import AgentLink
from xmig.ccl import BACKENDS, Communicator
from xmig.faults import FaultSpec, Injector
from xmig.jobenv import WorkerEnv
from xmig.proxy import ProxyProcessGroup
from xmig.state import params_sha256, reseed

BACKEND_NAME = "xmig"
DEFAULT_TIMEOUT = timedelta(minutes=30)


class XmigError(RuntimeError):
    """A misuse of xmig's worker API, with what to do about it."""


class Session:
    """One worker's handle on the job: its process group, its registered state, its steps."""

    def __init__(self, env: WorkerEnv, seed: int, backend: str, timeout: timedelta) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.seed = seed
        self.backend = backend
        self.step: int | None = None
        self.completed_steps = 0
        self.objects: dict[str, Any] = {}
        self._hooks: list[Any] = []
        self.link: AgentLink | None = None
        self.injector = Injector(env.rank, announce=self._announce)
        for fault in env.faults:
            self.injector.add(fault)
        if env.managed:
            self.link = AgentLink(env, on_inject=self.injector.add)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self.proxy = self._init_process_group(timeout)
        self.process_group: dist.ProcessGroup = dist.group.WORLD
        atexit.register(self.close)

    @property
    def device(self) -> torch.device:
        """This rank's device: its local GPU under NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _announce(self, spec: FaultSpec) -> None:
        if self.link is not None:
            self.link.announce_fault(spec)
        print(f"xmig: rank {self.rank} injecting fault {spec}", file=sys.stderr, flush=True)

    def _init_process_group(self, timeout: timedelta) -> ProxyProcessGroup:
        if dist.is_initialized():
            raise XmigError(
                "torch.distributed is already initialized: call xmig.init() instead of "
                "dist.init_process_group(), it sets up the process group itself"
            )
        _register_backend(self.backend)
        created: list[ProxyProcessGroup] = []

        def create(store: dist.Store, rank: int, size: int, pg_timeout: timedelta) -> Any:
            communicator = Communicator(self.backend, "world", 0, store, rank, size, pg_timeout)
            proxy = ProxyProcessGroup(communicator, before_op=self.injector.at_collective)
            created.append(proxy)
            return proxy

        global _create_group
        _create_group = create
        if self.env.managed:
            # the coordinator hosts the job's store; every rank is a client of it
            store = dist.TCPStore(
                self.env.master_addr, self.env.master_port, is_master=False, timeout=timeout
            )
            dist.init_process_group(
                BACKEND_NAME,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        elif self.env.master_port:
            dist.init_process_group(
                BACKEND_NAME, rank=self.rank, world_size=self.world_size, timeout=timeout
            )
        else:
            if self.world_size != 1:
                raise XmigError("WORLD_SIZE > 1 but MASTER_PORT is not set: start with xmig run")
            dist.init_process_group(
                BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        return created[0]

    def register(self, **objects: Any) -> None:
        """Hand xmig the job's state: ``model=`` (hashed at the end), ``optimizer=``, and any
        other object with ``state_dict``/``load_state_dict`` (an LR scheduler, a data loader)."""
        for name, obj in objects.items():
            if name == "model" and not isinstance(obj, torch.nn.Module):
                raise XmigError(f"model= must be a torch.nn.Module, got {type(obj).__name__}")
            if name != "model" and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            ):
                raise XmigError(f"{name}= needs state_dict() and load_state_dict()")
            self.objects[name] = obj

    def _model(self) -> torch.nn.Module | None:
        model = self.objects.get("model")
        # hash and hook the user's module, not a DDP wrapper around it
        return getattr(model, "module", model) if model is not None else None

    def _install_fault_hooks(self) -> None:
        pending = self.injector.pending
        needs = {spec.at for spec in pending}
        model = self._model()
        optimizer = self.objects.get("optimizer")
        for point in ("forward", "backward"):
            if point in needs and model is None:
                spec = next(s for s in pending if s.at == point)
                raise XmigError(f"fault {spec} needs the model: call session.register(model=...)")
        if "optimizer" in needs and optimizer is None:
            spec = next(s for s in pending if s.at == "optimizer")
            raise XmigError(
                f"fault {spec} needs the optimizer: call session.register(optimizer=...)"
            )
        if model is not None:
            self._hooks.append(
                model.register_forward_pre_hook(
                    lambda _m, _a: self.injector.at_point(self.step, "forward")
                )
            )
            trainable = [p for p in model.parameters() if p.requires_grad]
            if trainable:
                middle = trainable[len(trainable) // 2]
                self._hooks.append(
                    middle.register_post_accumulate_grad_hook(
                        lambda _p: self.injector.at_point(self.step, "backward")
                    )
                )
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            self._hooks.append(
                optimizer.register_step_pre_hook(
                    lambda _o, _a, _k: self.injector.at_point(self.step, "optimizer")
                )
            )

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers ``start … total-1``; each boundary reseeds RNGs from
        (seed, rank, step), reports progress to the agent and fires due faults."""
        if total < 0 or start < 0 or start > total:
            raise XmigError(f"bad step range: start={start}, total={total}")
        self._install_fault_hooks()
        try:
            for step in range(start, total):
                self.step = step
                reseed(self.seed, self.rank, step)
                self.proxy.begin_step(step)
                if self.link is not None:
                    self.link.report_step(step)
                self.injector.at_point(step, "boundary")
                yield step
                self.completed_steps = step + 1
            self.injector.at_point(total, "boundary")
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
        self._finish(total)

    def params_sha256(self) -> str | None:
        """The fingerprint of the registered model's parameters, or None without a model."""
        model = self._model()
        return params_sha256(model) if model is not None else None

    def _finish(self, total: int) -> None:
        fingerprint = self.params_sha256() if self.rank == 0 else None
        unfired = self.injector.pending
        if unfired:
            names = ", ".join(str(s) for s in unfired)
            print(f"xmig: rank {self.rank}: faults never reached: {names}", file=sys.stderr)
        if self.link is not None:
            self.link.report_done(total, fingerprint)

    def _excepthook(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        if self.link is not None and not isinstance(exc, KeyboardInterrupt):
            self.link.report_error(exc)
        self._previous_excepthook(exc_type, exc, tb)

    def close(self) -> None:
        """Leave the job cleanly (called at exit)."""
        if self.link is not None:
            self.link.close()
            self.link = None
        if dist.is_initialized():
            dist.destroy_process_group()


_session: Session | None = None
_create_group: Any = None


def _create_from_session(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    return _create_group(store, rank, size, timeout)


def _register_backend(backend: str) -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        devices = ["cuda"] if backend == "nccl" else ["cpu"]
        dist.Backend.register_backend(BACKEND_NAME, _create_from_session, devices=devices)


def init(
    seed: int = 0, backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT
) -> Session:
    """Join the job: connect to the agent, start the heartbeat, set up the process group.

    ``backend`` is the real communication library behind xmig's process group: ``nccl`` when
    CUDA is available, else ``gloo``. Outside ``xmig run`` (no agent) the session still works,
    with no fault handling, so the same script runs under torchrun or alone.
    """
    global _session
    if _session is not None:
        raise XmigError("xmig.init() was already called in this process")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise XmigError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    _session = Session(WorkerEnv.from_environ(), seed, backend, timeout)
    return _session
