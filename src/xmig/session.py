"""The worker's API: ``xmig.init()`` and the ``Session`` it returns (register the state, run
the steps). What a worker does besides, to live through faults, is in ``xmig.worker``."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xmig import jobenv, logs, protocol
from xmig.ccl import BACKENDS
from xmig.jobenv import WorkerEnv
from xmig.proxy import ProxyProcessGroup, ReplayMismatch, wait_for_aborts, wait_let_go
from xmig.state import params_sha256
from xmig.wire import WireError
from xmig.worker import teardown
from xmig.worker.backend import init_process_group
from xmig.worker.context import WorkerContext
from xmig.worker.data import Batches
from xmig.worker.errors import RecoveryFailed, XmigError
from xmig.worker.groups import Group
from xmig.worker.hooks import OptimizerGate
from xmig.worker.layout import DdpLayout
from xmig.worker.loop import StepLoop
from xmig.worker.migration import Migration
from xmig.worker.orders import Orders
from xmig.worker.partition import BatchPolicy, GlobalPartition
from xmig.worker.phase import WorkerPhase
from xmig.worker.replacement import Replacement
from xmig.worker.resize import Resizer
from xmig.worker.shards import Shards
from xmig.worker.survivor import Survivor
from xmig.worker.trouble import is_sticky_cuda_error, on_trouble
from xmig.worker.verify import Verifier

DEFAULT_TIMEOUT = timedelta(minutes=30)
# NCCL's abort takes ~0.5 s (H200); the process waits that long for one at exit
ABORT_WAIT_S = 10.0

logger = logging.getLogger(__name__)


class Session:
    """One worker's handle on the job: its process group, its registered state, its steps."""

    def __init__(self, env: WorkerEnv, seed: int, backend: str, timeout: timedelta) -> None:
        self.local_rank = env.local_rank
        self.seed = seed
        self.backend = backend
        self.timeout = timeout
        self._ctx = ctx = WorkerContext(env, seed, backend, timeout)
        # the worker's parts read and load the state through these methods (a script or a
        # test may wrap them)
        ctx.state_dict = lambda: self.state_dict()
        ctx.load_state = lambda state: self.load_state(state)
        gate, layout, verifier = OptimizerGate(ctx), DdpLayout(ctx), Verifier(ctx)
        survivor = Survivor(ctx, layout, verifier, gate)
        migration = Migration(ctx)
        replacement = None
        if env.replacement:
            replacement = Replacement(ctx, layout, verifier)
        elif env.resume is not None:  # every rank of a resumed job starts from its shard
            replacement = Replacement(ctx, layout, verifier, checkpoint=Path(env.resume))
        self._replacement = replacement

        def on_save(order: protocol.SaveState) -> None:
            migration.give_back()  # a rank paused for its move has parked its tensors
            survivor.on_save(order)

        def on_park(order: protocol.Park) -> None:
            migration.give_back()  # (a fault ended the move: its state is saved from here)
            survivor.on_park(order)

        ctx.orders = Orders(ctx.rank, on_park=on_park, on_pause=migration.on_pause,
                            on_save=on_save, on_store=ctx.store_restarted,
                            on_prepare=migration.on_prepare)  # fmt: skip
        resizer = Resizer(ctx, layout, verifier, self._make_group, self._on_world)

        def on_resize(order: protocol.Resize) -> None:
            try:
                resizer.apply(order)
            except (RecoveryFailed, RuntimeError, ValueError) as exc:
                ctx.die(f"resize to {order.world_size} ranks failed: {type(exc).__name__}: {exc}")

        migration.why_not_resize, migration.on_resize = resizer.why_not, on_resize
        survivor.why_not_resize = resizer.why_not
        survivor.pause_at = migration.pause_at
        self._loop = StepLoop(ctx, gate, layout, verifier, survivor, migration, replacement)
        if env.managed:
            ctx.connect()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        ctx.proxy = init_process_group(ctx.comms, self._make_group)
        self.proxy: ProxyProcessGroup = ctx.proxy
        self.process_group: dist.ProcessGroup = dist.group.WORLD
        if ctx.link is not None:
            ctx.orders.start()
        if replacement is not None:
            replacement.start_receiving()
        if env.managed and teardown.wanted():  # after ``close``: atexit runs the last first
            atexit.register(teardown.quicken_exit)
        atexit.register(self.close)

    def _make_group(
        self, c10d_name: str, ranks: list[int] | None, group_rank: int, size: int
    ) -> ProxyProcessGroup:
        """A process group's proxy (``ranks`` None: the default group), over a communicator
        of the current generation: what a replacement makes, its survivors rebuilt in it."""
        ctx = self._ctx
        default = ranks is None
        gate = ctx.env.gpu_gate and ctx.device.type == "cuda"
        if gate and default and os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
            logger.warning("warning: --gpu-gate with CUDA_MODULE_LOADING=%s: a kernel first "
                           "launched while a gate is shut waits for the gate, and a recovery "
                           "can hang (xmig's workers get EAGER unless the job sets its own)",
                           os.environ.get("CUDA_MODULE_LOADING", "LAZY"))  # fmt: skip
        name = ctx.groups.name_for(c10d_name, ranks)
        generation = ctx.env.generation if default else ctx.proxy.generation
        members = list(range(size)) if ranks is None else ranks
        proxy = ProxyProcessGroup(
            ctx.comms.communicator(name, generation, group_rank, size),
            before_op=ctx.injector.at_collective,
            keep_log=ctx.env.keep_log,
            log_route=jobenv.log_route_for(os.environ.get(jobenv.LOG_ROUTE), gate),
            gate=gate,
            on_trouble=lambda error: on_trouble(ctx, error, members),
            # a replacement serves its prologue (DDP's construction) locally
            mode="local" if ctx.prologue_local else "normal",
            on_issue=ctx.tracer.op if ctx.tracer is not None else None,
            group=name,
            sequence=ctx.groups.sequence,
        )
        if ctx.step is not None:
            proxy.begin_step(ctx.step)
        if self._replacement is not None and ctx.env.replacement:
            proxy.on_mismatch = self._replacement.refuse
        ctx.groups.add(Group(name, c10d_name, members, proxy))
        return proxy

    def _on_world(self, proxy: ProxyProcessGroup) -> None:
        """The world changed size: its new default group."""
        self.proxy = proxy
        self.process_group = dist.group.WORLD

    @property
    def rank(self) -> int:
        """This rank's number (a resize of the world renumbers the ranks that stay)."""
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        """How many ranks the world has now (the launch's, until a resize)."""
        return self._ctx.world_size

    @property
    def env(self) -> WorkerEnv:
        return self._ctx.env

    @property
    def device(self) -> torch.device:
        """This rank's device: its local GPU under NCCL, else the CPU."""
        return self._ctx.device

    @property
    def step(self) -> int | None:
        """The step the loop is in (the total once it has ended), None before it starts."""
        return self._ctx.step

    @property
    def completed_steps(self) -> int:
        return self._ctx.completed_steps

    @property
    def phase(self) -> WorkerPhase:
        return self._ctx.phase.current

    # ---- registered state -------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Hand xmig the job's state: ``model=`` (the DDP-wrapped module, so its bucket layout
        travels too; hashed at the end), ``optimizer=``, and any other object with
        ``state_dict``/``load_state_dict`` (an LR scheduler, a data sampler)."""
        self._ctx.registry.register(**objects)

    def batches(self, source: Iterable[Any], name: str = "data") -> Batches:
        """Iterate ``source`` through this: its position travels with the state, so a
        replacement draws exactly the batches its failed rank would have drawn.

        ``source`` is a ``DataLoader`` (or any iterable: drawn from endlessly, epoch after
        epoch, its sampler's ``set_epoch`` called at each) or an iterator or generator (once
        through). Every batch is a function of the job's seed, the rank and its position, so
        a batch may be drawn anywhere: at the top of a step, prefetched at the end of the one
        before, or several per step. Call it before ``steps()``; ``name`` tells several
        streams apart."""
        ctx = self._ctx
        if ctx.phase.current is not WorkerPhase.STARTING:
            raise XmigError("session.batches() must be called before session.steps()")
        stream = Batches(source, name=name, seed=ctx.seed, rank=ctx.rank,
                         resume_from=self._resume_from(name),
                         mismatch=self._stream_mismatch)  # fmt: skip
        ctx.registry.add_stream(stream)
        return stream

    def shards(self, dataset: Any, batch: int, *, per_rank: bool = False, collate: Any = None,
               shuffle: bool = True, name: str = "data") -> Shards:  # fmt: skip
        """Draw each step this rank's share of ``dataset`` (map-style: ``len`` and ``[]``):
        ``batch`` is the global batch (each rank gets a contiguous part, the first ranks one
        more where it does not divide evenly), or each rank's with ``per_rank``. The position
        is counted in samples of the whole job: every sample of every epoch is drawn exactly
        once (a step may span two epochs), whatever the ranks, and a rank's share is the
        same whichever process draws it. ``stream.weight`` is the last share's size against
        an even split (multiply a mean loss by it for the global batch's mean). Call it
        before ``steps()``."""
        ctx = self._ctx
        if ctx.phase.current is not WorkerPhase.STARTING:
            raise XmigError("session.shards() must be called before session.steps()")
        policy = BatchPolicy.PER_RANK if per_rank else BatchPolicy.GLOBAL
        try:
            partition = GlobalPartition(len(dataset), batch, ctx.seed, policy, shuffle)
            stream = Shards(dataset, partition, name=name, world_size=ctx.world_size,
                            rank=ctx.rank, collate=collate, resume_from=self._resume_from(name),
                            mismatch=self._stream_mismatch)  # fmt: skip
        except ValueError as exc:
            raise XmigError(f"session.shards(): {exc}") from exc
        ctx.registry.add_stream(stream)
        return stream

    def _resume_from(self, name: str) -> Any:
        """In a replacement: what waits for the pulled state of stream ``name``."""
        if self._replacement is None:
            return None
        replacement, ctx = self._replacement, self._ctx

        def resume_from() -> tuple[dict[str, Any], int]:
            try:
                return replacement.stream_state(name)
            except RecoveryFailed as exc:  # the coordinator hears why, and stops the job
                ctx.die(f"recovery failed: {exc}")

        return resume_from

    def _stream_mismatch(self, why: str) -> None:
        ctx = self._ctx
        logger.warning("rank %d: %s", ctx.rank, why)
        ctx.send(protocol.NotBitIdentical(generation=ctx.env.generation, why=why,
                                          t=time.time()))  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything a replacement needs, as of now (call with the state lock held)."""
        return self._ctx.registry.state_dict()

    def load_state(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned (on a peer) into the registered objects."""
        self._ctx.registry.load_state(state)

    def _model(self) -> torch.nn.Module | None:
        return self._ctx.registry.model()

    def params_sha256(self) -> str | None:
        """The fingerprint of the registered model's parameters, or None without a model."""
        model = self._model()
        return params_sha256(model) if model is not None else None

    # ---- the steps ----------------------------------------------------------------------------
    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers ``start … total-1``; each boundary reseeds RNGs from
        (seed, rank, step), reports progress to the agent and fires due faults. A replacement
        process first pulls its state from a peer and starts at the survivors' step."""
        yield from self._loop.run(total, start)

    # ---- ending -----------------------------------------------------------------------------
    def _excepthook(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        link = self._ctx.link
        if link is not None and not isinstance(exc, KeyboardInterrupt):
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            with contextlib.suppress(WireError, TimeoutError):
                link.ask(protocol.WorkerError(error=text, step=link.step, t=time.time()),
                         timeout=5.0)  # fmt: skip
        self._previous_excepthook(exc_type, exc, tb)

    def close(self) -> None:
        """Leave the job (called at exit). A rank that finished its steps stays until every
        rank has: a peer that fails in its last step recovers from this rank's state and
        replays with it. The job's own bounds end the wait (the agent stops or dies)."""
        ctx = self._ctx
        if ctx.link is not None and ctx.finished:
            while not ctx.orders.released.wait(1.0):
                pass
        if ctx.link is not None:
            ctx.link.close()
            ctx.link = None
        if not wait_for_aborts(ABORT_WAIT_S):
            logger.warning("a communicator was still being aborted %.0f s on, at exit",
                           ABORT_WAIT_S)  # fmt: skip
        wait_let_go(ABORT_WAIT_S)  # a thread killed at exit inside a work's end aborts


_session: Session | None = None


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
    env = WorkerEnv.from_environ()
    try:
        logs.setup(env.log_level)
    except ValueError as exc:
        raise XmigError(f"XMIG_LOG_LEVEL: {exc}") from None
    _session = Session(env, seed, backend, timeout)
    return _session


__all__ = [
    "Batches",
    "RecoveryFailed",
    "ReplayMismatch",
    "Session",
    "Shards",
    "XmigError",
    "init",
    "is_sticky_cuda_error",
]
