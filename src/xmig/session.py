"""The worker-side entry: ``xmig.init()``, the step boundary ``session.steps()``, and the
worker's half of in-place recovery (park, rebuild, serve or receive the state, replay)."""

from __future__ import annotations

import atexit
import copy
import dataclasses
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from xmig.agent.link import AgentLink
from xmig.ccl import BACKENDS, Communicator, store_namespace
from xmig.faults import FaultSpec, Injector
from xmig.jobenv import WorkerEnv
from xmig.procs import die_with_parent, outlive_parent
from xmig.proxy import ProxyProcessGroup, ReplayMismatch
from xmig.state import (
    TransferStats,
    params_checksum,
    params_sha256,
    recv_state,
    reseed,
    send_state,
)
from xmig.state import ddp as ddp_state

BACKEND_NAME = "xmig"
DEFAULT_TIMEOUT = timedelta(minutes=30)
STATE_LOCK_TIMEOUT_S = 60.0
# NCCL errors and timeouts must come back to the proxy, not end the process from torch's
# watchdog; read by ProcessGroupNCCL when a communicator is created
NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
# errors after which the CUDA context is unusable: the process must be replaced
STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ECC error",
    "CUDA error: an illegal",
)


def is_sticky_cuda_error(text: str) -> bool:
    """True for a CUDA error that leaves the context unusable (the rank must be respawned)."""
    lowered = text.lower()
    return any(marker.lower() in lowered for marker in STICKY_CUDA_ERRORS)


class XmigError(RuntimeError):
    """A misuse of xmig's worker API, with what to do about it."""


class RecoveryFailed(RuntimeError):
    """This worker could not take part in a recovery; the job stops."""


