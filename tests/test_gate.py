"""The GPU gate's bookkeeping, on the CPU: a test's gate stands in for the GPU's counter, and
a communicator whose ops end when the test says so stands in for NCCL.

On a GPU the framework's stream waits for the gate; here the tests check what the proxy and
the worker decide: a gated op's future is complete at once, its gate opens only once the op
has ended well, a failed op's stays shut until a replay (or a rollback) has put its result
in, ops issued during a recovery complete on the host, and an optimizer update issued behind
a shut gate counts as not taken, its state read from the snapshot taken as it began."""

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from xmig.ccl import Communicator
from xmig.proxy import ProxyProcessGroup, replay_groups
from xmig.worker.context import WorkerContext
from xmig.worker.gates import QueuedUpdate, clone_state, queue_update, snapshot
from xmig.worker.hooks import OptimizerGate


class FakeGate:
    """The GPU's words, on the host. ``gpu_passed``: the number the GPU would have let
    through on its own (open gates pass once the collective has ended), which a close reads
    as ``passed``."""

    def __init__(self, device):
        self.device = device
        self.issued = 0
        self.released = 0
        self.releases = []
        self.ends = []  # per number: whether the GPU could open it (an end was given)
        self.closes = 0
        self.reopens = 0
        self.gpu_passed = 0

    def hold(self, end=None):
        self.issued += 1
        self.ends.append(end is not None)
        return self.issued

    def close(self):
        self.closes += 1
        return self.closes == 1 + self.reopens

    def reopen(self):
        self.reopens += 1

    @property
    def passed(self):
        return max(self.released, self.gpu_passed)

    def release(self, number, stream=None):
        self.releases.append(number)
        self.released = max(self.released, number)

    @property
    def closed(self):
        return self.released < self.issued


class FutureWork(dist.Work):
    """A work whose future fails as a broken communicator's does (``value()`` raises); or,
    with ``error`` set, whose future holds the outputs while the work itself has failed, as
    NCCL's do when a peer is lost after the launch (its futures complete at launch)."""

    def __init__(self, future):
        super().__init__()
        self._future = future
        self.error = None

    def get_future(self):
        return self._future

    def is_completed(self):
        return self._future.done()

    def exception(self):
        return None if self.error is None else RuntimeError(self.error)

    def wait(self, timeout=None):
        self._future.wait()
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class NcclLikeWork(FutureWork):
    """An NCCL work as torch hands it to Python: its exception cannot be read (torch 2.11
    has no conversion for it; later versions warn), its ``wait`` enqueues a wait on the GPU
    (which must not be called from the thread that opens the gates), and its result future
    is marked with the error as the work records it (``SUCCESS`` comes later, from the
    watchdog)."""

    def __init__(self, future):
        super().__init__(future)
        self.result = torch.futures.Future()
        self.waited = 0

    def exception(self):
        raise TypeError("Unable to convert function return value to a Python type!")

    def get_future_result(self):
        if self.error is not None and not self.result.done():
            self.result.set_result(2)  # COMM_ERROR
        return self.result

    def wait(self, timeout=None):
        self.waited += 1
        return super().wait(timeout)


class Controlled:
    """A backend whose all-reduces end when the test ends them (sums over one rank)."""

    def __init__(self, work_type=None):
        self.futures = []
        self.work_type = work_type or FutureWork

    def allreduce(self, tensors, opts=None):
        future = torch.futures.Future()
        work = self.work_type(future)
        self.futures.append((future, tensors, work))
        return work

    def end(self, index, error=None, in_work=False):
        """End op ``index``; ``error``: it failed, in its future or (``in_work``) in its work
        only, its future holding the outputs."""
        future, tensors, work = self.futures[index]
        if error is not None and not in_work:
            future.set_exception(RuntimeError(error))
            return
        work.error = error
        future.set_result(tensors)


