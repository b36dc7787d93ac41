"""The step loop behind ``session.steps()``: its boundaries and its end."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from xmig import protocol
from xmig.state import params_sha256, reseed
from xmig.worker.context import WorkerContext, dtensor_shard
from xmig.worker.errors import RecoveryFailed, XmigError
from xmig.worker.groups import unproxied_groups
from xmig.worker.hooks import OptimizerGate, install_hooks
from xmig.worker.layout import DdpLayout
from xmig.worker.migration import Migration
from xmig.worker.phase import WorkerPhase
from xmig.worker.replacement import Replacement
from xmig.worker.survivor import Survivor
from xmig.worker.verify import Verifier

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(
        self,
        ctx: WorkerContext,
        gate: OptimizerGate,
        layout: DdpLayout,
        verifier: Verifier,
        survivor: Survivor,
        migration: Migration,
        replacement: Replacement | None,
    ) -> None:
        self._ctx = ctx
        self._gate = gate
        self._layout = layout
        self._verifier = verifier
        self._survivor = survivor
        self._migration = migration
        self._replacement = replacement

    def _enter(self, phase: WorkerPhase) -> None:
        # under the state lock: a recovery that parked this rank holds it until it is done
        with self._ctx.state_lock:
            self._ctx.phase.move(phase)

    def run(self, total: int, start: int) -> Iterator[int]:
        ctx = self._ctx
        if total < 0 or start < 0 or start > total:
            raise XmigError(f"bad step range: start={start}, total={total}")
        if ctx.phase.current not in (WorkerPhase.STARTING, WorkerPhase.PARKED):
            raise XmigError(
                "session.steps() runs once per process: this rank already ran its step loop "
                f"(it is {ctx.phase.current.value})"
            )
        ctx.total = total
        ctx.registry.find_ddp()
        unproxied = unproxied_groups()
        if unproxied and ctx.rank == 0:
            logger.warning(
                "warning: process group(s) %s use another backend than xmig's: their "
                "collectives are not logged or replayed, and a fault in them is not recovered "
                "(make groups with the default backend)",
                ", ".join(unproxied),
            )
        replicas = ctx.keep_replicas()
        # (one rank alone has no peer to pull from anyway: only its in-place retries count)
        if replicas is not None and len(replicas) < 2 and ctx.link is not None \
                and ctx.world_size > 1:  # fmt: skip
            # found out now, not at the fault
            if ctx.registry.ddp is not None:
                why = (f"no replica of rank {ctx.rank}'s state: its DDP trains over a group of "
                       f"one rank, so recovery of rank {ctx.rank} would need a checkpoint "
                       "(xmig recovers a rank from a peer that holds the same state)")  # fmt: skip
            else:
                shard = dtensor_shard(ctx.registry.model(), ctx.rank)
                why = (f"no replica of shard {shard}: recovery of rank {ctx.rank} would need "
                       "a checkpoint (its parameters are sharded with no copy on another rank; "
                       "HSDP's replicate dimension would hold one)")  # fmt: skip
            ctx.send(protocol.CannotRecover(why=why, t=time.time()))
            time.sleep(10.0)  # the coordinator stops the job meanwhile
            raise XmigError(why)
        hooks = install_hooks(ctx, self._gate)
        unreachable = ctx.injector.unreachable(total)
        if unreachable:
            faults = [spec.to_json() for spec in unreachable]
            ctx.send(protocol.UnreachableFaults(total=total, faults=faults, t=time.time()))
        step = start
        if self._replacement is not None:
            self._enter(WorkerPhase.JOINING)
            try:
                step = self._replacement.join()
            except RecoveryFailed as exc:  # the coordinator hears why, and stops the job
                ctx.die(f"recovery failed: {exc}")
        self._enter(WorkerPhase.TRAINING)
        if ctx.first_step is None:
            ctx.first_step = start
        self._layout.watch_first_iteration(step, total)
        try:
            while step < total:
                self._verifier.at_boundary(step)
                self._migration.at_boundary(step)
                with ctx.state_lock:
                    ctx.registry.at_boundary(step)
                    ctx.step = step
                    ctx.optimizer_stepped = False
                    # the step before's queued update, if any, stays until the next optimizer
                    # step replaces it: its gates are all open now, so it no longer counts
                    # (``pending``), and letting its host copies go here, where the GPU waits
                    # for the step's first kernels, took 0.2-0.7 ms on the CPU machine (the
                    # step counts of gpt350m's 292 parameters)
                    reseed(ctx.seed, ctx.rank, step)
                    for proxy in ctx.groups.proxies():
                        proxy.begin_step(step, defer_trim=ctx.trims_after_forward)
                if ctx.link is not None:
                    ctx.link.started(step)
                ctx.injector.at_point(step, "boundary")
                yield step
                step = self._end_of_step(step)
            with ctx.state_lock:
                # what the script issues after its loop (a barrier, a final save) is the
                # end's own pseudo-step, which a replacement reaches and redoes too
                ctx.step = total
                ctx.optimizer_stepped = False
                ctx.queued_update = None
                ctx.registry.at_boundary(total)
                for proxy in ctx.groups.proxies():
                    proxy.begin_step(total)
            self._verifier.at_boundary(total)
            ctx.injector.at_point(total, "boundary")
        finally:
            for hook in hooks:
                hook.remove()
            ctx.trims_after_forward = False
            self._layout.stop()
        self._finish(total)

    def _end_of_step(self, step: int) -> int:
        """The boundary after ``step``: the next step, or an earlier one to redo."""
        ctx = self._ctx
        # (GPU gate) the step's collectives end, or fail, before the next step begins
        bound = 2 * ctx.env.recovery_timeout
        for proxy in ctx.groups.proxies():
            if not proxy.wait_gates_open(bound):
                raise RecoveryFailed(f"the collectives of step {step} did not end within "
                                     f"{bound:.0f} s")  # fmt: skip
        self._ctx.completed_steps = step + 1
        self._layout.end_of_step(step)
        redo = self._survivor.redo_at_boundary(step)
        return step + 1 if redo is None else redo

    def _finish(self, total: int) -> None:
        ctx = self._ctx
        model = ctx.registry.model()
        replicas = ctx.replicas()
        first = min(replicas) if replicas else 0  # each set of replicas' first rank
        fingerprint = params_sha256(model) if ctx.rank == first and model is not None else None
        if ctx.tracer is not None:
            ctx.tracer.final(model)
        unfired = ctx.injector.pending
        if unfired and ctx.link is None:  # else the coordinator reports them
            names = ", ".join(str(s) for s in unfired)
            logger.warning("rank %d: faults never reached: %s", ctx.rank, names)
        if ctx.link is not None:
            done = protocol.Done(steps=total, params_sha256=fingerprint,
                                 checksum=self._verifier.checksum(),
                                 replicas=replicas)  # fmt: skip
            ctx.link.ask(done, timeout=10.0)
        ctx.finished = True
        self._enter(WorkerPhase.FINISHED)
