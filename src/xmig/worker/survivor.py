"""A survivor's part in the recovery of a failed peer: park, report where it stands, finish
DDP's layout locally when rank 0 is replaced, rebuild the communicator, serve or receive the
state, then replay the step or roll it back; or, when the fault cannot be recovered, write
its shard of a just-in-time checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xmig import protocol
from xmig.bitwise import replay_divergence
from xmig.ccl import Communicator
from xmig.proxy import ProxyProcessGroup, ReplayCheck, ReplayDiverged, replay_groups
from xmig.state import ReplacementPayload, checkpoint
from xmig.state import ddp as ddp_state
from xmig.wire import WireError
from xmig.worker import pull
from xmig.worker.context import STATE_LOCK_TIMEOUT_S, WorkerContext
from xmig.worker.errors import RecoveryFailed
from xmig.worker.gates import after_framework, clone_state, recovery_stream, resume_gating
from xmig.worker.groups import WORLD, Group
from xmig.worker.hooks import OptimizerGate
from xmig.worker.layout import DdpLayout
from xmig.worker.orders import Superseded
from xmig.worker.phase import WorkerPhase
from xmig.worker.verify import Verifier

logger = logging.getLogger(__name__)

# (GPU gate) how long a parking survivor waits for the gated ops in flight to end first: a
# bucket's all-reduce that a fault did not touch ends in milliseconds; one stuck on a dead
# peer does not end at all
GATE_DRAIN_S = 2.0


class Survivor:
    def __init__(
        self, ctx: WorkerContext, layout: DdpLayout, verifier: Verifier, gate: OptimizerGate
    ) -> None:
        self._ctx = ctx
        self._layout = layout
        self._verifier = verifier
        self._gate = gate
        # parks (and a save when the coordinator is lost), taken in turn by the runner
        self._parks: queue.SimpleQueue[protocol.Park | protocol.SaveState] = queue.SimpleQueue()
        self._runner: threading.Thread | None = None
        self._lock = threading.Lock()
        # a rollback: the step to go on from at the next boundary, and the state pulled for it
        self._redo_from: int | None = None
        self._stash: dict[str, Any] | None = None
        self._rolled_back: list[Group] = []  # the groups a rollback serves locally
        # while the survivor's threads hold the state lock (from the park to the end of a
        # recovery; for good after one that did not finish, whose state a checkpoint may
        # still save): the phase to go back to
        self._held: WorkerPhase | None = None
        # the recovery under way on the runner; a later park gives it up (its thread, maybe
        # stuck in a collective or a communicator's meeting, touches nothing once it returns)
        self._current: object | None = None
        # a shrink pauses this rank where the step it rolls back starts again
        self.pause_at: Callable[[protocol.Pause], None] | None = None
        # why this rank's world cannot change size (a shrink needs it to), None if it can
        self.why_not_resize: Callable[[], str | None] = lambda: None

    def on_park(self, park: protocol.Park) -> None:
        """From the order consumer: recoveries run in turn on a thread of their own, which
        waits for the plan the consumer hands on."""
        self._ctx.recoveries_started += 1
        self._take(park)

    def on_save(self, order: protocol.SaveState) -> None:
        """From the order consumer: the coordinator is lost; the state is saved on the
        recovery thread."""
        self._take(order)

    def _take(self, order: protocol.Park | protocol.SaveState) -> None:
        """Queue ``order`` for the runner. A recovery still under way was given up by the
        coordinator: its collectives are let go (NCCL: aborted; gloo: its peer's end does it)
        and, since its thread may be stuck where nothing can reach it (a communicator's
        meeting with a peer that is gone), a new runner takes over; the state lock stays
        the survivor's."""
        with self._lock:
            self._parks.put(order)
            if self._current is not None:
                self._current = None
                for group in self._ctx.groups.all():
                    if group.proxy.halted:
                        group.proxy.abort_communicator()
                self._runner = None
            if self._runner is None:
                self._runner = threading.Thread(target=self._run, name="xmig-recovery",
                                                daemon=True)  # fmt: skip
                self._runner.start()

    def _given_up(self, token: object) -> None:
        """Raise Superseded if the recovery ``token`` stands for was given up meanwhile."""
        if self._current is not token:
            raise Superseded("this recovery was given up for a later park")

    def _run(self) -> None:
        me = threading.current_thread()
        while self._runner is me:
            park = self._parks.get()
            if self._runner is not me:  # given up while waiting: the next runner takes it
                self._parks.put(park)
                return
            if isinstance(park, protocol.SaveState):
                with recovery_stream(self._ctx):
                    self._save_own(park)
                continue
            token = object()
            self._current = token
            try:
                with recovery_stream(self._ctx):
                    self.recover(park, token)
            except Superseded as exc:
                logger.info("rank %d: %s", self._ctx.rank, exc)
            except Exception as exc:
                # the coordinator hears why and gives the recovery up; this rank stays
                # parked with its state, which a just-in-time checkpoint still needs (the
                # job's stop ends it)
                if self._current is token:
                    text = f"recovery failed: {type(exc).__name__}: {exc}"
                    logger.error("rank %d: %s", self._ctx.rank, text)
                    self._ctx.send(protocol.RecoveryFailed(
                        error=text, generation=park.generation, t=time.time()))  # fmt: skip
            finally:
                with self._lock:
                    if self._current is token:
                        self._current = None

    def recover(self, park: protocol.Park, token: object | None = None) -> None:
        """Park for ``park``'s generation, then carry out its plan: a recovery, or a
        checkpoint. A recovery that does not finish leaves this rank parked with the state
        lock held (``_held``), its state as it was. ``token``: this recovery's, which a
        later park takes away (see ``_take``)."""
        ctx = self._ctx
        generation = park.generation
        started = time.monotonic()
        if self._held is None:
            if not ctx.state_lock.acquire(timeout=STATE_LOCK_TIMEOUT_S):
                raise RecoveryFailed("the framework held the state lock too long")
            self._held = ctx.phase.move(WorkerPhase.PARKED)
        was = self._held

        def still_mine() -> None:
            if token is not None:
                self._given_up(token)

        # a failure anywhere below leaves this rank parked, the state lock held (``_held``)
        ctx.injector.at_phase(ctx.step, "park")
        # the groups that hold a replaced rank are rebuilt (all of them after a
        # communication error, whose group only the failing rank knows); the others'
        # ops go on meanwhile
        rebuilt = ctx.groups.holding(park.replaced) if park.replaced else ctx.groups.all()
        kept = [g for g in ctx.groups.all() if g not in rebuilt]
        # (GPU gate) NCCL's abort frees device memory, and on an H200 no device memory is
        # allocated or freed while a stream waits behind a shut gate, which only the
        # recovery opens (measured: the abort had not returned a minute after the fault): a
        # group with a shut gate has its old communicator aborted once the recovery is done
        late_aborts: list[tuple[ProxyProcessGroup, Communicator]] = []
        for group in rebuilt:
            group.proxy.halt(drain_s=GATE_DRAIN_S)
            if group.proxy.gates_closed():
                late_aborts.append((group.proxy, group.proxy.communicator))
            else:
                group.proxy.abort_communicator()  # NCCL: in-flight kernels return; gloo: no-op
        after_framework(ctx)  # (GPU gate) what the recovery reads is the framework's, so far
        if ctx.update_queued():
            logger.info("rank %d: the update of step %s waits behind a shut gate: this rank's "
                        "state is that of the step's start", ctx.rank, ctx.step)  # fmt: skip
        if self._layout.root in park.replaced:
            self._finish_layout_locally()
        still_mine()
        ctx.send(protocol.Parked(generation=generation, position=self.position(park.shrink),
                                 t=time.time()))  # fmt: skip
        plan = ctx.orders.plans.next(generation, ctx.env.recovery_timeout)
        if plan is None:
            raise RecoveryFailed(f"no rebuild order within {ctx.env.recovery_timeout:.0f} s")
        if isinstance(plan, protocol.WriteCheckpoint):
            self._write_checkpoint(plan)
            return  # parked for good: the job stops once it is sealed
        if isinstance(plan, protocol.Shrink):
            self._shrink(plan, kept, late_aborts)
            self._unpark(was, token)
            return
        if plan.mode == "rollback":
            # every rank serves the rest of its step locally and redoes a step from its
            # start: no group may keep an op in flight that a peer will not issue
            for group in kept:
                group.proxy.halt()
                if group.proxy.gates_closed():
                    late_aborts.append((group.proxy, group.proxy.communicator))
                else:
                    group.proxy.abort_communicator()
            rebuilt, kept = rebuilt + kept, []
        # before the step runs on (the training thread reaches the next boundary as soon
        # as the replay is done)
        # every rank reports at the same boundary, after the latest step any survivor is in
        # (ranks of other groups may be a step ahead of the resume step)
        check_after = plan.check_after if plan.check_after is not None else plan.step
        self._verifier.expect(generation, check_after)
        parked = time.monotonic()
        ctx.injector.at_phase(ctx.step, "rebuild")
        communicators = [
            ctx.comms.communicator(g.name, generation, g.proxy.communicator.rank,
                                   g.proxy.communicator.size)
            for g in rebuilt
        ]  # fmt: skip
        built = time.monotonic()
        still_mine()
        ctx.injector.at_phase(ctx.step, "pull")
        report = self._serve_or_receive(plan)  # includes waiting for the receiver
        pulled = time.monotonic()
        still_mine()
        for group, communicator in zip(rebuilt, communicators, strict=True):
            group.proxy.switch(communicator)
        check = None
        ctx.injector.at_phase(ctx.step, "replay")
        if plan.mode == "replay":
            check = self._replay(plan, [g.proxy for g in rebuilt])
            still_mine()
            for group in rebuilt:
                group.proxy.resume()
        else:
            self.roll_back(plan.step, rebuilt)
        resume_gating(ctx)
        for proxy, old in late_aborts:
            proxy.abort_communicator(communicator=old)
        self._unpark(was, token)
        phases = {"park": parked - started, "rebuild": built - parked,
                  "pull": pulled - built, "replay": check.seconds if check else 0.0}  # fmt: skip
        ctx.send(protocol.Recovered(generation=generation, role="survivor", phases=phases,
                                    pull=report, t_resumed=time.time(),
                                    replay_check=check.to_json() if check else None,
                                    groups={"rebuilt": [g.label for g in rebuilt],
                                            "kept": [g.label for g in kept]},
                                    t=time.time()))  # fmt: skip
        if ctx.finished:  # a finished rank that served a peer: its state is the end's
            self._verifier.at_boundary(ctx.total if ctx.total is not None else plan.step)

    def _unpark(self, was: WorkerPhase, token: object | None) -> None:
        """The recovery is done: the step goes on (the state lock given back)."""
        with self._lock:
            if token is not None and self._current is not token:
                raise Superseded("this recovery was given up for a later park")
            self._ctx.phase.move(was)
            self._held = None
            self._ctx.state_lock.release()
            if token is not None:
                self._current = None  # done: a later park is a new recovery's

    def _shrink(self, plan: protocol.Shrink, kept: list[Group],
                late_aborts: list[tuple[ProxyProcessGroup, Communicator]]) -> None:  # fmt: skip
        """The lost ranks are not replaced: finish this step locally without an update, and
        pause at the start of ``plan.step`` (this one again, or the next with a peer's state),
        where the world changes size (``worker/resize.py``)."""
        ctx = self._ctx
        for group in kept:  # no group may keep an op in flight that a peer will not issue
            group.proxy.halt()
            if group.proxy.gates_closed():
                late_aborts.append((group.proxy, group.proxy.communicator))
            else:
                group.proxy.abort_communicator()
        # a survivor still in the step before takes the state of this one's start from a
        # peer (before the rollback, which would otherwise keep its own)
        targets = plan.served_by(ctx.rank)
        if targets:
            pull.serve(ctx, plan.generation, targets,
                       lambda _target: self._rollback_payload(plan.step))  # fmt: skip
        elif str(ctx.rank) in plan.sources:
            incoming, stats = pull.receive(ctx, plan.generation)
            pull.check_digest(ctx, plan.generation, stats.digest)
            self._stash = ReplacementPayload.from_wire(incoming).state
        self.roll_back(plan.step, ctx.groups.all())
        assert self.pause_at is not None
        self.pause_at(protocol.Pause(generation=plan.generation, step=plan.step))
        resume_gating(ctx)
        for proxy, old in late_aborts:
            proxy.abort_communicator(communicator=old)
        logger.info("rank %d: the world shrinks at step %d: the step is rolled back", ctx.rank,
                    plan.step)  # fmt: skip

    def _write_checkpoint(self, order: protocol.WriteCheckpoint) -> None:
        """Write this rank's shard of a just-in-time checkpoint, if it is a writer: its state
        as of the start of the step it is parked in, as a replacement would have pulled it."""
        ctx = self._ctx
        shard = order.shard_of(ctx.rank)
        if shard is None:
            return
        ctx.injector.at_phase(ctx.step, "checkpoint")
        written: dict[str, Any] = {"file": "", "bytes": 0, "sha256": "", "seconds": 0.0}
        error = None
        try:
            self._finish_layout_locally()
            if ctx.state_step != order.step:
                raise RecoveryFailed(f"this rank's state is of step {ctx.state_step}, not "
                                     f"{order.step}")  # fmt: skip
            written = checkpoint.write_shard(Path(order.folder), shard, self._saved(order.step))
        except Exception as exc:  # the coordinator says why no checkpoint was written
            error = f"{type(exc).__name__}: {exc}"
            logger.error("rank %d: writing shard %d failed: %s", ctx.rank, shard, error)
        ctx.send(protocol.CheckpointWritten(
            generation=order.generation, shard=shard, file=written["file"],
            bytes=written["bytes"], sha256=written["sha256"], seconds=written["seconds"],
            objects=sorted(ctx.registry.objects), first_step=ctx.first_step, error=error,
            t=time.time(),
        ))  # fmt: skip

    def _saved(self, step: int) -> dict[str, Any]:
        """What a checkpoint keeps of this rank: what a replacement resuming at ``step``
        would have pulled from it."""
        ctx = self._ctx
        payload = ReplacementPayload(step=step, mode="resume", first_step=ctx.first_step,
                                     state=ctx.recovery_state(),
                                     ddp=self._layout.outgoing(step, False))  # fmt: skip
        return payload.to_wire()

    def _save_own(self, order: protocol.SaveState) -> None:
        """The coordinator is lost: park (if not parked already) and write this rank's own
        state, as of the start of the step it is in, with what the launcher needs to pick
        one copy per set of replicas; the agent stops this rank afterwards."""
        ctx = self._ctx
        file, step, error = None, None, None
        try:
            if self._held is None:
                if not ctx.state_lock.acquire(timeout=STATE_LOCK_TIMEOUT_S):
                    raise RecoveryFailed("the framework held the state lock too long")
                try:
                    self._held = ctx.phase.move(WorkerPhase.PARKED)
                except Exception:
                    ctx.state_lock.release()
                    raise
            after_framework(ctx)
            step = ctx.state_step
            if step is None:
                raise RecoveryFailed("this rank has not reached its step loop")
            self._finish_layout_locally()
            extra = {"rank": str(ctx.rank), "step": str(step),
                     "first_step": json.dumps(ctx.first_step),
                     "replicas": json.dumps(ctx.replicas()),
                     "objects": json.dumps(sorted(ctx.registry.objects))}  # fmt: skip
            name = checkpoint.rank_file(ctx.rank)
            written = checkpoint.write_shard(Path(order.folder), ctx.rank, self._saved(step),
                                             name=name, extra=extra)  # fmt: skip
            file = written["file"]
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logger.error("rank %d: saving its state failed: %s", ctx.rank, error)
        if ctx.link is not None:
            with contextlib.suppress(WireError, TimeoutError):
                ctx.link.ask(protocol.StateSaved(file=file, step=step, error=error), timeout=10.0)

    def _replay(self, plan: protocol.Rebuild, proxies: list[ProxyProcessGroup]) -> ReplayCheck:
        """Re-issue the logged step of the rebuilt groups; with ``--strict`` a result that
        differs from the first one stops the recovery before the framework sees anything."""
        ctx = self._ctx
        try:
            start = plan.replay_from if plan.replay_from is not None else plan.step
            return replay_groups(proxies, start, ctx.env.recovery_timeout,
                                 strict=ctx.env.strict)  # fmt: skip
        except ReplayDiverged as exc:
            why = replay_divergence(exc.check.differ[0], plan.pulls)
            raise RecoveryFailed(f"--strict: {why}") from None

    def position(self, shrink: bool = False) -> protocol.Position:
        """Where this rank stands, for the coordinator's choice of step, source and mode
        (``shrink``: and whether its world can change size)."""
        ctx = self._ctx
        log_from = None
        if ctx.step is not None:
            log_from = max(ctx.step - 1, ctx.first_step or 0)
        by_group: dict[str, dict[str, list[str]]] = {}
        if ctx.step is not None and ctx.env.keep_log:
            for group in ctx.groups.all():
                signatures = by_group.setdefault(group.name, {})
                for record in group.proxy.logged(log_from or 0):
                    signatures.setdefault(str(record.step), []).append(record.signature)
        return protocol.Position(
            step=ctx.step,
            state_step=ctx.state_step,
            log_from=log_from,
            keep_log=ctx.env.keep_log,
            signatures=by_group.pop(WORLD, {}),
            pending=sum(len(proxy.pending()) for proxy in ctx.groups.proxies()),
            optimizer_waiting=ctx.optimizer_waiting,
            ddp_layout=self._layout.digest,
            ddp_layout_source=self._layout.source,
            group_signatures={name: steps for name, steps in by_group.items() if steps},
            replicas=ctx.replicas(),
            cannot_resize=self.why_not_resize() if shrink else None,
        )

    def _finish_layout_locally(self) -> None:
        """Rank 0, the root of DDP's layout broadcasts, is being replaced while this rank's
        DDP rebuilds its buckets (or this rank writes a checkpoint of that step): it finishes
        the rebuild with its own layout, served without the network, the step running on
        (the state lock let go) until DDP has taken it. The replacement (or the resumed job)
        takes the same layout; the coordinator checks that every survivor's is the same and
        whether any saw rank 0's."""
        ctx, proxy = self._ctx, self._layout.proxy
        ddp = ctx.registry.ddp
        if ddp is None or self._layout.layout is not None or not ddp_state.rebuilds(ddp):
            return
        rebuild_step = (ctx.first_step or 0) + 1
        if ctx.state_step != rebuild_step:
            return
        pair = ddp_state.layout_pair(proxy.int_broadcasts, rebuild_step)
        picker = ddp_state.LayoutPicker(rebuild_step, pair[0].index if pair else None)
        # what DDP already took over the network is not re-issued: the replacement does not
        # broadcast a layout, it takes this one
        logged = proxy.logged(rebuild_step)
        proxy.forget([r for r in logged if r.state == "done" and picker(r)])
        proxy.local_filter = picker
        proxy.serve_pending_locally()
        ctx.state_lock.release()
        try:
            deadline = time.monotonic() + ctx.env.recovery_timeout
            while (layout := ddp_state.complete_layout(proxy.int_broadcasts,
                                                       rebuild_step)) is None:  # fmt: skip
                if time.monotonic() > deadline:
                    raise RecoveryFailed("DDP did not reach its bucket rebuild within "
                                         f"{ctx.env.recovery_timeout:.0f} s")  # fmt: skip
                time.sleep(0.002)
        finally:
            proxy.local_filter = None
            if not ctx.state_lock.acquire(timeout=STATE_LOCK_TIMEOUT_S):
                ctx.die("the framework held the state lock too long")
        pair = ddp_state.layout_pair(proxy.int_broadcasts, rebuild_step)
        assert pair is not None and pair[1] is not None
        self._layout.layout = layout
        self._layout.source = ddp_state.layout_source(pair[0], pair[1])

    def _serve_or_receive(self, plan: protocol.Rebuild) -> dict[str, Any] | None:
        ctx = self._ctx
        targets = plan.served_by(ctx.rank)
        if targets:
            return pull.serve(ctx, plan.generation, targets,
                              lambda target: self._outgoing(plan, target))  # fmt: skip
        if ctx.rank in plan.pulls:
            incoming, stats = pull.receive(ctx, plan.generation)
            pull.check_digest(ctx, plan.generation, stats.digest)
            self._stash = ReplacementPayload.from_wire(incoming).state
            return pull.pull_report("receiver", stats)
        return None

    def _rollback_payload(self, step: int) -> ReplacementPayload:
        """The state of ``step``'s start, for a peer that goes on from there."""
        ctx = self._ctx
        return ReplacementPayload(step=step, mode="rollback", first_step=ctx.first_step,
                                  state=ctx.recovery_state(),
                                  ddp=self._layout.outgoing(step, False))  # fmt: skip

    def _outgoing(self, plan: protocol.Rebuild, target: int) -> ReplacementPayload:
        """What ``target`` resumes from: the state, and for each group it shares with this
        rank the step's ops as logged here and what the done ones got before the fault (its
        ops end with those: ``ProxyProcessGroup.expect_results``)."""
        ctx = self._ctx
        shared = [g for g in ctx.groups.all() if target in g.ranks]
        signatures: dict[str, list[str]] | None = None
        results: dict[str, list[Any]] | None = None
        if plan.mode == "replay":
            signatures, results = {}, {}
            for group in shared:
                logged = group.proxy.logged(plan.step)
                signatures[group.name] = [r.signature for r in logged if r.step == plan.step]
                done = group.proxy.done_results(plan.step)
                results.update({f"{group.name}:{step}:{index}": outputs
                                for (step, index), outputs in done.items()})  # fmt: skip
        return ReplacementPayload(
            step=plan.step,
            mode=plan.mode,
            first_step=ctx.first_step,
            state=ctx.recovery_state(),
            ddp=self._layout.outgoing(plan.step, plan.verify_ready_order),
            signatures=signatures,
            results=results,
            check_after=plan.check_after,
        )

    # ---- rollback ---------------------------------------------------------------------------
    def roll_back(self, resume_step: int, rebuilt: list[Group] | None = None) -> None:
        """Finish the current step without the network or an optimizer update, then go on
        from ``resume_step`` with the state as of its start (``redo_at_boundary``)."""
        ctx = self._ctx
        optimizer = ctx.registry.optimizer()
        if optimizer is not None and not ctx.optimizer_stepped:
            self._gate.skip_update(optimizer)  # this step's update must not happen
        elif ctx.update_queued() and self._stash is None:
            # the update waits on the GPU behind the gates this rollback opens, and cannot
            # be withdrawn: the step's starting state is copied first, and loaded again at
            # the boundary (after the update has run)
            self._stash = clone_state(ctx.recovery_state())
        self._redo_from = resume_step
        self._rolled_back = rebuilt if rebuilt is not None else self._ctx.groups.all()
        for group in self._rolled_back:
            group.proxy.skip_rest_of_step()

    def redo_at_boundary(self, step: int) -> int | None:
        """At the boundary after ``step``: the step to redo after a rollback (the state
        restored as of its start), or None to go on."""
        ctx = self._ctx
        # under the lock: a survivor parked after its update, on its way to this boundary,
        # must not cross it before the plan says whether it redoes a step (and pauses)
        with ctx.state_lock:
            if self._redo_from is None:
                return None
            redo, self._redo_from = self._redo_from, None
            self._gate.allow_update()
            if self._stash is not None:  # the state of a later step, pulled from a peer
                ctx.load_state(self._stash)
                ctx.registry.resume_streams(self._stash, redo, fresh=False)
                self._stash = None
            elif redo == step:
                ctx.registry.restore_others(redo)
            optimizer = ctx.registry.optimizer()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            for group in self._rolled_back:
                group.proxy.resume("normal")
            self._rolled_back = []
        return redo