def _gated_proxy(work_type=None):
    comm = Communicator("gloo", "world", 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    gates = []

    def make(device):
        gates.append(FakeGate(device))
        return gates[-1]

    proxy = ProxyProcessGroup(comm, gate=True, gate_factory=make)
    backend = Controlled(work_type)
    comm.backend = backend
    return proxy, backend, gates


def _until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _allreduce(proxy, tensor):
    return proxy.allreduce([tensor], dist.AllreduceOptions())


def test_a_gated_op_is_complete_at_once_and_its_gate_opens_once_it_has_ended():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(0)
    work = _allreduce(proxy, torch.ones(2))
    assert work.get_future().done()  # the framework runs ahead
    assert gates[0].issued == 1 and proxy.gates_closed()
    assert not proxy.wait_gates_open(0.1)  # the op has not ended
    backend.end(0)
    assert proxy.wait_gates_open(5.0)
    assert gates[0].releases == [1] and not proxy.shut_gates()


def test_the_boundary_counts_its_wait_and_the_ops_still_to_complete():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(0)
    for _ in range(3):
        _allreduce(proxy, torch.ones(2))
    backend.end(0)
    _until(lambda: gates[0].released == 1)
    ended = threading.Timer(0.2, lambda: (backend.end(1), backend.end(2)))
    ended.start()
    try:
        assert proxy.wait_gates_open(5.0)
    finally:
        ended.join()
    assert proxy.gate_wait_backlog == 2  # ops 1 and 2 were yet to complete
    assert proxy.gate_wait_seconds >= 0.15
    assert proxy.wait_gates_open(5.0)  # nothing left: counts nothing more
    assert proxy.gate_wait_backlog == 2


def test_gates_open_in_the_order_the_ops_end():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(0)
    for _ in range(3):
        _allreduce(proxy, torch.ones(2))
    backend.end(1)  # the waiter completes in issue order: nothing opens before op 0 ends
    time.sleep(0.05)
    assert gates[0].releases == []
    backend.end(0)
    backend.end(2)
    assert proxy.wait_gates_open(5.0)
    assert gates[0].releases == [1, 2, 3]


def test_a_failed_op_keeps_its_gate_shut_until_the_replay_puts_its_result_in():
    proxy, backend, gates = _gated_proxy()
    troubles = []
    proxy.on_trouble = troubles.append
    proxy.begin_step(4)
    tensor = torch.full((3,), 2.0)
    _allreduce(proxy, tensor)
    tensor.fill_(7.0)  # a broken in-place op may leave anything in its output
    backend.end(0, error="peer gone")
    _until(lambda: proxy.halted)
    assert troubles and gates[0].releases == []
    assert proxy.first_closed() is not None and proxy.first_closed().index == 0
    proxy.halt()
    fresh = Communicator("gloo", "world", 1, dist.HashStore(), 0, 1, timedelta(seconds=10))
    proxy.switch(fresh)
    replay_groups([proxy], 4, timeout=10.0)
    assert gates[0].releases == [1] and not proxy.gates_closed()
    assert tensor.tolist() == [2.0, 2.0, 2.0]  # the logged input, all-reduced over one rank
    assert proxy.first_closed() is None


def _host_proxy():
    comm = Communicator("gloo", "world", 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    proxy = ProxyProcessGroup(comm)
    backend = Controlled()
    comm.backend = backend
    return proxy, backend


def test_an_op_launched_again_is_not_completed_by_its_abandoned_launch():
    """A recovery takes over an op whose launch hangs and launches it again on a new
    communicator: the old launch ending late must not complete the op (its output would be
    the old communicator's, the framework's future set before the new launch ended)."""
    proxy, old = _host_proxy()
    proxy.begin_step(4)
    tensor = torch.full((2,), 6.0)
    work = _allreduce(proxy, tensor)
    _until(lambda: len(old.futures) == 1)
    first_event = proxy.pending()[0].done_event
    proxy.halt()
    fresh = Communicator("gloo", "world", 1, dist.HashStore(), 0, 1, timedelta(seconds=10))
    new = Controlled()
    fresh.backend = new
    proxy.switch(fresh)
    proxy.resume()
    _until(lambda: len(new.futures) == 1)
    record = proxy.pending()[0]
    assert record.done_event is not first_event and record.state == "launched"
    old.end(0)  # the abandoned launch ends now
    time.sleep(0.2)
    assert not work.get_future().done() and proxy.pending() == [record]
    new.end(0)
    _until(lambda: work.get_future().done())
    assert tensor.tolist() == [6.0, 6.0] and not proxy.halted


def test_an_op_whose_work_failed_under_a_complete_future_is_a_fault_not_a_result():
    """NCCL completes an op's future at its launch; a peer lost afterwards fails the work
    alone. The proxy must not hand the framework that op's output as its result (nor let
    its waiter die on it, leaving the framework's future unset for good): it halts, reports
    the fault, and the replay completes the op."""
    proxy, backend = _host_proxy()
    troubles = []
    proxy.on_trouble = troubles.append
    proxy.begin_step(3)
    tensor = torch.full((2,), 5.0)
    work = _allreduce(proxy, tensor)
    tensor.fill_(9.0)  # what a broken in-place op left
    backend.end(0, error="remote process exited", in_work=True)
    _until(lambda: proxy.halted)
    assert troubles == ["remote process exited"]
    assert not work.get_future().done()  # the framework still waits
    assert proxy.pending()[0].state == "failed" and proxy._waiter.is_alive()
    proxy.halt()
    fresh = Communicator("gloo", "world", 1, dist.HashStore(), 0, 1, timedelta(seconds=10))
    proxy.switch(fresh)
    replay_groups([proxy], 3, timeout=10.0)
    _until(lambda: work.get_future().done())
    assert tensor.tolist() == [5.0, 5.0]  # the logged input, all-reduced over one rank


def test_a_gated_op_whose_work_failed_keeps_its_gate_shut():
    proxy, backend, gates = _gated_proxy()
    troubles = []
    proxy.on_trouble = troubles.append
    proxy.begin_step(1)
    _allreduce(proxy, torch.ones(2))
    backend.end(0, error="remote process exited", in_work=True)
    _until(lambda: proxy.halted)
    assert troubles and gates[0].releases == [] and proxy.gates_closed()


def test_an_nccl_work_is_judged_by_its_result_without_a_wait():
    # its wait, which enqueues on the GPU, deadlocked a gated run (the GPU waited behind a
    # gate only the waiter opens); its exception cannot be read on torch 2.11
    proxy, backend, gates = _gated_proxy(NcclLikeWork)
    troubles = []
    proxy.on_trouble = troubles.append
    proxy.begin_step(1)
    tensor = torch.full((2,), 4.0)
    _allreduce(proxy, tensor)
    backend.end(0)  # healthy: its result future is not marked yet
    _until(lambda: gates[0].releases == [1])
    assert not proxy.halted and tensor.tolist() == [4.0, 4.0]
    _allreduce(proxy, torch.ones(2))
    backend.end(1, error="remote process exited", in_work=True)
    _until(lambda: proxy.halted)
    assert troubles == ["the communicator ended the op with COMM_ERROR"]
    assert gates[0].releases == [1] and proxy.gates_closed()
    assert [work.waited for _, _, work in backend.futures] == [0, 0]


def test_a_rollback_opens_the_gate_of_a_pending_op_with_the_ranks_own_input():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(2)
    tensor = torch.full((2,), 3.0)
    _allreduce(proxy, tensor)
    tensor.fill_(-1.0)
    proxy.halt()
    proxy.skip_rest_of_step()
    assert gates[0].releases == [1]
    assert tensor.tolist() == [3.0, 3.0]


def test_ops_issued_during_a_recovery_complete_on_the_host():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(0)
    proxy.suspend_gating()
    work = _allreduce(proxy, torch.ones(2))
    assert not work.get_future().done() and not gates  # no gate made, none used
    backend.end(0)
    _until(lambda: work.get_future().done())
    proxy.resume_gating()
    assert _allreduce(proxy, torch.ones(2)).get_future().done() and gates[0].issued == 1


def test_the_layout_broadcasts_are_not_gated():
    proxy, _backend, gates = _gated_proxy()
    proxy.communicator.backend = Communicator(
        "gloo", "world", 2, dist.HashStore(), 0, 1, timedelta(seconds=10)
    ).backend
    proxy.begin_step(0)
    tensor = torch.tensor([1, 2], dtype=torch.int32)
    proxy.broadcast([tensor], dist.BroadcastOptions()).wait()
    assert not gates


def test_a_cpu_proxy_has_no_gate_without_a_tests_factory():
    comm = Communicator("gloo", "world", 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    proxy = ProxyProcessGroup(comm, gate=True)
    proxy.begin_step(0)
    tensor = torch.ones(2)
    _allreduce(proxy, tensor).wait()
    assert not proxy.gates_closed() and not proxy._gates


# ---- the worker's side -------------------------------------------------------------------------


def test_a_snapshot_copies_host_tensors_and_the_rest():
    step = torch.tensor(4.0)
    state = {"optimizer": {"state": {0: {"step": step, "exp_avg": torch.ones(2)}},
                           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}  # fmt: skip
    taken = snapshot(state)
    step += 1
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    assert taken["optimizer"]["state"][0]["step"].item() == 4.0
    assert taken["optimizer"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.99)}
    cloned = clone_state(state)
    assert (
        cloned["optimizer"]["state"][0]["exp_avg"] is not state["optimizer"]["state"][0]["exp_avg"]
    )


def test_an_update_issued_behind_a_shut_gate_counts_as_not_taken_until_it_opens():
    proxy, backend, gates = _gated_proxy()
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param], lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ctx = SimpleNamespace(
        step=6, state_lock=threading.Lock(), optimizer_waiting=False, optimizer_stepped=False,
        env=SimpleNamespace(recovery_timeout=1.0),
        injector=SimpleNamespace(at_point=lambda step, point: None),
        groups=SimpleNamespace(proxies=lambda: [proxy]), queued_update=None,
        registry=SimpleNamespace(objects={"optimizer": optimizer, "scheduler": scheduler},
                                 streams={}),
    )  # fmt: skip

    def current():
        return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    optimizer.step()  # the step counts exist
    before = optimizer.state_dict()["state"][0]["step"].item()
    gate = OptimizerGate(ctx)
    optimizer.register_step_pre_hook(gate.before)
    optimizer.register_step_post_hook(gate.after)
    proxy.begin_step(6)
    _allreduce(proxy, torch.ones(2))  # the step's last bucket, still on the wire
    optimizer.step()
    scheduler.step()  # after the update, on the host: the learning rate halves
    queued = ctx.queued_update
    assert isinstance(queued, QueuedUpdate) and queued.pending() and ctx.optimizer_stepped
    assert optimizer.state_dict()["state"][0]["step"].item() == before + 1
    served = queued.state(current())
    assert served["optimizer"]["state"][0]["step"].item() == before
    assert served["optimizer"]["param_groups"][0]["lr"] == 0.5
    assert served["optimizer"]["param_groups"][0]["params"] == [0]
    assert served["scheduler"]["last_epoch"] == scheduler.state_dict()["last_epoch"] - 1
    # the position a recovery reports
    assert WorkerContext.state_step.fget(_position(ctx)) == 6
    backend.end(0)
    assert proxy.wait_gates_open(5.0) and not queued.pending()
    assert WorkerContext.state_step.fget(_position(ctx)) == 7
    # the next step begins with the update kept (the boundary does not let it go): it no
    # longer counts, for the position or for the state a peer pulls
    ctx.step, ctx.optimizer_stepped = 7, False
    assert ctx.queued_update is queued
    assert WorkerContext.state_step.fget(_position(ctx)) == 7
    now = current()
    stand_in = SimpleNamespace(queued_update=ctx.queued_update, state_dict=lambda: now)
    assert WorkerContext.recovery_state(stand_in) is now


def _position(ctx):
    """A stand-in WorkerContext with ``ctx``'s position (``state_step`` reads only these)."""
    stand_in = SimpleNamespace(step=ctx.step, optimizer_stepped=ctx.optimizer_stepped,
                               queued_update=ctx.queued_update)  # fmt: skip
    stand_in.update_queued = lambda: WorkerContext.update_queued(stand_in)
    return stand_in


def test_no_snapshot_when_every_gate_is_open():
    proxy, backend, _ = _gated_proxy()
    proxy.begin_step(0)
    _allreduce(proxy, torch.ones(1))
    backend.end(0)
    assert proxy.wait_gates_open(5.0)
    registry = SimpleNamespace(objects={"optimizer": None}, streams={})
    ctx = SimpleNamespace(groups=SimpleNamespace(proxies=lambda: [proxy]), registry=registry)
    assert queue_update(ctx) is None  # (an optimizer of None would fail a snapshot)


def test_a_waiter_that_fails_is_a_fault_not_a_hang():
    proxy, backend, gates = _gated_proxy()
    troubles = []
    proxy.on_trouble = troubles.append

    def broken_release(number, stream=None):
        raise RuntimeError("the driver refused the write")

    proxy.begin_step(0)
    _allreduce(proxy, torch.ones(2))
    gates[0].release = broken_release
    backend.end(0)
    _until(lambda: troubles)
    assert proxy.halted and "waiter failed" in troubles[0] and "refused" in troubles[0]
    assert gates[0].closed  # the gate stays shut: nothing reads a result not known good
    assert proxy._waiter.is_alive()  # it waits for the recovery that un-halts it


def _faulted(ops, failing, step=3):
    """A gated proxy that issued ``ops`` all-reduces in ``step``, op ``failing`` failing as
    it was issued (an injected fault)."""
    proxy, backend, gates = _gated_proxy()
    proxy.on_trouble = lambda why: None

    def before_op(step, in_step, op):
        if in_step == failing:
            raise RuntimeError("injected communication error")

    proxy.before_op = before_op
    proxy.begin_step(step)
    for _ in range(ops):
        _allreduce(proxy, torch.ones(2))
    return proxy, backend, gates


def test_gated_ops_launched_before_a_fault_still_open_their_gates():
    # their all-reduces end well: a gate left shut would hold the framework's stream while
    # the recovery aborts and makes communicators
    proxy, backend, gates = _faulted(3, failing=2)
    assert proxy.halted and gates[0].issued == 2
    threading.Timer(0.2, lambda: (backend.end(0), backend.end(1))).start()
    started = time.monotonic()
    proxy.halt(drain_s=5.0)
    assert time.monotonic() - started < 4.0
    assert gates[0].releases == [1, 2] and not proxy.gates_closed()
    assert [r.index for r, pending in proxy.to_replay(3) if pending] == [2]


def test_a_gated_op_that_does_not_end_is_taken_over_after_the_drain():
    proxy, backend, gates = _faulted(2, failing=1)
    started = time.monotonic()
    proxy.halt(drain_s=0.3)
    assert 0.25 < time.monotonic() - started < 3.0
    assert gates[0].releases == [] and proxy.gates_closed()
    backend.end(0)  # too late: the recovery replays it
    time.sleep(0.1)
    assert gates[0].releases == []
    assert [r.index for r, pending in proxy.to_replay(3) if pending] == [0, 1]


def test_a_gated_op_its_communicators_abort_ends_is_not_drained():
    """A recovery given up while its survivor drains (a later park aborts the communicator):
    NCCL then ends the ops in flight without recording an error, their outputs half-written.
    Their gates stay shut, and the ops are replayed."""
    proxy, backend, gates = _faulted(2, failing=1)
    proxy.communicator.kind = "nccl"  # (the fake backend aborts as NCCL does)
    backend.abort = lambda: [backend.end(i) for i in range(len(backend.futures))]
    halted = threading.Thread(target=proxy.halt, kwargs={"drain_s": 5.0})
    started = time.monotonic()
    halted.start()
    _until(lambda: proxy.halted)
    proxy.abort_communicator(wait=True)  # op 0 "ends well"
    halted.join(5.0)
    assert not halted.is_alive() and time.monotonic() - started < 3.0  # the drain stopped
    time.sleep(0.1)
    assert gates[0].releases == [] and proxy.gates_closed()
    assert [r.index for r, pending in proxy.to_replay(3) if pending] == [0, 1]


def test_without_a_shut_gate_halting_does_not_wait():
    proxy, _, _ = _faulted(1, failing=0)
    started = time.monotonic()
    proxy.halt(drain_s=5.0)
    assert time.monotonic() - started < 1.0


def test_an_op_that_fails_after_its_launch_is_gated_then_reported_and_replayed():
    # ``raise`` at ``completion=K``: the op is launched and its future completed behind the
    # gate, so the framework goes on; the error comes once the op has ended, as a lost
    # peer's does, and the replay of the same op then ends well
    from xmig.faults import FaultSpec
    from xmig.faults.injector import Injector

    proxy, backend, gates = _gated_proxy()
    injector = Injector(0, announce=lambda _spec: None)
    injector.add(FaultSpec("raise", 0, 4, at="completion=0"))
    proxy.before_op = injector.at_collective
    troubles = []
    proxy.on_trouble = troubles.append
    proxy.begin_step(4)
    tensor = torch.full((3,), 2.0)
    work = _allreduce(proxy, tensor)
    assert work.get_future().done()  # complete at once: behind the gate
    assert len(backend.futures) == 1  # launched
    assert not troubles and gates[0].closed
    backend.end(0)  # the op ends well on the wire; the injected error is reported then
    _until(lambda: proxy.halted)
    assert troubles and "injected communication error" in troubles[0]
    assert gates[0].releases == []
    proxy.halt()
    fresh = Communicator("gloo", "world", 1, dist.HashStore(), 0, 1, timedelta(seconds=10))
    proxy.switch(fresh)
    replay_groups([proxy], 4, timeout=10.0)
    assert gates[0].releases == [1] and not proxy.gates_closed()
    assert tensor.tolist() == [2.0, 2.0, 2.0]


def test_a_fault_closes_the_gates_and_what_the_gpu_let_through_is_done_not_replayed():
    # open gates pass on the GPU once the collective has ended, before the host has seen
    # it: the framework may have read ops 0 and 1. A recovery's halt closes the gates first;
    # those two are then done (their results stand), op 2 is pending and stays shut
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(3)
    tensors = [torch.full((2,), float(i)) for i in range(3)]
    for tensor in tensors:
        _allreduce(proxy, tensor)
    gates[0].gpu_passed = 2
    proxy.halt()
    assert gates[0].closes == 1
    assert gates[0].releases == [1, 2] and gates[0].closed
    assert [(r.index, pending) for r, pending in proxy.to_replay(3)] == [
        (0, False), (1, False), (2, True)]  # fmt: skip
    assert proxy.first_closed().index == 2
    proxy.halt()  # again (a rollback's kept groups): closed already, nothing more is done
    assert gates[0].releases == [1, 2]
    proxy.resume_gating()
    assert gates[0].reopens == 1


def test_an_op_the_gpu_did_not_let_through_is_left_to_the_drain():
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(3)
    for _ in range(2):
        _allreduce(proxy, torch.ones(2))
    threading.Timer(0.2, lambda: (backend.end(0), backend.end(1))).start()
    proxy.halt(drain_s=5.0)  # the gate closed, nothing passed on the GPU: the host drains
    assert gates[0].closes == 1 and gates[0].releases == [1, 2] and not proxy.gates_closed()


def test_a_gpu_gate_waits_for_the_collectives_end_unless_its_failure_is_to_come():
    from xmig.proxy.process_group import _end_of

    waited = []
    future = SimpleNamespace(wait=lambda: waited.append(True), done=lambda: True)
    work = SimpleNamespace(get_future=lambda: future)
    record = SimpleNamespace(device=torch.device("cuda", 0), work=work, late_error=None)
    end = _end_of(record)
    assert end is not None and not waited
    end()
    assert waited == [True]
    assert _end_of(SimpleNamespace(device=torch.device("cuda", 0), work=work,
                                   late_error="injected")) is None  # fmt: skip
    assert _end_of(SimpleNamespace(device=None, work=work, late_error=None)) is None
    pending = SimpleNamespace(get_future=lambda: SimpleNamespace(done=lambda: False))
    assert _end_of(SimpleNamespace(device=torch.device("cuda", 0), work=pending,
                                   late_error=None)) is None  # fmt: skip


def test_an_abort_of_a_communicator_with_gated_ops_in_flight_closes_the_gates_first():
    # the waiter saw an op fail and halted the proxy, and a later park aborts its
    # communicator before a recovery halted it: the abort ends the ops in flight, their
    # outputs half-written, which an open gate would let the framework read
    proxy, backend, gates = _gated_proxy()
    proxy.communicator.kind = "nccl"  # (the fake backend aborts as NCCL does)
    aborted = []
    backend.abort = lambda: aborted.append(True)
    proxy.begin_step(3)
    for _ in range(2):
        _allreduce(proxy, torch.ones(2))
    gates[0].gpu_passed = 1  # the GPU had let op 0 through
    proxy.abort_communicator(wait=True)
    assert aborted and gates[0].closes == 1
    assert gates[0].releases == [1]  # op 0 is done; op 1 stays behind its gate
    assert [r.index for r in proxy.pending()] == [1]


def test_an_abort_of_a_communicator_no_gated_op_is_in_flight_on_leaves_the_gates_open():
    # an old communicator aborted once a recovery is done, its ops re-issued on the new one
    proxy, backend, gates = _gated_proxy()
    proxy.begin_step(3)
    _allreduce(proxy, torch.ones(2))
    old = proxy.communicator
    old.kind = "nccl"
    proxy.switch(Communicator("gloo", "world", 1, dist.HashStore(), 0, 1, timedelta(seconds=10)))
    for record in proxy.pending():
        record.launched_on = id(proxy.communicator.backend)
    old.backend.abort = lambda: None
    proxy.abort_communicator(wait=True, communicator=old)
    assert gates[0].closes == 0
