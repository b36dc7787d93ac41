"""The process group the framework talks to.

Every op is logged (inputs copied before launch), launched on the current real communicator
and handed back to the framework as a Work backed by a future the proxy owns. A waiter thread
completes those futures in issue order; on a GPU with the gate on, a bucket all-reduce's
future is completed at once behind a gate on the GPU that the waiter opens
(``xmig.proxy.gate``), so the CPU runs ahead as with a plain process group. When an op
fails, the proxy halts instead of failing the framework: the framework only sees a slow
collective while the worker rebuilds the communicator and re-issues the step's ops
(``replay``), or serves the rest of the step locally (``skip_rest_of_step``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from xmig.ccl import Communicator
from xmig.ccl.wake import woken
from xmig.jobenv import LOG_ROUTES
from xmig.proxy.gate import CLOSE_SETTLE_S, GATED_OPS, GateUnavailable, StreamGate, side_stream
from xmig.proxy.oplog import (
    INPUT_ARGS,
    BufferPool,
    IntBroadcast,
    OpRecord,
    int_broadcast_payload,
    signature_of,
    tensors_in,
)

logger = logging.getLogger(__name__)

FORWARDED_OPS = tuple(INPUT_ARGS)
GPU_POLL_S = 50e-6

BeforeOp = Callable[[int | None, int, str], None]
GateFactory = Callable[[Any], Any]  # a device -> its gate (``StreamGate``)
KEPT_INT_BROADCASTS = 8
RELEASE_TIMEOUT_S = 10.0  # a healthy shutdown takes ~0.5 s
# c10d's WorkResult, the values of an NCCL work's result future
WORK_SUCCESS = 0
WORK_RESULTS = {0: "SUCCESS", 1: "TIMEOUT", 2: "COMM_ERROR", 100: "UNKNOWN"}


class OpSequence:
    """The order of the ops one process issues, across all its groups: a replay re-issues the
    groups' ops in it (a peer recomputing the step issues them in that order, and may wait in
    one group's op before it issues the next group's). Also the op's number in its step across
    the groups, which ``collective=K`` faults count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._step: int | None = None
        self._in_step = 0

    def take(self, step: int | None) -> tuple[int, int]:
        """(the op's place in the process's order, its number in ``step``)."""
        with self._lock:
            if step != self._step:
                self._step, self._in_step = step, 0
            taken = (self._next, self._in_step)
            self._next += 1
            self._in_step += 1
            return taken


class ReplayMismatch(RuntimeError):
    """An op the framework issued differs from what the survivors logged for that position."""


@dataclass
class ReplayCheck:
    """What a replay found: of the done ops it re-issued, how many came out with the result
    they first had, how many did not (the first of them named), and how many could not be
    compared."""

    compared: int = 0
    unverifiable: int = 0
    differ: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, record: OpRecord, same: bool | None) -> None:
        if same is None:
            self.unverifiable += 1
            return
        self.compared += 1
        if not same:
            self.differ.append({"step": record.step, "index": record.index, "op": record.op,
                                "group": record.group})  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {"compared": self.compared, "unverifiable": self.unverifiable,
                "differ": list(self.differ)}  # fmt: skip


class ReplayDiverged(RuntimeError):
    """A replayed op's result differs from its first one (``strict``): the step being
    recomputed is not the one the survivors took part in."""

    def __init__(self, check: ReplayCheck) -> None:
        first = check.differ[0]
        super().__init__(f"op {first['index']} of step {first['step']} ({first['op']})")
        self.check = check


class ProxyProcessGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` whose ops survive communicator failures.

    Modes: ``normal`` (forward to the communicator), ``local`` (serve every op without the
    network: a replacement's prologue, or a step rolled back). ``before_op(step, index, op)`` runs
    before each op (fault injection); ``on_trouble(text)`` is called once when an op fails;
    ``on_issue(record)`` sees each op before it goes out. ``gate``: complete the futures of
    ``GATED_OPS`` on a GPU at once, behind a gate the proxy opens once the op has ended
    well (``gate_factory`` makes a device's gate; a test's may gate CPU ops too).
    ``log_route``: where a GPU's log copies the bucket all-reduces' inputs ("inline" or
    "host", ``copies_to_host``).
    """

    def __init__(
        self,
        communicator: Communicator,
        before_op: BeforeOp | None = None,
        keep_log: bool = True,
        on_trouble: Callable[[str], None] | None = None,
        mode: str = "normal",
        on_issue: Callable[[OpRecord], None] | None = None,
        group: str = "world",
        sequence: OpSequence | None = None,
        gate: bool = False,
        gate_factory: GateFactory | None = None,
        log_route: str = "inline",
    ) -> None:
        super().__init__(communicator.rank, communicator.size)
        if log_route not in LOG_ROUTES:
            raise ValueError(f"log route {log_route!r}: expected one of {', '.join(LOG_ROUTES)}")
        self.communicator = communicator
        self.group = group  # its name in xmig's communicators (``world``, ``pg<id>``)
        self.sequence = sequence if sequence is not None else OpSequence()
        self.retired: list[Communicator] = []  # gloo cannot be destroyed while an op hangs
        self.before_op = before_op
        self.keep_log = keep_log
        self.log_route = log_route
        # the index of the last bucket all-reduce (``GATED_OPS``) of the step before, and of
        # this step so far: the "host" route copies that one on the GPU, as the step's
        # backward ends waiting for it
        self._last_large: int | None = None
        self._last_large_now: int | None = None
        self.on_trouble = on_trouble
        self.on_issue = on_issue  # sees every op as the framework issues it (xmig check)
        self.mode = mode
        self.step: int | None = None
        self.ops_in_step = 0
        self.log: list[OpRecord] = []
        self._trim_due = False  # a boundary's trim of the log is still to be done
        self.int_broadcasts: list[IntBroadcast] = []
        # ops this returns True for are served without the network, also while halted, and
        # are not logged (DDP's layout broadcasts when their root died)
        self.local_filter: Callable[[OpRecord], bool] | None = None
        self._expected: dict[int, list[str]] = {}  # step -> signatures a replacement must match
        # a replacement's: told of an op its survivors did not log, before it is refused
        self.on_mismatch: Callable[[str], None] | None = None
        self._overrides: dict[tuple[int, int], torch.Tensor] = {}
        self._served: deque[torch.Tensor] = deque()  # payloads for locally served broadcasts
        # (step, index) -> the result the op had on the survivors before the fault
        self._results: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.results_taken: list[tuple[int, int]] = []  # ops whose own result differed
        self.halted = False
        self.trouble: str | None = None
        self._buffers = BufferPool()
        self.log_copy_seconds = 0.0  # what the replay log has cost this process so far
        self.log_copy_bytes = 0
        self.issue_seconds = 0.0  # the proxy's own time in the framework's calls
        self.issued = 0
        # (gates) at the step boundaries: the time spent waiting for the step's gates to
        # open, and the ops the waiter had yet to complete as the wait began
        self.gate_wait_seconds = 0.0
        self.gate_wait_backlog = 0
        self._queue: deque[OpRecord] = deque()
        self._cv = threading.Condition()
        self.gate = gate  # the gate is wanted; ``gating``: it is used now (not in a recovery)
        self.gating = gate
        self._gate_factory: GateFactory = gate_factory or StreamGate
        self._gates: dict[Any, Any] = {}  # device -> its gate
        self._taken = False  # a recovery took the ops in flight over (``halt``)
        self._gate_cpu = gate_factory is not None  # only a test's gates stand on the CPU
        self._group_name = ""
        self._aborted: set[int] = set()  # the backends (ids) an abort was begun on
        self._waiter = threading.Thread(target=self._wait_loop, name="xmig-proxy", daemon=True)
        self._waiter.start()

    @property
    def generation(self) -> int:
        return self.communicator.generation

    # ---- c10d's accessors -------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return "xmig"

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def held_tensors(self) -> list[torch.Tensor]:
        """The framework's tensors the log holds (the ops' own: with DDP, its gradient
        buckets). A moving rank parks them with its registered state; the copies of their
        inputs it drops instead (``drop_copies_before``)."""
        with self._cv:
            return [t for record in self.log for t in tensors_in(record.args)]

    def drop_copies_before(self, step: int) -> int:
        """Drop the input copies of the logged ops of the steps before ``step`` (the bytes
        dropped). For a rank about to move at ``step``'s start, where every rank has paused:
        all of them have ended those steps, so no replay re-issues their ops (a later
        recovery replays from ``step`` on), and the move need not carry the copies (at the
        pause the log still holds two steps of them: with AdamW, a third of what a DDP rank
        parks). The records stay: a replay that reached them anyway would refuse, for want
        of their inputs, rather than go on without them."""
        dropped = 0
        with self._cv:
            pending = {id(r) for r in self._queue}
            for record in self.log:
                if (record.step is None or record.step >= step or id(record) in pending
                        or not record.inputs):  # fmt: skip
                    continue
                dropped += sum(t.numel() * t.element_size() for t in record.inputs)
                record.inputs = None
        self._buffers.clear()
        return dropped

    def drop_spare_buffers(self) -> None:
        """Give the memory kept for the log's next copies back (a moving rank's: it need not
        be moved)."""
        self._buffers.clear()

    # ---- step boundary ----------------------------------------------------------------------
    def begin_step(self, step: int, defer_trim: bool = False) -> None:
        """Op indices restart at 0; the log keeps this step and the one before it. The older
        records are dropped now, or with ``defer_trim`` by ``trim_log`` once the step's forward
        is queued: at a boundary the GPU often idles (a script that logs its loss waits for
        it), and dropping the records was 0.43 ms of a gated boundary's 1.0 ms there (H100,
        under cProfile)."""
        self.trim_log()  # one still due (the step before had no forward) goes first
        with self._cv:
            self.step = step
            self.ops_in_step = 0
            self._trim_due = True
            self._last_large, self._last_large_now = self._last_large_now, None
        if not defer_trim:
            self.trim_log()

    def trim_log(self) -> None:
        """Drop the log's records older than the step before this one, if a boundary left
        that to do: their input copies go back to the pool, the records to a thread that
        lets them go."""
        with self._cv:
            if not self._trim_due:
                return
            self._trim_due = False
            step = self.step
            self._buffers.new_step()
            kept, dropped = [], []
            for record in self.log:
                if (record.step is not None and step is not None and record.step >= step - 1
                        and (self.keep_log or record.state != "done")):  # fmt: skip
                    kept.append(record)
                else:
                    dropped.append(record)
                    if record.state == "done":
                        self._buffers.give_back(record.inputs)
                        record.inputs = None
            self.log = kept
        _let_go_later(dropped)

    # ---- issuing -----------------------------------------------------------------------------
    def _issue(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        started = time.perf_counter()
        try:
            return self._issue_op(op, args)
        finally:
            self.issue_seconds += time.perf_counter() - started
            self.issued += 1

    def _issue_op(self, op: str, args: tuple[Any, ...]) -> dist.Work:
        # in named parts, each a method: ``bench/proxy_overhead.py --split-issue`` times them
        record = self._new_record(op, args)
        injected = self._before_op(record)
        self._check_expected(record)
        self._apply_override(record)
        if self.on_issue is not None:
            self.on_issue(record)
        self._track(record)
        if self.mode == "local" or (self.local_filter is not None and self.local_filter(record)):
            self._serve_locally(record)
            return _create_work_from_future(record.future)
        if self.keep_log:
            started = time.perf_counter()
            self._log_inputs(record)
            self.log_copy_seconds += time.perf_counter() - started
            self.log_copy_bytes += sum(t.numel() * t.element_size() for t in record.inputs or [])
        self._mark_logged(record)
        trouble = self._enqueue(record, injected)
        if trouble is not None and self.on_trouble is not None:
            self.on_trouble(trouble)
        if record.gate_number is not None:
            self._complete_behind_gate(record)
        return _create_work_from_future(record.future)

    def _new_record(self, op: str, args: tuple[Any, ...]) -> OpRecord:
        """The op's record, numbered in its step and in the process's sequence, with a future
        for the framework (CUDA-aware on a GPU: whoever waits on it also waits for the GPU
        work behind it)."""
        _as_async(args)
        index = self.ops_in_step
        self.ops_in_step += 1
        seq, in_step = self.sequence.take(self.step)
        device = next((t.device for t in tensors_in(args) if t.is_cuda), None)
        future = torch.futures.Future(devices=[device]) if device else torch.futures.Future()
        record = OpRecord(self.step, index, op, args, signature_of(op, args), future,
                          group=self.group, seq=seq)  # fmt: skip
        record.device = device
        record.in_sequence = in_step
        return record

    def _before_op(self, record: OpRecord) -> BaseException | None:
        """Run the fault injector's hook; the communication error it raised for this op
        (absorbed: the op fails), or None. One it raises to fail after the launch is kept
        on the record."""
        if self.before_op is None:
            return None
        try:
            self.before_op(self.step, record.in_sequence, record.op)
        except Exception as exc:  # an injected communication error: the proxy absorbs it
            if getattr(exc, "after_launch", False):
                record.late_error = str(exc)  # launched, and failed once it has ended
                return None
            return exc
        return None

    def _check_expected(self, record: OpRecord) -> None:
        """A replacement's op must be the one its survivors logged at that place: refused
        (``ReplayMismatch``) otherwise."""
        expected = self._expected.get(self.step) if self.step is not None else None
        index = record.index
        if expected is None or index >= len(expected) or expected[index] == record.signature:
            return
        why = (f"op {index} of step {self.step} is {record.signature}, but the survivors "
               f"logged {expected[index]}")  # fmt: skip
        if self.on_mismatch is not None:
            self.on_mismatch(why)
        raise ReplayMismatch(f"{why}; refusing to issue it")

    def _apply_override(self, record: OpRecord) -> None:
        """A broadcast whose payload a recovery set: its input is that payload."""
        if self.step is None or not self._overrides:
            return
        override = self._overrides.pop((self.step, record.index), None)
        if override is not None:
            with torch.no_grad():
                tensors_in(record.args[0])[0].copy_(override)

    def _mark_logged(self, record: OpRecord) -> None:
        """On a GPU, with gates or copies on the log's stream: an event once the op's inputs
        are logged."""
        if record.device is not None and (self.gate or record.log_stream is not None):
            record.logged_event = torch.cuda.Event()
            record.logged_event.record(record.log_stream)

    def _enqueue(self, record: OpRecord, injected: BaseException | None) -> str | None:
        """Into the log and the waiter's queue; launched at once when every op before it is
        (and held behind its device's gate, gates on). The trouble to report, if this op
        halts the proxy (an injected error)."""
        trouble = None
        with self._cv:
            self.log.append(record)
            self._queue.append(record)
            earlier = [r for r in self._queue if r is not record]
            if injected is not None:
                # this op never reaches the communicator: nothing after it may either, or
                # the ranks' op sequences would pair up wrongly
                record.state, record.error = "failed", str(injected)
                record.done_event.set()
                if not self.halted:
                    self.halted, trouble = True, record.error
                    self.trouble = trouble
            elif not self.halted and all(r.state == "launched" for r in earlier):
                self._launch(record)
                if record.state == "launched" and self.gating and record.op in GATED_OPS:
                    gate = self._gate_of(record.device)
                    if gate is not None:
                        record.gate, record.gate_number = gate, gate.hold(_end_of(record))
            self._cv.notify_all()
        return trouble

    def _complete_behind_gate(self, record: OpRecord) -> None:
        """The framework's future done now, its event recorded on the gate's stream: whoever
        waits for it waits for the gate to open."""
        with _on_stream(record.device, record.gate):
            record.future.set_result(record.outputs_of(record.args))

    def _gate_of(self, device: Any) -> Any:
        """The gate of ``device`` (made on first use), or None where there can be none."""
        if device is None and not self._gate_cpu:
            return None
        gate = self._gates.get(device)
        if gate is None and device not in self._gates:
            try:
                gate = self._gate_factory(device)
                if device is not None:
                    side_stream(device, _WAITER)  # made here, on a thread with a context
            except GateUnavailable as exc:
                logger.warning("the GPU gate is off: %s; collectives complete on the host", exc)
                gate = None
            self._gates[device] = gate
        return gate

    def gates_closed(self) -> bool:
        """Whether an op's gate is still shut (its collective not yet known to be done)."""
        return any(g is not None and g.closed for g in list(self._gates.values()))

    def shut_gates(self) -> list[Any]:
        """The gates some op's number has not opened yet."""
        return [g for g in list(self._gates.values()) if g is not None and g.closed]

    def wait_gates_open(self, timeout: float) -> bool:
        """Wait until every gated op has ended well (False after ``timeout`` seconds): at a
        step boundary, so that no op of the step ends (or fails) after the next began."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            with self._cv:
                self.gate_wait_backlog += len(self._queue)
                while self.gates_closed():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cv.wait(remaining)
            return True
        finally:
            self.gate_wait_seconds += time.perf_counter() - started

    def first_closed(self) -> OpRecord | None:
        """The earliest op whose gate is still shut."""
        with self._cv:
            return next((r for r in self._queue if r.gate_number is not None
                         and r.gate.released < r.gate_number), None)  # fmt: skip

    def suspend_gating(self) -> None:
        """Ops issued from now on complete on the host (a recovery is under way)."""
        with self._cv:
            self.gating = False

    def resume_gating(self) -> None:
        """Ops are gated again; the gates open on the GPU again once what they held back
        has been released."""
        with self._cv:
            self.gating = self.gate
            for gate in self._gates.values():
                if gate is not None:
                    gate.reopen()

    def _close_gates(self) -> list[Any]:
        """Close every gate: no op passes on the GPU beyond what the host has seen end well
        (a recovery begins; communicators may be aborted from now on). The gates that were
        open, for ``_complete_passed``."""
        return [g for g in list(self._gates.values()) if g is not None and g.close()]

    def _complete_passed(self, opened: list[Any]) -> None:
        """Complete as done the gated ops that the ``opened`` gates had let the framework
        read on the GPU before their close: their collectives had ended before any
        communicator could be aborted, so well, and the framework has read their results (a
        recovery must not re-issue them for real)."""
        if not opened:
            return
        time.sleep(CLOSE_SETTLE_S)
        passed = {id(g): g.passed for g in opened}
        with self._cv:
            for record in list(self._queue):
                if (record.gate_number is None or record.work is None
                        or record.gate_number > passed.get(id(record.gate), 0)):  # fmt: skip
                    continue
                self._queue.remove(record)
                record.state, record.error = "done", None
                self._remember(record)
                record.gate.release(record.gate_number)
                logger.info("group %s: op %d of step %s had passed its gate on the GPU: done",
                            self.group, record.index, record.step)  # fmt: skip
            self._cv.notify_all()

    def _release(self, record: OpRecord, wrote_outputs: bool = False) -> None:
        """Open ``record``'s gate (once the GPU work this thread queued into its outputs is
        done, if it queued any), and wake whoever waits for the gates."""
        after = None
        if wrote_outputs and record.device is not None:
            after = torch.cuda.current_stream(record.device)
        record.gate.release(record.gate_number, after)
        with self._cv:
            self._cv.notify_all()

    def _log_inputs(self, record: OpRecord) -> None:
        # route "inline": on GPU the copies run on the issuing thread's stream, before the
        # launch; NCCL's stream waits for them, and so does a replay. Route "host": a bucket
        # all-reduce's copy goes into pinned host memory on the log's own stream, through the
        # copy engines beside the backward's kernels, and the op is launched from that stream
        # so that NCCL waits for the copy and the framework does not (behind the gate on an
        # H100: 1.0042-1.0113 of plain DDP against inline's 1.0078-1.0108). The step's last
        # bucket stays on the GPU: the backward's end waits for it. So does every other op:
        # DDP waits for the forward's broadcast on the host at once, and a copy of it
        # through host memory put the copy engines' time into the step (1.0166-1.0190)
        if record.op in GATED_OPS:
            self._last_large_now = record.index
        if not copies_to_host(self.log_route, record.device is not None, record.op,
                              record.index, self._last_large):  # fmt: skip
            record.inputs = [self._buffers.copy_of(t) for t in record.input_tensors]
            return
        stream = side_stream(record.device, _LOG)
        stream.wait_stream(torch.cuda.current_stream(record.device))
        with torch.cuda.stream(stream):
            record.inputs = [self._buffers.copy_of(t, host=True) for t in record.input_tensors]
        record.log_stream = stream

    def _launch(self, record: OpRecord, args: tuple[Any, ...] | None = None) -> None:
        try:
            # from the log's stream where the copies ran there: NCCL waits for them
            stream = (torch.cuda.stream(record.log_stream) if record.log_stream is not None
                      else contextlib.nullcontext())  # fmt: skip
            with stream:
                work = getattr(self.communicator.backend, record.op)(*(args or record.args))
        except Exception as exc:  # a communicator that is already broken
            record.state, record.error = "failed", str(exc)
            record.done_event.set()
            return
        if record.launched_on is not None or record.done_event.is_set():
            # launched before (a replay): that launch's late callback must not set this one's
            # event (the first launch takes the record's own: one Event less an op)
            record.done_event = threading.Event()
        record.work = work
        record.launched_on = id(self.communicator.backend)
        record.state = "launched"
        _when_done(work, record.done_event.set)

    def _track(self, record: OpRecord) -> None:
        payload = int_broadcast_payload(record.op, record.args)
        if payload is None:
            return
        record.int_broadcast = IntBroadcast(record.step, record.index, payload.detach().clone())
        with self._cv:
            self.int_broadcasts.append(record.int_broadcast)
            del self.int_broadcasts[:-KEPT_INT_BROADCASTS]

    def _serve_locally(self, record: OpRecord) -> None:
        if record.op == "broadcast" and self._served:
            with torch.no_grad():
                tensors_in(record.args[0])[0].copy_(self._served.popleft())
        outputs = record.serve_locally(self.size())
        record.state = "done"
        if record.int_broadcast is not None:
            record.int_broadcast.local = True
            record.int_broadcast.received = tensors_in(record.args[0])[0].detach().clone()
        if record.gate_number is not None:  # its future was completed behind the gate
            self._release(record, wrote_outputs=True)
        else:
            record.future.set_result(outputs)

    # ---- completing -------------------------------------------------------------------------
    def _wait_loop(self) -> None:
        while True:
            try:
                self._complete_in_order()
            except Exception as exc:  # a dead waiter would leave every op hanging: a fault
                logger.exception("the proxy's waiter failed")
                with self._cv:
                    self.halted = True
                    self.trouble = f"the proxy's waiter failed: {type(exc).__name__}: {exc}"
                    trouble, callback = self.trouble, self.on_trouble
                if callback is not None:
                    callback(trouble)

    def _draining(self, record: OpRecord) -> bool:
        """Whether the waiter still completes ``record`` while the proxy is halted: a gated op
        that was launched before the fault and that no recovery took over yet (it may well
        end well; its gate must not stay shut for nothing, see ``halt``). Not once its
        communicator is being aborted: NCCL then ends the op without recording an error, and
        its output may be half-written."""
        return (record.gate_number is not None and record.state == "launched"
                and not self._taken and record.launched_on not in self._aborted)  # fmt: skip

    def _complete_in_order(self) -> None:
        while True:
            with self._cv:
                while not self._queue or (self.halted and not self._draining(self._queue[0])):
                    self._cv.wait()
                record = self._queue[0]
                if record.state == "queued":
                    self._launch(record)
                event, work = record.done_event, record.work
            event.wait()
            if record.device is not None and work is not None:
                # NCCL marks its future done at launch; an op has finished only once its GPU
                # work has. Completing earlier would let the framework run ahead of a
                # collective that a fault can still break (and read its half-written output).
                # (a gated op drained after a fault must have ended on the GPU too)
                while (record.work is work and not work.is_completed()
                       and not (self.halted and not self._draining(record))):  # fmt: skip
                    time.sleep(GPU_POLL_S)
            with _on_stream(record.device, record.gate and _WAITER), self._cv:
                if self.halted and not self._draining(record):
                    continue  # recovery took this op over
                if not self._queue or self._queue[0] is not record:
                    continue
                if record.work is not work:
                    continue
                error = record.error
                if error is None and record.late_error is not None:
                    error, record.late_error = record.late_error, None  # once: not in a replay
                if error is None:
                    try:
                        value = _value(record.work, record.outputs_of(record.args))  # type: ignore[arg-type]
                    except Exception as exc:
                        error = str(exc)
                    else:
                        error = _work_error(record.work)  # type: ignore[arg-type]
                if error is not None:
                    record.state, record.error = "failed", error
                    # (an op drained after the fault that also failed: reported once)
                    callback = None if self.halted else self.on_trouble
                    self.halted = True
                    self.trouble = self.trouble or error
                else:
                    self._queue.popleft()
                    record.state = "done"
                    # (gated: on the waiter's stream, which then opens the gate)
                    took = self._take_result(record)
                    self._remember(record)
                    callback = None
                    if record.gate_number is not None:
                        # under the lock: a recovery that halts finds the op either still
                        # queued with its gate shut, or done with its gate open
                        self._release(record, wrote_outputs=took)
            if callback is not None:
                callback(error)
            elif error is None and record.gate_number is None:
                _complete(record, record.work, value)

    def _remember(self, record: OpRecord) -> None:
        record.note_outputs()
        if record.int_broadcast is not None:
            record.int_broadcast.received = tensors_in(record.args[0])[0].detach().clone()
        if not self.keep_log:
            record.inputs = None

    # ---- what a replacement takes from its peers ---------------------------------------------
    def serve_broadcasts(self, payloads: Iterable[torch.Tensor]) -> None:
        """The next broadcasts served locally take these payloads, in order (DDP's bucket
        layout, as the peers took it)."""
        with self._cv:
            self._served.extend(payloads)

    @contextlib.contextmanager
    def locally(self) -> Iterator[None]:
        """Every op issued meanwhile is served without the network (a fresh DDP taking a
        layout every rank already holds)."""
        with self._cv:
            mode, self.mode = self.mode, "local"
        try:
            yield
        finally:
            with self._cv:
                self.mode = mode

    def override_broadcast(self, step: int, index: int, payload: torch.Tensor) -> None:
        """Op ``index`` of ``step`` (a broadcast) goes out with ``payload`` as its input."""
        with self._cv:
            self._overrides[(step, index)] = payload

    def expect_results(self, results: dict[tuple[int, int], list[torch.Tensor]]) -> None:
        """Ops of these (step, index) end with these results, the survivors' from before the
        fault: the replicas stay alike even where this rank's inputs were not the failed
        rank's (which the survivors' replay finds and reports)."""
        with self._cv:
            self._results.update(results)

    def _take_result(self, record: OpRecord) -> bool:
        """Put the result its peers had into ``record``'s outputs, if one was handed over:
        whether it did."""
        if record.step is None:
            return False
        expected = self._results.pop((record.step, record.index), None)
        if expected is not None and record.take_result(expected):
            self.results_taken.append((record.step, record.index))
            return True
        return False

    def expect_signatures(self, step: int, signatures: list[str]) -> None:
        """The ops of ``step`` must have these signatures, in order: one that differs is
        refused (``ReplayMismatch``) instead of issued."""
        with self._cv:
            self._expected[step] = list(signatures)

    # ---- recovery primitives (called by the worker's recovery thread) ------------------------
    def halt(self, drain_s: float = 0.0) -> None:
        """Stop launching; ops in flight are abandoned (their results no longer count). With
        ``drain_s``, while a gate is shut, first wait that long at most for the gated ops in
        flight to end: a gate left shut holds the framework's stream, and aborting or making
        a communicator then can wait on the device for good."""
        opened = self._close_gates()  # before anything may abort a communicator
        with self._cv:
            self.halted = True
        self._complete_passed(opened)
        with self._cv:
            deadline = time.monotonic() + drain_s
            while (self._queue and self._draining(self._queue[0])
                   and (left := deadline - time.monotonic()) > 0):  # fmt: skip
                self._cv.wait(left)
            self._taken = True
            for record in self._queue:
                record.state, record.work = "queued", None
                record.done_event.set()  # wakes the waiter if it waits on this op
            self._cv.notify_all()

    def abort_communicator(self, wait: bool = False, communicator: Communicator | None = None
                           ) -> None:  # fmt: skip
        """Abort the current communicator (or ``communicator``, one this proxy used before) so
        ops stuck in it return (NCCL); gloo ops cannot be aborted and are abandoned instead
        (they end at their timeout).

        NCCL's abort releases the kernels in flight within milliseconds but takes ~0.5 s to
        return (measured on H200), so it runs on a thread of its own and nothing waits for
        it (unless ``wait``): the communicator is never used again."""
        communicator = communicator or self.communicator
        backend = communicator.backend
        if communicator.kind != "nccl" or not hasattr(backend, "abort"):
            return
        with self._cv:
            in_flight = any(r.gate_number is not None and r.launched_on == id(backend)
                            for r in self._queue)  # fmt: skip
        if in_flight:  # (not halted first, as when the waiter saw an op fail): the abort
            # ends those ops' collectives, their outputs half-written, and an open gate
            # would let the framework read them
            self._complete_passed(self._close_gates())
        with self._cv:
            # before the abort begins: the ops in flight on it are drained no more (``halt``)
            self._aborted.add(id(backend))
            self._cv.notify_all()

        def abort() -> None:
            with contextlib.suppress(Exception), woken():  # an already broken communicator
                backend.abort()

        if wait:
            abort()
        else:
            thread = threading.Thread(target=abort, name="xmig-abort", daemon=True)
            with _ABORTS_LOCK:
                _ABORTS.append(thread)
            thread.start()

    def release_communicator(self, timeout_s: float = RELEASE_TIMEOUT_S) -> str:
        """Close a healthy NCCL communicator at a boundary where every rank of it does the
        same (a planned pause): NCCL's shutdown flushes and frees it in ~0.5 s where its abort
        takes ~1.0 s (1-rank, H200). A shutdown that raises or has not returned within
        ``timeout_s`` falls back to the abort. Returns how it ended: "shutdown", "abort", or
        "none" (gloo: nothing to free)."""
        backend = self.communicator.backend
        if self.communicator.kind != "nccl" or not hasattr(backend, "abort"):
            return "none"
        if id(backend) in self._aborted:
            # aborted already (a shrink's survivors, before their pause): a shutdown would
            # wait for the peer that is gone until its timeout
            return "abort"
        if not hasattr(backend, "shutdown"):
            self.abort_communicator(wait=True)
            return "abort"
        failed: list[BaseException] = []

        def shutdown() -> None:
            try:
                backend.shutdown()
            except Exception as exc:  # noqa: BLE001 - any failure means: abort instead
                failed.append(exc)

        thread = threading.Thread(target=shutdown, name="xmig-shutdown", daemon=True)
        with woken():  # NCCL's socket service would wait out the rest of a 0.5 s period
            thread.start()
            thread.join(timeout_s)
        if thread.is_alive() or failed:
            why = f"raised {failed[0]!r}" if failed else f"had not returned in {timeout_s:.0f} s"
            logger.warning("group %s: the communicator's shutdown %s; aborting it", self.group, why)
            self.abort_communicator(wait=True)
            return "abort"
        return "shutdown"

    def serve_pending_locally(self) -> None:
        """Serve the pending ops that ``local_filter`` picks without the network (their
        input as this rank put it in) and drop them from the log."""
        with self._cv:
            picked = [r for r in self._queue if self.local_filter and self.local_filter(r)]
            for record in picked:
                self._queue.remove(record)
                if record in self.log:
                    self.log.remove(record)
                if record.int_broadcast is not None:  # a failed receive may have written in it
                    with torch.no_grad():
                        tensors_in(record.args[0])[0].copy_(record.int_broadcast.sent)
                else:
                    _after_logged(record)
                    record.restore_inputs()
                self._serve_locally(record)
            self._cv.notify_all()

    def forget(self, records: list[OpRecord]) -> None:
        """Drop done ops from the log: a replay does not re-issue them."""
        with self._cv:
            self.log = [r for r in self.log if r not in records]

    def done_results(self, from_step: int) -> dict[tuple[int, int], list[torch.Tensor]]:
        """The results of the logged ops of ``from_step`` and later that completed, where
        their outputs still hold them: (step, index) -> its output tensors."""
        with self._cv:
            pending = {id(r) for r in self._queue}
            records = [r for r in self.log if r.step is not None and r.step >= from_step
                       and r.state == "done" and id(r) not in pending]  # fmt: skip
        return {(r.step, r.index): r.outputs_of(r.args) for r in records if r.outputs_intact()}

    def pending(self) -> list[OpRecord]:
        with self._cv:
            return list(self._queue)

    def logged(self, from_step: int) -> list[OpRecord]:
        """Logged ops of ``from_step`` and later, in issue order (done and pending)."""
        with self._cv:
            return [r for r in self.log if r.step is not None and r.step >= from_step]

    def switch(self, communicator: Communicator) -> None:
        """Adopt a new generation's communicator; the old one is kept, never destroyed:
        gloo's destructor would wait for (or crash on) an op abandoned in it."""
        with self._cv:
            old = self.communicator
            self.retired.append(old)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(old.backend))  # not even at exit
            self.communicator = communicator

    def replay(self, from_step: int, timeout: float, strict: bool = False) -> ReplayCheck:
        """This group's part of ``replay_groups``."""
        return replay_groups([self], from_step, timeout, strict)

    def to_replay(self, from_step: int) -> list[tuple[OpRecord, bool]]:
        """The logged ops of ``from_step`` and later, each with whether it is still pending."""
        records = self.logged(from_step)
        with self._cv:
            pending_ids = {id(r) for r in self._queue}
            older = [r for r in self._queue if r.step is None or r.step < from_step]
        if older:
            raise RuntimeError(
                f"op {older[0].index} of step {older[0].step} of group {self.group} is still "
                f"pending but the job resumes at step {from_step}"
            )
        return [(record, id(record) in pending_ids) for record in records]

    def replay_one(self, record: OpRecord, pending: bool, timeout: float) -> bool | None:
        """Re-issue one logged op: a done one with its logged inputs into scratch outputs
        (returns whether its result is its first one, None if that cannot be told), a pending
        one for real (its result completes the framework's future; returns None)."""
        _after_logged(record)
        if not pending:
            if record.inputs is None:
                raise RuntimeError(f"op {record.index} of step {record.step} was not logged")
            scratch = record.scratch_args()
            work = getattr(self.communicator.backend, record.op)(*scratch)
            self._wait(work, timeout, record)
            return record.compare_replay(scratch)
        record.restore_inputs()
        work = getattr(self.communicator.backend, record.op)(*record.args)
        self._wait(work, timeout, record)
        value = _value(work, record.outputs_of(record.args))
        with self._cv:
            self._queue.remove(record)
            record.state, record.error, record.work = "done", None, work
            self._remember(record)
        if record.gate_number is not None:  # its future was completed behind the gate
            self._release(record)
        else:
            _complete(record, work, value)
        return None

    @staticmethod
    def _wait(work: dist.Work, timeout: float, record: OpRecord) -> None:
        done = threading.Event()
        _when_done(work, done.set)
        deadline = time.monotonic() + timeout
        finished = done.wait(timeout)
        if finished and record.device is not None:
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(GPU_POLL_S)
            finished = work.is_completed()
        if not finished:
            raise TimeoutError(
                f"re-issued op {record.index} of step {record.step} ({record.op}) did not "
                f"complete within {timeout:.0f} s"
            )
        _value(work)  # raises if it failed
        failure = _work_error(work)
        if failure is not None:
            raise RuntimeError(f"re-issued op {record.index} of step {record.step} "
                               f"({record.op}) failed: {failure}")  # fmt: skip

    def skip_rest_of_step(self) -> None:
        """Serve pending and future ops of this step without the network (a step rolled back:
        it will be redone)."""
        with self._cv:
            pending = list(self._queue)
            self._queue.clear()
            self.mode = "local"
        for record in pending:
            _after_logged(record)
            record.restore_inputs()
            self._serve_locally(record)

    def resume(self, mode: str = "normal") -> None:
        """Leave recovery: queued ops are launched on the current communicator, in order."""
        with self._cv:
            self.mode = mode
            self.halted = False
            self._taken = False
            self.trouble = None
            self.gating = self.gate
            for record in self._queue:
                record.state, record.error, record.work = "queued", None, None
                record.done_event = threading.Event()
            self._cv.notify_all()


def replay_groups(
    proxies: list[ProxyProcessGroup], from_step: int, timeout: float, strict: bool = False
) -> ReplayCheck:
    """Re-issue every logged op of ``from_step`` and later of these groups on their current
    communicators, in the order this process first issued them (``OpSequence``): done ops
    with their logged inputs, pending ops for real (their results complete the framework's
    futures). A done op's new result must be bit for bit its first one (the peers that
    recompute the step put in what their failed ranks put in): what differs is counted (the
    replacements end such ops with the first result, which they were sent), and with
    ``strict`` stops the replay (``ReplayDiverged``) before anything the framework waits for
    completes."""
    started = time.monotonic()
    check = ReplayCheck()
    work = [(proxy, record, pending) for proxy in proxies
            for record, pending in proxy.to_replay(from_step)]  # fmt: skip
    work.sort(key=lambda item: item[1].seq)
    # the logged copies, made on the framework's stream: with the gate on, each op waits for
    # its own (the framework's stream may be held by a gate this replay opens)
    for device in {r.device for _, r, _ in work if r.device is not None and r.logged_event is None}:
        torch.cuda.synchronize(device)
    for proxy, record, pending in work:
        same = proxy.replay_one(record, pending, timeout)
        if pending:
            continue
        check.add(record, same)
        if strict and check.differ:
            check.seconds = time.monotonic() - started
            raise ReplayDiverged(check)
    check.seconds = time.monotonic() - started
    return check


# communicators being aborted on threads of their own; the process must not exit under one
# (a thread that ends inside NCCL's abort at exit ends the process with std::terminate)
_ABORTS: list[threading.Thread] = []
_ABORTS_LOCK = threading.Lock()


def wait_for_aborts(timeout: float) -> bool:
    """Wait, at most ``timeout`` seconds in all, for the communicators being aborted; False
    if one is still in its abort."""
    deadline = time.monotonic() + timeout
    with _ABORTS_LOCK:
        pending = list(_ABORTS)
    for thread in pending:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _ABORTS_LOCK:
        _ABORTS[:] = [t for t in _ABORTS if t.is_alive()]
        return not _ABORTS


def copies_to_host(route: str, on_gpu: bool, op: str, index: int, last: int | None) -> bool:
    """Whether the log copies op ``index`` of a step into host memory on its own stream: on
    the "host" route, a GPU's bucket all-reduces (``GATED_OPS``) but the step's last (its
    index in the step before, ``last``), which the backward's end waits for."""
    return route == "host" and on_gpu and op in GATED_OPS and index != last


_WAITER = "proxy-waiter"
_LOG = "proxy-log"

# the records a step boundary drops are let go on a thread of their own: destroying their
# works and CUDA-aware futures took about half of a boundary on an H200 (0.6 ms a step,
# while the GPU waits for the next step's first kernels)
_LET_GO: queue.SimpleQueue[list[OpRecord]] = queue.SimpleQueue()
_LET_GO_STARTED = threading.Event()
_LET_GO_LOCK = threading.Lock()
# batches handed to the thread and not yet let go; the process must not exit under one (a
# thread killed at exit while it destroys a work ends the process with std::terminate)
_LET_GO_PENDING = [0]
_LET_GO_DONE = threading.Condition(_LET_GO_LOCK)


def _let_go_later(records: list[OpRecord]) -> None:
    if not records:
        return
    with _LET_GO_LOCK:
        if not _LET_GO_STARTED.is_set():
            threading.Thread(target=_let_go, name="xmig-let-go", daemon=True).start()
            _LET_GO_STARTED.set()
        _LET_GO_PENDING[0] += 1
    _LET_GO.put(records)


def _let_go() -> None:
    while True:
        records = _LET_GO.get()
        while records:  # one at a time: the step loop gets the interpreter in between
            records.pop()
        del records
        with _LET_GO_DONE:
            _LET_GO_PENDING[0] -= 1
            _LET_GO_DONE.notify_all()


def wait_let_go(timeout: float) -> bool:
    """Wait, at most ``timeout`` seconds, until the records handed off have been let go;
    False if some are left."""
    with _LET_GO_DONE:
        return _LET_GO_DONE.wait_for(lambda: _LET_GO_PENDING[0] == 0, timeout)


def _on_stream(device: Any, role: Any) -> contextlib.AbstractContextManager[Any]:
    """Run on a stream of the proxy's own (``role`` a name) or a gate's stream (``role`` a
    gate); nothing to do on the CPU or without a role."""
    if device is None or not role:
        return contextlib.nullcontext()
    stream = role.stream if hasattr(role, "stream") else side_stream(device, role)
    return torch.cuda.stream(stream)


def _end_of(record: OpRecord) -> Callable[[], None] | None:
    """What makes the current stream wait for ``record``'s collective to end on the GPU (its
    future's events), for a gate that opens there; None where only the host may open it (an
    op whose failure is to be reported once it has ended; a work whose future is not yet
    complete: NCCL completes its futures at the launch, and waiting for one that is not
    would wait on the host)."""
    work = record.work
    if record.device is None or work is None or record.late_error is not None:
        return None
    future = work.get_future()
    if not future.done():
        return None
    return future.wait


def _after_logged(record: OpRecord) -> None:
    """The current stream waits for ``record``'s inputs to be logged (gates on)."""
    if record.logged_event is not None:
        torch.cuda.current_stream(record.device).wait_event(record.logged_event)


def _as_async(args: tuple[Any, ...]) -> None:
    """Ask the communicator for a work it completes later, whatever the framework asked for.
    c10d passes ``async_op=False`` on as the options' ``asyncOp``, and NCCL then runs the op
    on the caller's stream and returns no work (torch 2.11): the proxy would have nothing to
    wait on, and a replay nothing to re-issue it through."""
    for arg in args:
        if getattr(arg, "asyncOp", True) is False:
            arg.asyncOp = True


def _when_done(work: dist.Work, callback: Callable[[], None]) -> None:
    """Call ``callback`` once ``work``'s future is done (NCCL's at the launch: the caller then
    watches its GPU work), or once a work without one has ended. Some of gloo's works have no
    future (``_reduce_scatter_base``): a thread of their own waits for those, so that nobody
    who must stay free to be halted waits inside one (an op abandoned by a recovery keeps
    its thread until the communicator's timeout)."""
    try:
        future = work.get_future()
    except RuntimeError:

        def wait() -> None:
            with contextlib.suppress(Exception):  # its error is read by _value
                work.wait()
            callback()

        threading.Thread(target=wait, name="xmig-work", daemon=True).start()
        return
    future.add_done_callback(lambda _f: callback())


def _value(work: dist.Work, outputs: list[torch.Tensor] | None = None) -> Any:
    """What the work's future holds (its output tensors; ``outputs`` for a work without a
    future); raises if the op failed."""
    try:
        future = work.get_future()
    except RuntimeError:
        work.wait()  # it has ended: raises if it failed
        return outputs or []
    return future.value()


def _work_error(work: dist.Work) -> str | None:
    """The error of an op whose future does not tell it: NCCL completes its futures at
    launch, and a collective that a lost peer breaks afterwards fails only in its work. NCCL
    marks the work's result future with the error as it records it (``SUCCESS`` comes later,
    from its watchdog, so an unmarked result is no error): read there, not through ``wait``,
    which enqueues a wait on the GPU and so blocked while the GPU waited behind a gate that
    only this thread opens (a gated run deadlocked on it, H100); nor through ``exception()``,
    which torch 2.11 cannot hand to Python and later versions warn about. Other backends'
    works have no result future; their ``wait`` returns at once once they have completed."""
    try:
        result = work.get_future_result()
    except RuntimeError:
        try:
            work.wait()
        except Exception as exc:
            return str(exc) or type(exc).__name__
        return None
    if result is None or not result.done():  # (a work made without one: nothing known)
        return None
    try:
        code = int(result.value())
    except Exception as exc:
        return str(exc) or type(exc).__name__
    if code == WORK_SUCCESS:
        return None
    return f"the communicator ended the op with {WORK_RESULTS.get(code, code)}"


def _complete(record: OpRecord, work: dist.Work | None, value: Any) -> None:
    """Hand the framework its result. On GPU the completing thread's stream first waits for
    the op (NCCL marks its futures done at launch), so the CUDA-aware future's event covers it."""
    if record.device is None or work is None:
        record.future.set_result(value)
        return
    with torch.cuda.device(record.device):
        try:
            work.wait()  # a stream wait, not a CPU wait
        except Exception as exc:
            # the op had ended well on the GPU (``_work_error`` found nothing then): the error
            # is the communicator's, met by a later op, which reports it. Its result stands,
            # and the framework must have it, or its step would wait for good
            logger.debug("op %d of step %s (%s): %s, after it had ended", record.index,
                         record.step, record.op, exc)  # fmt: skip
        record.future.set_result(value)


def _forwarder(op: str) -> Callable[..., dist.Work]:
    def forward(self: ProxyProcessGroup, *args: Any) -> dist.Work:
        return self._issue(op, args)

    forward.__name__ = op
    forward.__doc__ = f"Issue ``{op}`` through the proxy."
    return forward


for _op in FORWARDED_OPS:
    setattr(ProxyProcessGroup, _op, _forwarder(_op))

# torch 2.13's names for ops c10d has had under other names (its functions call these on the
# group): issued, logged and replayed as the ops they are, so that logs compare across versions
ALIASES = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
for _alias, _op in ALIASES.items():
    setattr(ProxyProcessGroup, _alias, _forwarder(_op))
