"""Hooks on the script's model and optimizer: where injected faults fire, and the optimizer's
update under the state lock."""

from __future__ import annotations

from typing import Any

from xmig.worker.context import WorkerContext
from xmig.worker.errors import RecoveryFailed, XmigError
from xmig.worker.gates import queue_update


def _no_update(*_args: Any, **_kwargs: Any) -> None:
    return None


class OptimizerGate:
    """The optimizer's update holds the state lock (a recovery never sees half-updated
    parameters), and the update of a step being rolled back does not happen."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._skipping: Any = None  # the optimizer whose update is skipped

    @property
    def skipping(self) -> bool:
        return self._skipping is not None

    def before(self, *_args: Any) -> None:
        ctx = self._ctx
        ctx.injector.at_point(ctx.step, "optimizer")
        ctx.optimizer_waiting = True
        acquired = ctx.state_lock.acquire(timeout=ctx.env.recovery_timeout)
        ctx.optimizer_waiting = False
        if not acquired:
            raise RecoveryFailed("the optimizer waited too long for a recovery to finish")
        if self.skipping:
            ctx.state_lock.release()
            raise RecoveryFailed(
                "a rollback was decided while this rank's optimizer was starting its update, "
                "which cannot be undone"
            )
        # the CPU is ahead of the step's collectives: the update goes on the GPU behind
        # their gates, and the state as it begins is what a recovery meanwhile reads
        ctx.queued_update = queue_update(ctx)

    def after(self, *_args: Any) -> None:
        self._ctx.optimizer_stepped = True
        self._ctx.state_lock.release()

    def skip_update(self, optimizer: Any) -> None:
        """The next ``optimizer.step()`` does nothing. torch's step pre-hooks cannot skip a
        step, so the instance's ``step`` shadows the class's until ``allow_update``."""
        optimizer.step = _no_update
        self._skipping = optimizer

    def allow_update(self) -> None:
        if self._skipping is not None:
            del self._skipping.step  # the class's step again
            self._skipping = None


def install_hooks(ctx: WorkerContext, gate: OptimizerGate) -> list[Any]:
    """Hook the registered model and optimizer; returns the handles to remove."""
    injector = ctx.injector
    pending = injector.pending
    needs = {spec.at for spec in pending}
    model = ctx.registry.model()
    optimizer = ctx.registry.optimizer()
    for point in ("forward", "backward"):
        if point in needs and model is None:
            spec = next(s for s in pending if s.at == point)
            raise XmigError(f"fault {spec} needs the model: call session.register(model=...)")
    if "optimizer" in needs and optimizer is None:
        spec = next(s for s in pending if s.at == "optimizer")
        raise XmigError(f"fault {spec} needs the optimizer: call session.register(optimizer=...)")
    handles: list[Any] = []
    tracer = ctx.tracer
    if model is not None and tracer is not None:

        def trace_forward(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tracer.forward(ctx.step, args, kwargs)

        handles.append(model.register_forward_pre_hook(trace_forward, with_kwargs=True))
    if model is not None:
        handles.append(
            model.register_forward_pre_hook(lambda _m, _a: injector.at_point(ctx.step, "forward"))
        )

        def trim_logs(_module: Any, _args: Any, _output: Any) -> None:
            # the forward is queued: the CPU is ahead of the GPU, so the boundary's trim of
            # the communication log costs the step nothing here
            for proxy in ctx.groups.proxies():
                proxy.trim_log()

        handles.append(model.register_forward_hook(trim_logs))
        ctx.trims_after_forward = True
        trainable = [p for p in model.parameters() if p.requires_grad]
        if trainable:
            middle = trainable[len(trainable) // 2]
            handles.append(
                middle.register_post_accumulate_grad_hook(
                    lambda _p: injector.at_point(ctx.step, "backward")
                )
            )
    if optimizer is not None:
        handles.append(optimizer.register_step_pre_hook(gate.before))
        handles.append(optimizer.register_step_post_hook(gate.after))
    return handles