class Session:
    """One worker's handle on the job: its process group, its registered state, its steps."""

    def __init__(self, env: WorkerEnv, seed: int, backend: str, timeout: timedelta) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.seed = seed
        self.backend = backend
        self.timeout = timeout
        self.step: int | None = None
        self.first_step: int | None = None
        self.completed_steps = 0
        self.objects: dict[str, Any] = {}
        self._ddp_wrapper: Any = None  # the DDP that trains the registered model, if any
        self._hooks: list[Any] = []
        self._snapshots: dict[str, Any] = {}
        # held while the optimizer steps and while a recovery reads or replaces the state
        self.state_lock = threading.Lock()
        self.optimizer_stepped = False
        self.ddp_layout: list[torch.Tensor] | None = None
        self._layout_source = ddp_state.FROM_ROOT  # how this rank came by ddp_layout
        # the order this rank's gradients became ready in its first iteration (DDP's layout
        # comes from rank 0's), and the peers' order a replacement must find it equal to
        self._ready: ddp_state.ReadyOrder | None = None
        self.ready_order: list[int] | None = None
        self._verify_order: list[int] | None = None
        self._redo_from: int | None = None
        self._stash: dict[str, Any] | None = None
        self._plans: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        # digests of pulled state, announced by their senders over the control channel
        self._digests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        # a pause at a step boundary (migration): the step to pause at, the last started step
        self._pause_lock = threading.Lock()
        self._pause_at: dict[str, Any] | None = None
        self._boundary: int | None = None
        self._paused_at: int | None = None
        self._pause_orders: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._recoveries_started = 0
        self._finished = False
        self._total: int | None = None
        self._verify: tuple[int, int] | None = None  # (generation, step) to report a checksum at
        # set when every rank has finished: until then a finished rank stays to serve peers
        self._released = threading.Event()
        self._suppressed_step = False
        self._optimizer_waiting = False
        self.link: AgentLink | None = None
        self.injector = Injector(env.rank, self._announce, current_step=lambda: self.step)
        for fault in env.faults:
            self.injector.add(fault)
        if env.managed:
            self.link = AgentLink(env, on_inject=self.injector.add, on_plan=self._on_plan)
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self.proxy = self._init_process_group(timeout)
        self.process_group: dist.ProcessGroup = dist.group.WORLD
        if self.link is not None:
            threading.Thread(target=self._recovery_loop, name="xmig-recovery", daemon=True).start()
        if self.env.replacement:
            self._start_receiving()
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

    # ---- process group ----------------------------------------------------------------------
    def _init_process_group(self, timeout: timedelta) -> ProxyProcessGroup:
        if dist.is_initialized():
            raise XmigError(
                "torch.distributed is already initialized: call xmig.init() instead of "
                "dist.init_process_group(), it sets up the process group itself"
            )
        if self.backend == "nccl":
            for name, value in NCCL_ENVIRONMENT.items():
                os.environ.setdefault(name, value)
        _register_backend(self.backend)
        created: list[ProxyProcessGroup] = []

        raw_store: dist.Store | None = None

        def create(store: dist.Store, rank: int, size: int, pg_timeout: timedelta) -> Any:
            # c10d hands a store with a prefix of its own choosing; xmig's communicators use
            # the job's store directly, so a process that reconnects (after a migration)
            # finds their keys with a store client of its own
            self.store = raw_store if raw_store is not None else store
            communicator = self._communicator("world", self.env.generation, rank, size)
            proxy = ProxyProcessGroup(
                communicator,
                before_op=self.injector.at_collective,
                keep_log=self.env.keep_log,
                on_trouble=self._on_trouble,
                # a replacement serves its prologue (DDP's construction) locally
                mode="local" if self.env.replacement else "normal",
            )
            created.append(proxy)
            return proxy

        global _create_group
        _create_group = create
        if self.env.managed:
            store = raw_store = self._job_store()
            dist.init_process_group(
                BACKEND_NAME, store=store, rank=self.rank, world_size=self.world_size,
                timeout=timeout,
            )  # fmt: skip
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

    def _job_store(self) -> dist.Store:
        """A client of the job's store (the coordinator hosts it), under the job's own
        unpredictable key prefix."""
        assert self.env.token is not None
        client = dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=False,
                               timeout=self.timeout)  # fmt: skip
        return dist.PrefixStore(store_namespace(self.env.token), client)

    def _communicator(self, group: str, generation: int, rank: int, size: int) -> Communicator:
        where = f"the job's c10d store at {self.env.master_addr}:{self.env.master_port}"
        return Communicator(self.backend, group, generation, self.store, rank, size,
                            self.timeout, where=where)  # fmt: skip

    # ---- registered state -------------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Hand xmig the job's state: ``model=`` (the DDP-wrapped module, so its bucket layout
        travels too; hashed at the end), ``optimizer=``, and any other object with
        ``state_dict``/``load_state_dict`` (an LR scheduler, a data sampler)."""
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

    def _ddp(self) -> Any:
        return self._ddp_wrapper

    def _find_ddp(self) -> None:
        """Find the DDP that trains the registered model (it may have been handed over bare:
        its DDP's bucket layout is part of the state all the same)."""
        model = self.objects.get("model")
        self._ddp_wrapper = ddp_state.find_ddp(model)
        if self._ddp_wrapper is None and model is not None and ddp_state.live_ddps():
            raise XmigError(
                "session.register(model=...) got a module that no DistributedDataParallel "
                "wraps, but this process trains with one: register that DDP "
                "(session.register(model=ddp, ...))"
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything a replacement needs, as of now (call with the state lock held)."""
        state: dict[str, Any] = {}
        for name, obj in self.objects.items():
            state[name] = obj.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        for name, obj in self.objects.items():
            if name not in state:
                raise RecoveryFailed(f"the peer's state has no {name!r}")
            obj.load_state_dict(state[name])

    # ---- hooks ------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
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
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer))
            self._hooks.append(optimizer.register_step_post_hook(self._after_optimizer))

    def _before_optimizer(self, *_args: Any) -> None:
        self.injector.at_point(self.step, "optimizer")
        # a recovery in progress must not see half-updated parameters
        self._optimizer_waiting = True
        acquired = self.state_lock.acquire(timeout=self.env.recovery_timeout)
        self._optimizer_waiting = False
        if not acquired:
            raise RecoveryFailed("the optimizer waited too long for a recovery to finish")
        if self._suppressed_step:
            self.state_lock.release()
            raise RecoveryFailed(
                "a rollback was decided while this rank's optimizer was starting its update, "
                "which cannot be undone"
            )

    def _after_optimizer(self, *_args: Any) -> None:
        self.optimizer_stepped = True
        self.state_lock.release()

    # ---- the step loop ----------------------------------------------------------------------
    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers ``start … total-1``; each boundary reseeds RNGs from
        (seed, rank, step), reports progress to the agent and fires due faults. A replacement
        process first pulls its state from a peer and starts at the survivors' step."""
        if total < 0 or start < 0 or start > total:
            raise XmigError(f"bad step range: start={start}, total={total}")
        self._total = total
        self._find_ddp()
        self._install_hooks()
        unreachable = self.injector.unreachable(total)
        if unreachable and self.link is not None:
            self.link.report("unreachable_faults", total=total,
                             faults=[s.to_json() for s in unreachable])  # fmt: skip
        step = start
        if self.env.replacement:
            try:
                step = self._join()
            except RecoveryFailed as exc:  # the coordinator hears why, and stops the job
                self._die(f"recovery failed: {exc}")
        if self.first_step is None:
            self.first_step = start
        ddp = self._ddp()
        if ddp is not None and ddp_state.rebuilds(ddp) and step < total:
            self._ready = ddp_state.ReadyOrder(ddp)  # for this process's first iteration
        try:
            while step < total:
                self._maybe_verify(step)
                self._maybe_pause(step)
                with self.state_lock:
                    self._snapshot_objects()
                    self.step = step
                    self.optimizer_stepped = False
                    reseed(self.seed, self.rank, step)
                    self.proxy.begin_step(step)
                if self.link is not None:
                    self.link.report_step(step)
                self.injector.at_point(step, "boundary")
                yield step
                step = self._end_of_step(step)
            with self.state_lock:
                # what the script issues after its loop (a barrier, a final save) is the
                # end's own pseudo-step, which a replacement reaches and redoes too
                self.step = total
                self.optimizer_stepped = False
                self.proxy.begin_step(total)
            self._maybe_verify(total)
            self.injector.at_point(total, "boundary")
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            if self._ready is not None:
                self._ready.stop()
        self._finish(total)

    def _end_of_step(self, step: int) -> int:
        """The boundary after ``step``: the next step, or an earlier one to redo."""
        self.completed_steps = step + 1
        ddp = self._ddp()
        if ddp is not None and self.ddp_layout is None and ddp_state.rebuilds(ddp):
            # the layout DDP took in this step, if it rebuilt its buckets in it
            self.ddp_layout = ddp_state.complete_layout(self.proxy.int_broadcasts, step)
        if self._ready is not None:
            self._check_ready_order(self._ready.stop())
            self._ready = None
        if self._redo_from is None:
            return step + 1
        with self.state_lock:
            redo, self._redo_from = self._redo_from, None
            optimizer = self.objects.get("optimizer")
            if self._suppressed_step and optimizer is not None:
                del optimizer.step  # the class's step again
                self._suppressed_step = False
            if self._stash is not None:
                self.load_state(self._stash)
                self._stash = None
            elif redo == step:
                self._restore_objects()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            self.proxy.resume("normal")
        return redo

    def _check_ready_order(self, order: list[int]) -> None:
        """Keep this process's first ready order; a replacement that took a layout its peers
        made themselves (its rank 0 died before sending DDP's) says whether it is the one
        the fault-free run had: rank 0's order is now this process's."""
        self.ready_order = order
        expected, self._verify_order = self._verify_order, None
        if expected is None or expected == order or self.link is None:
            return
        pairs = enumerate(zip(order, expected, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), min(len(order), len(expected)))
        self.link.report("not_bit_identical", generation=self.env.generation,
                         why=f"rank {self.rank}'s gradients became ready in another order than "
                             f"its peers' (from position {first} on), so DDP's buckets, which "
                             "its peers built in their own order, differ from the fault-free "
                             "run's")  # fmt: skip

    def _snapshot_objects(self) -> None:
        for name, obj in self.objects.items():
            if name not in ("model", "optimizer"):
                self._snapshots[name] = copy.deepcopy(obj.state_dict())

    def _restore_objects(self) -> None:
        for name, saved in self._snapshots.items():
            self.objects[name].load_state_dict(saved)

    def params_sha256(self) -> str | None:
        """The fingerprint of the registered model's parameters, or None without a model."""
        model = self._model()
        return params_sha256(model) if model is not None else None

    def _finish(self, total: int) -> None:
        fingerprint = self.params_sha256() if self.rank == 0 else None
        unfired = self.injector.pending
        if unfired and self.link is None:  # else the coordinator reports them
            names = ", ".join(str(s) for s in unfired)
            print(f"xmig: rank {self.rank}: faults never reached: {names}", file=sys.stderr)
        if self.link is not None:
            self.link.report_done(total, fingerprint, self._replica_checksum())
        self._finished = True

    # ---- recovery: survivors ----------------------------------------------------------------
    def _on_trouble(self, error: str) -> None:
        """A collective failed; the proxy holds the framework. Tell the agent, get ready."""
        if self.link is None:
            print(f"xmig: rank {self.rank}: collective failed and no agent can help: {error}",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(1)
        if is_sticky_cuda_error(error):
            # the CUDA context is lost: only a new process can go on; the agent respawns it
            self._die(f"unrecoverable CUDA error, this process must be replaced: {error}")
        self.link.report_comm_error(error, self.step, self.proxy.generation)
        started = self._recoveries_started
        threading.Thread(target=self._trouble_watchdog, args=(started,), daemon=True).start()

    def _trouble_watchdog(self, started: int) -> None:
        time.sleep(self.env.recovery_timeout)
        if self._recoveries_started == started:
            self._die(f"a collective failed and no recovery began within "
                      f"{self.env.recovery_timeout:.0f} s")  # fmt: skip

    def _on_plan(self, plan: dict[str, Any]) -> None:
        if plan.get("op") == "state_digest":
            if int(plan["rank"]) == self.rank:
                self._digests.put(plan)
            return
        self._plans.put(plan)

    def _check_digest(self, generation: int, source: int | None, digest: str) -> None:
        """Load nothing a peer sent unless it is what the peer says it sent: the pull's
        communicator meets through the job's store, which the job does not authenticate."""
        deadline = time.monotonic() + self.env.recovery_timeout
        while True:
            try:
                announced = self._digests.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RecoveryFailed(
                    f"the peer serving the state announced no digest within "
                    f"{self.env.recovery_timeout:.0f} s"
                ) from None
            if int(announced["generation"]) == generation:
                break
        if announced["digest"] != digest:
            sender = announced.get("source", source)
            raise RecoveryFailed(
                f"the state received from rank {sender} is not what it sent (SHA-256 "
                f"{digest[:16]}… received, {str(announced['digest'])[:16]}… announced): it was "
                f"altered or corrupted in transit; the pull's connection was set up through "
                f"the job's c10d store at {self.env.master_addr}:{self.env.master_port}"
            )

    def _recovery_loop(self) -> None:
        while True:
            plan = self._plans.get()
            op = plan.get("op")
            if op == "pause":
                self._set_pause(plan)
                continue
            if op == "release":
                self._released.set()
                continue
            if op in ("dump", "resume", "abort"):
                self._pause_orders.put(plan)  # for a step loop paused at its boundary
            if op != "park":
                continue  # a stale order of an earlier generation
            self._recoveries_started += 1
            try:
                self._recover(plan)
            except Exception as exc:
                self._die(f"recovery failed: {type(exc).__name__}: {exc}")

    def _die(self, text: str) -> None:
        print(f"xmig: rank {self.rank}: {text}", file=sys.stderr, flush=True)
        if self.link is not None:
            self.link.report("recovery_failed", error=text)
        time.sleep(0.2)
        os._exit(1)

    def _next_plan(self, op: str, generation: int | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + self.env.recovery_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RecoveryFailed(f"no {op} order within {self.env.recovery_timeout:.0f} s")
            try:
                plan = self._plans.get(timeout=left)
            except queue.Empty:
                continue
            if plan.get("op") == "abort":
                raise RecoveryFailed(str(plan.get("reason", "the coordinator gave up")))
            if plan.get("op") == op and (generation is None or plan["generation"] == generation):
                return plan

    def _position(self) -> dict[str, Any]:
        """Where this rank stands, for the coordinator's choice of step, source and mode."""
        state_step = None
        if self.step is not None:
            state_step = self.step + 1 if self.optimizer_stepped else self.step
        log_from = None
        if self.step is not None:
            log_from = max(self.step - 1, self.first_step or 0)
        signatures: dict[str, list[str]] = {}
        if self.step is not None and self.env.keep_log:
            for record in self.proxy.logged(log_from or 0):
                signatures.setdefault(str(record.step), []).append(record.signature)
        return {
            "step": self.step,
            "state_step": state_step,
            "log_from": log_from,
            "keep_log": self.env.keep_log,
            "signatures": signatures,
            "pending": len(self.proxy.pending()),
            "optimizer_waiting": self._optimizer_waiting,
            "ddp_layout": ddp_state.layout_digest(self.ddp_layout) if self.ddp_layout else None,
            "ddp_layout_source": self._layout_source,
        }

    def _finish_layout_locally(self) -> None:
        """Rank 0, the root of DDP's layout broadcasts, is being replaced while this rank's
        DDP rebuilds its buckets: it finishes the rebuild with its own layout, served without
        the network, the step running on (the state lock let go) until DDP has taken it. The
        replacement takes the same layout; the coordinator checks that every survivor's is
        the same and whether any saw rank 0's."""
        ddp = self._ddp()
        if ddp is None or self.ddp_layout is not None or not ddp_state.rebuilds(ddp):
            return
        rebuild_step = (self.first_step or 0) + 1
        state_step = None
        if self.step is not None:
            state_step = self.step + 1 if self.optimizer_stepped else self.step
        if state_step != rebuild_step:
            return
        pair = ddp_state.layout_pair(self.proxy.int_broadcasts, rebuild_step)
        picker = ddp_state.LayoutPicker(rebuild_step, pair[0].index if pair else None)
        # what DDP already took over the network is not re-issued: the replacement does not
        # broadcast a layout, it takes this one
        logged = self.proxy.logged(rebuild_step)
        self.proxy.forget([r for r in logged if r.state == "done" and picker(r)])
        self.proxy.local_filter = picker
        self.proxy.serve_pending_locally()
        self.state_lock.release()
        try:
            deadline = time.monotonic() + self.env.recovery_timeout
            while (layout := ddp_state.complete_layout(self.proxy.int_broadcasts,
                                                       rebuild_step)) is None:  # fmt: skip
                if time.monotonic() > deadline:
                    raise RecoveryFailed("DDP did not reach its bucket rebuild within "
                                         f"{self.env.recovery_timeout:.0f} s")  # fmt: skip
                time.sleep(0.002)
        finally:
            self.proxy.local_filter = None
            if not self.state_lock.acquire(timeout=STATE_LOCK_TIMEOUT_S):
                self._die("the framework held the state lock too long")
        pair = ddp_state.layout_pair(self.proxy.int_broadcasts, rebuild_step)
        assert pair is not None and pair[1] is not None
        self.ddp_layout = layout
        self._layout_source = ddp_state.layout_source(pair[0], pair[1])

    def _recover(self, park: dict[str, Any]) -> None:
        assert self.link is not None
        generation = int(park["generation"])
        started = time.monotonic()
        if not self.state_lock.acquire(timeout=STATE_LOCK_TIMEOUT_S):
            raise RecoveryFailed("the framework held the state lock too long")
        try:
            self.proxy.halt()
            self.proxy.abort_communicator()  # NCCL: in-flight kernels return; gloo: no-op
            if 0 in park.get("replaced", []):
                self._finish_layout_locally()
            self.link.report("parked", generation=generation, position=self._position())
            plan = self._next_plan("rebuild", generation)
            # before the step runs on (the training thread reaches the next boundary as soon
            # as the replay is done)
            self._expect_verify(generation, int(plan["step"]))
            parked = time.monotonic()
            communicator = self._communicator("world", generation, self.rank, self.world_size)
            rebuilt = time.monotonic()
            pull = self._serve_or_receive(plan)  # includes waiting for the receiver to get there
            pulled = time.monotonic()
            self.proxy.switch(communicator)
            replay_s = 0.0
            if plan["mode"] == "replay":
                replay_s = self.proxy.replay(int(plan["step"]), self.env.recovery_timeout)
                self.proxy.resume()
            else:
                self._void(int(plan["step"]))
        finally:
            self.state_lock.release()
        self.link.report(
            "recovered",
            generation=generation,
            role="survivor",
            phases={
                "park": parked - started,
                "rebuild": rebuilt - parked,
                "pull": pulled - rebuilt,
                "replay": replay_s,
            },
            pull=pull,
            t_resumed=time.time(),
        )
        if self._finished:  # a finished rank that served a peer: its state is the end's
            self._maybe_verify(self._total if self._total is not None else int(plan["step"]))

    def _expect_verify(self, generation: int, step: int) -> None:
        """After a recovery every rank tells the coordinator a checksum of its parameters
        as of the start of the step after the recovered one (or the end): DDP's replicas
        must agree, or the recovery went wrong silently."""
        total = self._total if self._total is not None else step + 1
        self._verify = (generation, min(step + 1, total))

    def _maybe_verify(self, step: int) -> None:
        verify, self._verify = self._verify, None
        if verify is None or verify[1] != step:
            self._verify = verify
            return
        if self.link is not None:
            self.link.report("verify", generation=verify[0], step=step,
                             checksum=self._replica_checksum())  # fmt: skip

    def _replica_checksum(self) -> str | None:
        """A checksum of the parameters when they are DDP replicas (equal on every rank)."""
        model = self._model()
        return params_checksum(model) if model is not None and self._ddp() is not None else None

    def _serve_or_receive(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        generation = int(plan["generation"])
        pulls = [int(r) for r in plan.get("pulls", [])]
        if int(plan["source"]) == self.rank and pulls:
            total = TransferStats()
            state = self._outgoing_state(plan)
            for target in pulls:
                pair = self._communicator(f"pull{target}", generation, 0, 2)
                stats = send_state(pair, state, self.device)
                # over the authenticated channel: the receiver checks what it got against it
                self.link.report("state_digest", generation=generation, target=target,
                                 digest=stats.digest)  # fmt: skip
                total.bytes += stats.bytes
                total.seconds += stats.seconds
                total.setup_seconds += stats.setup_seconds
            return _pull_report("source", total)
        if self.rank in pulls:
            pair = self._communicator(f"pull{self.rank}", generation, 1, 2)
            incoming, stats = recv_state(pair, self.device, self.device)
            self._check_digest(generation, int(plan["source"]), stats.digest)
            self._stash = incoming["state"]
            return _pull_report("receiver", stats)
        return None

    def _outgoing_state(self, plan: dict[str, Any]) -> dict[str, Any]:
        step = int(plan["step"])
        ddp_info: dict[str, Any] = {
            "layout": self.ddp_layout, "in_step": None, "in_step_index": 0,
            "ready_order": self.ready_order,
            "verify_ready_order": bool(plan.get("verify_ready_order")),
        }  # fmt: skip
        if self._ddp() is not None and self.ddp_layout is None:
            seen = self.proxy.int_broadcasts
            # rebuilt in an earlier step, or in this one (its payloads go out again, from the
            # replacement when it is their root)
            earlier = [b for b in seen if b.step is not None and b.step < step]
            ddp_info["layout"] = ddp_state.rebuild_payloads(earlier)
            pair = ddp_state.layout_pair(seen, step)
            if ddp_info["layout"] is None and pair is not None:
                ddp_info["in_step"] = ddp_state.complete_layout(seen, step)
                ddp_info["in_step_index"] = pair[0].index
        signatures = [r.signature for r in self.proxy.logged(step) if r.step == step]
        return {
            "step": step,
            "mode": plan["mode"],
            "first_step": self.first_step,
            "state": self.state_dict(),
            "ddp": ddp_info,
            "signatures": signatures if plan["mode"] == "replay" else None,
        }

    def _void(self, resume_step: int) -> None:
        """Rollback: finish the current step without the network or an optimizer update,
        then continue from ``resume_step`` with the state as of its start."""
        optimizer = self.objects.get("optimizer")
        if optimizer is not None and not self.optimizer_stepped:
            optimizer.step = lambda *_a, **_k: None  # this step's update must not happen
            self._suppressed_step = True
        self._redo_from = resume_step
        self.proxy.void()

    # ---- migration: pause at a boundary, be checkpointed, rejoin ------------------------------
    def _set_pause(self, plan: dict[str, Any]) -> None:
        """Pause at the start of ``plan["step"]``, or say this rank has already begun it."""
        assert self.link is not None
        target = int(plan["step"])
        with self._pause_lock:
            started = self._boundary
            if started is not None and started >= target:
                self.link.report("pause_refused", generation=plan["generation"], step=started)
                return
            self._pause_at = plan
            if self._paused_at is not None and self._paused_at < target:
                # paused at an earlier boundary of a superseded order: go on to this one
                self._pause_orders.put({"op": "continue", "generation": plan["generation"]})

    def _maybe_pause(self, step: int) -> None:
        with self._pause_lock:
            self._boundary = step
            plan = self._pause_at
            if plan is None or int(plan["step"]) != step:
                return
            self._pause_at = None
            self._paused_at = step
        try:
            self._paused(step, plan)
        finally:
            with self._pause_lock:
                self._paused_at = None

    def _paused(self, step: int, plan: dict[str, Any]) -> None:
        """Wait at this boundary, every collective of the last step complete, until the
        coordinator resumes the job on a new generation's communicator."""
        assert self.link is not None
        generation = int(plan["generation"])
        if self.backend == "nccl":
            # the communicator is replaced on resume; aborting it now frees the peers' mappings
            # of each other's GPU memory, which a GPU checkpoint of a moving rank needs
            self.proxy.abort_communicator(wait=True)
        self.link.report("paused", generation=generation, step=step)
        while True:
            order = self._next_pause_order()
            if order["op"] == "abort":
                raise RecoveryFailed(str(order.get("reason", "the coordinator gave up")))
            if int(order.get("generation", -1)) != generation:
                continue
            if order["op"] == "continue":
                return
            if order["op"] == "dump":
                self._be_moved(order)
            elif order["op"] == "resume":
                communicator = self._communicator("world", generation, self.rank, self.world_size)
                self.proxy.switch(communicator)
                self.link.report("resumed", generation=generation)
                return

    def _next_pause_order(self) -> dict[str, Any]:
        try:
            return self._pause_orders.get(timeout=self.env.recovery_timeout)
        except queue.Empty:
            self._die(f"paused for migration and no order came within "
                      f"{self.env.recovery_timeout:.0f} s")  # fmt: skip
            raise  # not reached

    def _be_moved(self, order: dict[str, Any]) -> None:
        """This rank is the one moving: close the connections that cannot move, let the
        agent checkpoint this process, and, restored on the target node, reconnect there."""
        assert self.link is not None
        rejoin = order["rejoin_file"]
        # before the agent hears of it: its dump may come at once. The restorer becomes the
        # parent for a moment, then exits
        outlive_parent()
        gpu, gpu_bytes = None, 0
        if self.backend == "nccl":
            torch.cuda.synchronize(self.device)
            # cached free blocks would be checkpointed, copied and restored for nothing
            torch.cuda.empty_cache()
            gpu = str(torch.cuda.get_device_properties(self.device).uuid)
            free, total = torch.cuda.mem_get_info(self.device)
            gpu_bytes = total - free  # this GPU's use: this process's, one process per GPU
        self.link.ready_for_dump(gpu, gpu_bytes)
        self.link.close()
        deadline = time.monotonic() + self.env.recovery_timeout
        while not os.path.exists(rejoin):  # the process is frozen and moved meanwhile
            if time.monotonic() > deadline:
                limit = self.env.recovery_timeout
                print(f"xmig: rank {self.rank}: not moved within {limit:.0f} s", file=sys.stderr,
                      flush=True)  # fmt: skip
                os._exit(1)
            time.sleep(0.01)
        with open(rejoin) as source:
            where = json.load(source)
        os.unlink(rejoin)
        # the restorer is still the parent for a moment; then the target node's agent (its
        # child subreaper) adopts this process, and this process must die with that agent
        while os.getppid() != int(where["agent_pid"]):
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.002)
        die_with_parent()
        self.env = dataclasses.replace(self.env, agent_addr=where["agent_addr"],
                                       node_rank=int(where["node"]))  # fmt: skip
        self.link = AgentLink(self.env, on_inject=self.injector.add, on_plan=self._on_plan)
        # the store's connection came back closed: a new one, from this node's address
        self.store = self._job_store()
        self.link.report("rejoined", generation=order["generation"],
                         netns=os.stat("/proc/self/ns/net").st_ino)  # fmt: skip

    # ---- recovery: the replacement ----------------------------------------------------------
    def _start_receiving(self) -> None:
        """A replacement receives its state while the script still builds its model."""
        self._incoming: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()

        def receive() -> None:
            try:
                pair = self._communicator(f"pull{self.rank}", self.env.generation, 1, 2)
                if self.backend == "nccl":
                    torch.cuda.set_device(self.device)  # the current device is per thread
                    # a stream of its own, so that the script's kernels on the default
                    # stream (building the model) and the transfer do not wait for each other
                    with torch.cuda.stream(torch.cuda.Stream(self.device)):
                        self._incoming.put(recv_state(pair, self.device, self.device))
                else:
                    self._incoming.put(recv_state(pair, self.device, self.device))
            except BaseException as exc:  # handed to the step loop, which reports it
                self._incoming.put((exc, None))

        self._receiver = threading.Thread(target=receive, name="xmig-receive", daemon=True)
        self._receiver.start()

    def _join(self) -> int:
        """Take the state received from a peer, match its DDP, and return the step to
        start at."""
        started = time.monotonic()
        try:
            incoming, stats = self._incoming.get(timeout=self.env.recovery_timeout)
        except queue.Empty:
            raise RecoveryFailed(
                f"no state from a peer within {self.env.recovery_timeout:.0f} s"
            ) from None
        if isinstance(incoming, BaseException):
            raise RecoveryFailed(f"receiving the state failed: {incoming}") from incoming
        self._check_digest(self.env.generation, None, stats.digest)
        waited = time.monotonic() - started
        self.load_state(incoming["state"])
        if self.backend == "nccl":
            # buffers received on the receiving thread's stream and now copied into the
            # model return to that stream's pool, which nothing allocates from again
            incoming["state"] = None
            torch.cuda.empty_cache()
        step = int(incoming["step"])
        self.first_step = incoming["first_step"]
        ddp = self._ddp()
        ddp_info = incoming["ddp"]
        if ddp is not None:
            if ddp_info["layout"] is not None:
                self.proxy.served.extend(ddp_info["layout"])
                if not ddp_state.rebuild_now(ddp):
                    raise RecoveryFailed("DDP refused to take its peers' bucket layout")
                self.ddp_layout = ddp_info["layout"]
            elif step > int(incoming["first_step"] or 0):
                ddp_state.prepare_rebuild(ddp)  # its peers rebuild in this very step
                first = int(ddp_info["in_step_index"])
                for index, payload in enumerate(ddp_info["in_step"] or [], start=first):
                    self.proxy.overrides[(step, index)] = payload
            if ddp_info.get("verify_ready_order"):
                self._verify_order = ddp_info.get("ready_order")
        if incoming["signatures"] is not None:
            self.proxy.expected[step] = incoming["signatures"]
        self.proxy.resume("normal")
        if self.link is not None:
            self.link.report(
                "recovered",
                generation=self.env.generation,
                role="replacement",
                phases={
                    "pull": stats.seconds,
                    "join": time.monotonic() - started,
                    "waited": waited,
                },  # fmt: skip
                pull=_pull_report("receiver", stats),
                t_resumed=time.time(),
            )
        self._expect_verify(self.env.generation, step)
        return step

    # ---- ending -----------------------------------------------------------------------------
    def _excepthook(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        if self.link is not None and not isinstance(exc, KeyboardInterrupt):
            self.link.report_error(exc)
        self._previous_excepthook(exc_type, exc, tb)

    def close(self) -> None:
        """Leave the job (called at exit). A rank that finished its steps stays until every
        rank has: a peer that fails in its last step recovers from this rank's state and
        replays with it. The job's own bounds end the wait (the agent stops or dies)."""
        if self.link is not None and self._finished:
            while not self._released.wait(1.0):
                pass
        if self.link is not None:
            self.link.close()
            self.link = None


def _pull_report(role: str, stats: TransferStats) -> dict[str, Any]:
    return {"role": role, "bytes": stats.bytes, "seconds": stats.seconds,
            "setup_seconds": stats.setup_seconds}  # fmt: skip


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


__all__ = ["RecoveryFailed", "ReplayMismatch", "Session", "XmigError", "init"]
