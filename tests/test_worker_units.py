"""The worker's parts on their own: its phases, the one consumer of orders, the link's
decoding of what the agent pushes, the rollback's optimizer gate, the migration's pause
orders and the proxy's inputs from a recovery."""

import logging
import os
import threading
import time
import types
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from xmig import protocol
from xmig.agent.link import handle_push
from xmig.ccl import Communicator
from xmig.faults import FaultSpec
from xmig.faults.injector import Injector
from xmig.jobenv import log_route_for
from xmig.paths import parking_files
from xmig.proxy import ProxyProcessGroup, ReplayMismatch
from xmig.proxy.process_group import _when_done, copies_to_host
from xmig.worker import migration as migration_module
from xmig.worker.errors import RecoveryFailed
from xmig.worker.hooks import OptimizerGate
from xmig.worker.migration import Continue, Migration
from xmig.worker.orders import Orders
from xmig.worker.phase import TRANSITIONS, IllegalTransition, Phase, WorkerPhase

P = WorkerPhase


# ---- phases --------------------------------------------------------------------------------


def test_every_phase_has_its_transitions():
    assert set(TRANSITIONS) == set(WorkerPhase)


@pytest.mark.parametrize(
    "left, to", [(a, b) for a, targets in TRANSITIONS.items() for b in targets]
)
def test_an_allowed_transition_is_taken(left, to):
    phase = Phase(left)
    assert phase.move(to) is left
    assert phase.current is to


FORBIDDEN = [(a, b) for a in WorkerPhase for b in WorkerPhase if b not in TRANSITIONS[a]]


@pytest.mark.parametrize("left, to", FORBIDDEN)
def test_a_forbidden_transition_raises(left, to):
    phase = Phase(left)
    with pytest.raises(IllegalTransition, match=f"from {left.value} to {to.value}"):
        phase.move(to)
    assert phase.current is left


def test_forbidden_transitions_include_these():
    for left, to in [(P.JOINING, P.PARKED), (P.PARKED, P.PAUSED), (P.FINISHED, P.TRAINING),
                     (P.MOVING, P.TRAINING), (P.STARTING, P.FINISHED), (P.TRAINING, P.JOINING),
                     (P.TRAINING, P.TRAINING)]:  # fmt: skip
        assert (left, to) in FORBIDDEN


def test_a_survivor_parks_and_goes_back_where_it_was():
    for was in (P.STARTING, P.TRAINING, P.FINISHED):
        phase = Phase(was)
        assert phase.move(P.PARKED) is was
        phase.move(was)
        assert phase.current is was


# ---- the order consumer --------------------------------------------------------------------


def _orders(rank=1):
    parks, pauses = [], []
    return Orders(rank, on_park=parks.append, on_pause=pauses.append), parks, pauses


def test_each_order_reaches_its_handler():
    orders, parks, pauses = _orders()
    park = protocol.Park(generation=2, replaced=[0])
    orders.dispatch(park)
    assert parks == [park]
    pause = protocol.Pause(generation=3, step=7)
    orders.dispatch(pause)
    assert pauses == [pause]
    rebuild = protocol.Rebuild(generation=2, mode="replay", step=4, source=1, pulls=[0])
    orders.dispatch(rebuild)
    assert orders.plans.next(2, timeout=1.0) == rebuild  # the park before it is skipped
    write = protocol.WriteCheckpoint(generation=2, folder="/c", step=4, writers={"1": 0})
    orders.dispatch(write)
    assert orders.plans.next(2, timeout=1.0) == write
    dump = protocol.Dump(generation=3, rank=1, images="/i", rejoin_file="/r", serve=False)
    resume = protocol.Resume(generation=3)
    orders.dispatch(dump)
    orders.dispatch(resume)
    assert orders.boundary.next(3, timeout=1.0) == dump
    assert orders.boundary.next(3, timeout=1.0) == resume
    resize = protocol.Resize(generation=4, step=7, world_size=2, ranks=[0, 1, -1])
    orders.dispatch(resize)
    assert orders.boundary.next(4, timeout=1.0) == resize
    shrink = protocol.Shrink(generation=5, step=7)
    orders.dispatch(shrink)
    assert orders.plans.next(5, timeout=1.0) == shrink
    announced = protocol.StateAnnounced(generation=2, rank=1, source=0, digest="ab")
    orders.dispatch(announced)
    assert orders.digests.next(2, timeout=1.0) == announced
    assert not orders.released.is_set()
    orders.dispatch(protocol.Release())
    assert orders.released.is_set()
    assert set(orders.table) == {protocol.Park, protocol.Rebuild, protocol.Abort, protocol.Pause,
                                 protocol.Dump, protocol.Resume, protocol.Release,
                                 protocol.StateAnnounced, protocol.WriteCheckpoint,
                                 protocol.SaveState, protocol.Resize,
                                 protocol.Shrink}  # fmt: skip


def test_the_plan_of_a_later_recovery_is_not_taken_by_the_wait_of_an_earlier_one():
    """A recovery given up (the coordinator was restarted during it) still waits for its
    plan when the later recovery's comes: that plan goes to the later wait, whichever
    thread the inbox wakes first, and the earlier wait ends."""
    from xmig.worker.orders import Superseded

    orders, _, _ = _orders()
    rebuild = protocol.Rebuild(generation=3, mode="replay", step=4, source=0, pulls=[1])
    orders.dispatch(rebuild)
    with pytest.raises(Superseded, match="generation 2 was given up for 3"):
        orders.plans.next(2, timeout=5.0)
    assert orders.plans.next(3, timeout=1.0) == rebuild
    # an order of an earlier generation is stale: dropped, the wait goes on
    orders.dispatch(protocol.Rebuild(generation=1, mode="replay", step=3, source=0, pulls=[1]))
    assert orders.plans.next(3, timeout=0.05) is None


def test_a_park_that_replaces_this_rank_is_not_its_own():
    orders, parks, _ = _orders()  # rank 1's
    orders.dispatch(protocol.Park(generation=4, replaced=[1]))
    assert parks == []


def test_a_later_park_ends_the_wait_for_an_earlier_plan():
    """A recovery given up (its replacement failed) is followed by a park of a later
    generation: the survivor waiting for the earlier plan stops waiting at once."""
    from xmig.worker.orders import Superseded

    orders, parks, _ = _orders()
    orders.dispatch(protocol.Park(generation=2, replaced=[0]))
    orders.plans.next(2, timeout=0.01)  # the wait began
    orders.dispatch(protocol.Park(generation=3, replaced=[0]))
    with pytest.raises(Superseded, match="generation 2 was given up for 3"):
        orders.plans.next(2, timeout=5.0)
    assert [p.generation for p in parks] == [2, 3]


def test_orders_before_start_wait_and_then_come_in_order():
    orders, parks, pauses = _orders()
    park = protocol.Park(generation=2, replaced=[0])
    rebuild = protocol.Rebuild(generation=2, mode="replay", step=4, source=1, pulls=[0])
    orders.put(park)
    orders.put(rebuild)
    assert parks == [] and orders.plans.next(2, timeout=0.05) is None
    orders.start()
    assert parks == [park] and orders.plans.next(2, timeout=0.05) == rebuild
    pause = protocol.Pause(generation=3, step=7)
    orders.put(pause)  # once started, on the caller's thread at once
    assert pauses == [pause]


def test_an_abort_reaches_whoever_waits():
    orders, _, _ = _orders()
    orders.dispatch(protocol.Abort(reason="rank 3 died twice"))
    with pytest.raises(RecoveryFailed, match="rank 3 died twice"):
        orders.plans.next(2, timeout=1.0)
    with pytest.raises(RecoveryFailed, match="rank 3 died twice"):
        orders.boundary.next(5, timeout=1.0)


def test_orders_of_a_stale_generation_are_ignored():
    orders, _, _ = _orders()
    orders.dispatch(protocol.Park(generation=2, replaced=[0]))
    stale = protocol.Rebuild(generation=1, mode="replay", step=4, source=1, pulls=[0])
    fresh = protocol.Rebuild(generation=2, mode="rollback", step=3, source=1, pulls=[0])
    orders.dispatch(stale)
    orders.dispatch(fresh)
    assert orders.plans.next(2, timeout=1.0) == fresh
    assert orders.plans.next(2, timeout=0.05) is None
    orders.dispatch(protocol.Resume(generation=1))
    assert orders.boundary.next(2, timeout=0.05) is None
    orders.dispatch(protocol.StateAnnounced(generation=1, rank=1, source=0, digest="old"))
    assert orders.digests.next(2, timeout=0.05) is None


def test_what_came_before_a_park_is_not_its_plan():
    orders, _, _ = _orders()
    orders.dispatch(protocol.Abort(reason="an earlier migration"))
    orders.dispatch(protocol.Rebuild(generation=2, mode="replay", step=4, source=1, pulls=[]))
    orders.dispatch(protocol.Park(generation=2, replaced=[0]))
    assert orders.plans.next(2, timeout=0.05) is None


def test_a_digest_for_another_rank_is_not_this_ranks():
    orders, _, _ = _orders(rank=1)
    orders.dispatch(protocol.StateAnnounced(generation=2, rank=3, source=0, digest="ab"))
    assert orders.digests.next(2, timeout=0.05) is None


def test_an_order_with_no_handler_is_logged(caplog):
    orders, parks, pauses = _orders()
    with caplog.at_level(logging.WARNING, logger="xmig"):
        orders.dispatch(protocol.InjectFault(fault={"rank": 1}))
    assert "no use for the order 'inject_fault'" in caplog.text
    assert not parks and not pauses


def test_orders_are_dispatched_one_at_a_time_on_the_callers_thread():
    seen, busy, overlapped = [], threading.Lock(), []

    def on_park(order):
        if not busy.acquire(blocking=False):
            overlapped.append(order.generation)
            return
        try:
            seen.append((threading.current_thread().name, order.generation))
            time.sleep(0.001)
        finally:
            busy.release()

    orders = Orders(0, on_park=on_park, on_pause=lambda _o: None)
    orders.start()

    def reader(generations):
        for generation in generations:
            orders.put(protocol.Park(generation=generation, replaced=[1]))

    threads = [threading.Thread(target=reader, name=f"reader{i}", args=(gens,))
               for i, gens in enumerate(((1, 2, 3), (11, 12, 13)))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5.0)
    assert overlapped == []
    for name, gens in (("reader0", [1, 2, 3]), ("reader1", [11, 12, 13])):
        assert [g for n, g in seen if n == name] == gens


def test_a_handler_that_fails_does_not_stop_the_consumer(caplog):
    handled = threading.Event()

    def on_pause(order):
        if order.step == 1:
            raise RuntimeError("boom")
        handled.set()

    orders = Orders(0, on_park=lambda _o: None, on_pause=on_pause)
    orders.start()
    with caplog.at_level(logging.ERROR, logger="xmig"):
        orders.put(protocol.Pause(generation=1, step=1))
        orders.put(protocol.Pause(generation=1, step=2))
        assert handled.wait(5.0)
    assert "handling the order 'pause' failed" in caplog.text


# ---- the link's decoding of pushed frames ---------------------------------------------------

FAULT = FaultSpec(kind="kill", rank=1, step=3).to_json()


@pytest.mark.parametrize("frame, why", [
    (["park"], "a JSON object"),
    ({"op": "no_such_op"}, "unknown message"),
    ({"op": "hello", "rank": 1, "pid": 2, "attempt": 0}, "not a message for the worker"),
    ({"op": "park", "generation": 2}, "'replaced' is missing"),
    ({"op": "park", "generation": "2", "replaced": [0]}, "park.generation"),
    ({"op": "park", "generation": 2, "replaced": [0], "extra": 1}, "unknown field 'extra'"),
    ({"op": "inject_fault"}, "'fault' is missing"),
])  # fmt: skip
def test_the_link_drops_a_frame_that_does_not_decode(caplog, frame, why):
    injected, ordered = [], []
    with caplog.at_level(logging.WARNING, logger="xmig"):
        handle_push(frame, injected.append, ordered.append)
    assert not injected and not ordered
    assert "dropped a message from the agent" in caplog.text and why in caplog.text


def test_the_link_hands_on_what_decodes():
    injected, ordered = [], []
    handle_push({"op": "inject_fault", "fault": FAULT}, injected.append, ordered.append)
    handle_push({"op": "park", "generation": 2, "replaced": [0]}, injected.append, ordered.append)
    handle_push({"op": "release"}, injected.append, ordered.append)
    assert injected == [FaultSpec(kind="kill", rank=1, step=3)]
    assert ordered == [protocol.Park(generation=2, replaced=[0]), protocol.Release()]


def test_the_link_survives_a_handler_that_refuses(caplog):
    def refuse(_spec):
        raise ValueError("fault kill:rank=1:step=3 is for rank 1, this is rank 0")

    with caplog.at_level(logging.WARNING, logger="xmig"):
        handle_push({"op": "inject_fault", "fault": FAULT}, refuse, None)
        handle_push({"op": "inject_fault", "fault": {"rank": 1}}, refuse, None)
    assert caplog.text.count("dropped the agent's 'inject_fault'") == 2


# ---- the optimizer gate and a rollback --------------------------------------------------------


def _gate():
    ctx = SimpleNamespace(
        step=3,
        state_lock=threading.Lock(),
        optimizer_waiting=False,
        optimizer_stepped=False,
        env=SimpleNamespace(recovery_timeout=1.0),
        injector=SimpleNamespace(at_point=lambda step, point: None),
        groups=SimpleNamespace(proxies=lambda: []),
        queued_update=None,
    )
    return OptimizerGate(ctx), ctx


def _optimizer():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    return param, torch.optim.SGD([param], lr=0.5)


def test_an_update_holds_the_state_lock():
    gate, ctx = _gate()
    param, optimizer = _optimizer()
    seen = []
    optimizer.register_step_pre_hook(gate.before)
    optimizer.register_step_pre_hook(lambda *_a: seen.append(ctx.state_lock.locked()))
    optimizer.register_step_post_hook(gate.after)
    optimizer.step()
    assert seen == [True] and not ctx.state_lock.locked() and ctx.optimizer_stepped
    assert torch.equal(param.detach(), torch.full((3,), 0.5))


def test_a_rolled_back_step_does_not_update():
    gate, ctx = _gate()
    param, optimizer = _optimizer()
    optimizer.register_step_pre_hook(gate.before)
    optimizer.register_step_post_hook(gate.after)
    gate.skip_update(optimizer)
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)) and not ctx.optimizer_stepped
    gate.allow_update()
    assert "step" not in vars(optimizer)  # the class's own step again
    optimizer.step()
    assert torch.equal(param.detach(), torch.full((3,), 0.5))


def test_an_update_already_waiting_when_a_rollback_comes_fails():
    gate, ctx = _gate()
    _param, optimizer = _optimizer()
    gate.skip_update(SimpleNamespace())  # decided while this update waited for the lock
    with pytest.raises(RecoveryFailed, match="cannot be undone"):
        gate.before(optimizer, (), {})
    assert not ctx.state_lock.locked()


def test_a_survivor_parked_after_its_update_does_not_cross_the_boundary_before_the_plan():
    """A rank parked between its update and the next boundary runs on (nothing it does
    needs its peers): it must wait at the boundary for the plan, which may roll it back
    there. Without that wait it ran the next step on its own, update and all."""
    from xmig.worker.survivor import Survivor

    gate, ctx = _gate()
    ctx.registry = SimpleNamespace(optimizer=lambda: None)
    survivor = Survivor(ctx, layout=None, verifier=None, gate=gate)
    ctx.state_lock.acquire()  # the survivor's park holds it until the plan is carried out
    answer = []
    boundary = threading.Thread(target=lambda: answer.append(survivor.redo_at_boundary(2)))
    boundary.start()
    time.sleep(0.1)
    assert answer == []  # waits for the plan
    survivor._redo_from = 3  # the plan: pause (and redo) at the start of step 3
    ctx.state_lock.release()
    boundary.join(timeout=5)
    assert answer == [3]


# ---- a migration's pause orders ----------------------------------------------------------------


def _migration(objects=None, job_id="j", generation=0):
    sent = []
    orders, _, _ = _orders(rank=0)
    ctx = SimpleNamespace(send=sent.append, orders=orders, rank=0, device=torch.device("cpu"),
                          env=SimpleNamespace(job_id=job_id, recovery_timeout=10.0,
                                              generation=generation),
                          groups=SimpleNamespace(proxies=lambda: [], all=lambda: []),
                          registry=SimpleNamespace(objects=objects or {}), backend="gloo",
                          phase=SimpleNamespace(move=lambda _phase: None),
                          injector=Injector(0, announce=lambda _spec: None))  # fmt: skip
    return Migration(ctx), sent, orders


def _prepared(sent):
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    (reply,) = sent
    assert isinstance(reply, protocol.Prepared)
    return reply


def test_the_moving_rank_makes_room_for_its_tensors_and_says_so():
    model = torch.nn.Linear(256, 256)
    migration, sent, _ = _migration({"model": model}, job_id=f"t{os.getpid()}")
    migration.at_boundary(2)
    migration.on_prepare(protocol.Prepare(generation=2, rank=1))  # another rank's move
    migration.on_prepare(protocol.Prepare(generation=2, rank=0))
    time.sleep(0.1)
    assert not sent  # its tensors are measured at its next boundary, on the loop's thread
    migration.at_boundary(3)
    reply = _prepared(sent)
    assert reply.ok and reply.step == 3 and reply.generation == 2
    assert reply.room_bytes >= 2 * 256 * 256 * 4  # the weight and its gradient to come
    parking = migration._take_parking(2)
    assert parking is not None and parking.path.exists()
    parking.close()
    assert not parking.path.exists()


def test_a_rank_with_nothing_to_park_moves_without():
    migration, sent, _ = _migration({})
    migration.on_prepare(protocol.Prepare(generation=2, rank=0))
    migration.at_boundary(1)
    reply = _prepared(sent)
    assert not reply.ok and "nothing to park" in reply.error
    assert migration._take_parking(2) is None


def test_the_moving_rank_parks_as_it_pauses_and_takes_its_tensors_back_if_not_moved():
    model = torch.nn.Linear(256, 256)
    weight = model.weight.detach().clone()
    migration, sent, orders = _migration({"model": model}, job_id=f"t{os.getpid()}")
    migration.on_prepare(protocol.Prepare(generation=2, rank=0))
    migration.at_boundary(3)
    _prepared(sent)
    # a pause at step 4 superseded by a later one: parked at 4, back for the steps between
    migration.on_pause(protocol.Pause(generation=2, step=4))
    orders.boundary.hand(Continue(2))
    migration.at_boundary(4)
    paused = sent[1]
    assert isinstance(paused, protocol.Paused) and paused.step == 4
    assert paused.stop_s >= paused.park_s > 0  # parked before it said it had stopped
    assert torch.equal(model.weight.detach(), weight)
    parking = migration._parking
    assert parking is not None and parking.path.exists()  # the room stays for the next pause
    # paused at step 6, then resumed without being moved
    migration.on_pause(protocol.Pause(generation=2, step=6))
    orders.boundary.hand(protocol.Resume(generation=2))
    migration.at_boundary(6)
    assert isinstance(sent[2], protocol.Paused) and sent[2].park_s > 0
    assert isinstance(sent[3], protocol.Resumed)
    assert torch.equal(model.weight.detach(), weight)
    assert migration._parking is None and not parking.path.exists()


def test_a_save_while_paused_for_a_move_reads_the_tensors_back_not_emptied_storages():
    # the coordinator lost mid-migration: the job saves its state while the moving rank,
    # paused, has its tensors parked
    model = torch.nn.Linear(256, 256)
    weight = model.weight.detach().clone()
    migration, sent, orders = _migration({"model": model}, job_id=f"t{os.getpid()}")
    migration.on_prepare(protocol.Prepare(generation=2, rank=0))
    migration.at_boundary(3)
    _prepared(sent)
    migration.on_pause(protocol.Pause(generation=2, step=4))
    loop = threading.Thread(target=migration.at_boundary, args=(4,), daemon=True)
    loop.start()
    deadline = time.monotonic() + 10
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(sent[1], protocol.Paused) and sent[1].park_s > 0
    assert model.weight.untyped_storage().nbytes() == 0  # parked
    migration.give_back()  # what the order consumer does before the save
    assert torch.equal(model.weight.detach(), weight)
    parking_path = next(iter(parking_files(f"t{os.getpid()}")), None)
    assert parking_path is None  # closed: this move will not happen
    orders.boundary.hand(protocol.Resume(generation=2))
    loop.join(10)
    assert not loop.is_alive() and torch.equal(model.weight.detach(), weight)


def test_a_pause_at_a_step_already_begun_is_refused():
    migration, sent, _ = _migration()
    migration.at_boundary(5)
    migration.on_pause(protocol.Pause(generation=4, step=5))
    assert len(sent) == 1 and isinstance(sent[0], protocol.PauseRefused)
    assert (sent[0].generation, sent[0].step) == (4, 5) and sent[0].t > 0


def test_a_rank_a_grow_started_ignores_the_pause_it_joins_past():
    # started for generation 4 while its peers go on to that pause; it starts at its step
    migration, sent, _ = _migration(generation=4)
    migration.on_pause(protocol.Pause(generation=4, step=7))
    migration.at_boundary(7)  # does not wait: the order is not for it
    assert not sent and migration._pause_at is None


def test_a_later_pause_lets_a_paused_loop_go_on():
    migration, sent, orders = _migration()
    migration._paused_at = 5  # paused at step 5 for an order now superseded
    migration.on_pause(protocol.Pause(generation=6, step=8))
    assert orders.boundary.next(6, timeout=1.0) == Continue(6)
    assert not sent


# ---- the proxy's inputs from a recovery --------------------------------------------------------


@pytest.fixture
def proxy():
    comm = Communicator("gloo", "world", 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    return ProxyProcessGroup(comm)


def test_an_unknown_log_route_is_refused():
    comm = Communicator("gloo", "world", 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    with pytest.raises(ValueError, match="inline, host"):
        ProxyProcessGroup(comm, log_route="side")
    with pytest.raises(ValueError, match="XMIG_LOG_ROUTE='disk': expected auto, inline, host"):
        log_route_for("disk", gate=True)


@pytest.mark.parametrize(
    ("asked", "gate", "route"),
    [(None, True, "host"), (None, False, "inline"), ("", True, "host"), ("auto", False, "inline"),
     ("inline", True, "inline"), (" Host ", False, "host")],
)  # fmt: skip
def test_the_log_route_is_host_behind_the_gate_unless_asked(asked, gate, route):
    assert log_route_for(asked, gate) == route


def test_the_host_route_copies_only_a_gpus_bucket_all_reduces_but_the_last():
    last = 24  # the step before's last bucket all-reduce
    assert copies_to_host("host", True, "allreduce", 3, last)
    assert copies_to_host("host", True, "allreduce", 3, None)  # the first step: none known
    assert not copies_to_host("host", True, "allreduce", last, last)
    assert not copies_to_host("host", True, "broadcast", 0, last)  # DDP waits for it at once
    assert not copies_to_host("host", False, "allreduce", 3, last)  # CPU tensors
    assert not copies_to_host("inline", True, "allreduce", 3, last)


class _FakeWork:
    """A work with a future (``future``), or none (``get_future`` raises, as some of gloo's)."""

    def __init__(self, future: torch.futures.Future | None) -> None:
        self.future, self.waited = future, threading.Event()

    def get_future(self) -> torch.futures.Future:
        if self.future is None:
            raise RuntimeError("this work has no future")
        return self.future

    def wait(self) -> bool:
        self.waited.wait(10)
        return True


class _CountedFuture(torch.futures.Future):
    def __init__(self) -> None:
        super().__init__()
        self.callbacks_added = 0

    def add_done_callback(self, callback):  # noqa: ANN001, ANN201
        self.callbacks_added += 1
        return super().add_done_callback(callback)


def test_an_op_is_known_done_when_its_future_is_or_when_its_work_has_ended():
    """NCCL's futures are done at the launch: the callback runs before the call returns
    (on the calling thread, once); a future still pending calls back once it completes; a
    work without a future is waited for on a thread of its own."""
    called: list[str] = []
    done = _CountedFuture()
    done.set_result([])
    _when_done(_FakeWork(done), lambda: called.append(threading.current_thread().name))
    assert called == [threading.current_thread().name] and done.callbacks_added == 1

    called.clear()
    pending = _CountedFuture()
    _when_done(_FakeWork(pending), lambda: called.append("pending"))
    assert called == []
    pending.set_result([])
    assert called == ["pending"] and pending.callbacks_added == 1

    ended = threading.Event()
    work = _FakeWork(None)
    _when_done(work, ended.set)
    assert not ended.wait(0.05)  # the work has not ended yet
    work.waited.set()
    assert ended.wait(10)


def test_the_proxy_knows_the_last_bucket_all_reduce_of_the_step_before(proxy):
    """What keeps the step's last bucket on the GPU on the host route: its index, learnt
    from the step before (a broadcast first, as DDP's forward issues one)."""
    proxy.begin_step(0)
    assert proxy._last_large is None
    _broadcast(proxy, torch.ones(2))
    for _ in range(3):
        proxy.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
    proxy.begin_step(1)
    assert proxy._last_large == 3
    assert not copies_to_host("host", True, "allreduce", 3, proxy._last_large)
    assert copies_to_host("host", True, "allreduce", 2, proxy._last_large)
    proxy.begin_step(2)  # a step without collectives: none known
    assert proxy._last_large is None


def _broadcast(group, tensor):
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


def test_a_moving_rank_drops_the_log_s_copies_of_the_steps_before_its_pause(proxy):
    """At a move's pause every rank has ended the steps before it: their copies are dropped
    (not parked, not moved), the pause step's kept, and a replay that reached a dropped op
    refuses rather than re-issue it without its input."""
    buckets = {step: torch.full((256,), float(step)) for step in (3, 4, 5)}
    for step, bucket in buckets.items():
        proxy.begin_step(step, defer_trim=True)  # as at a pause: the trim not yet done
        proxy.allreduce([bucket], dist.AllreduceOptions()).wait()
    assert proxy.wait_gates_open(5.0) and not proxy.pending()
    held = proxy.held_tensors()  # the framework's own tensors only, never the copies
    assert len(held) == 3 and all(any(t is b for b in buckets.values()) for t in held)

    assert proxy.drop_copies_before(5) == 2 * 256 * 4
    by_step = {r.step: r for r in proxy.logged(3)}
    assert by_step[3].inputs is None and by_step[4].inputs is None
    assert torch.equal(by_step[5].inputs[0], buckets[5])
    with pytest.raises(RuntimeError, match="op 0 of step 4 was not logged"):
        proxy.replay_one(by_step[4], pending=False, timeout=5.0)
    assert proxy.drop_copies_before(5) == 0


def test_a_replacement_refuses_an_op_the_survivors_did_not_log(proxy):
    tensor = torch.zeros(4)
    proxy.begin_step(7)
    proxy.expect_signatures(7, ["allreduce|(4,):torch.float32|reduceOp=RedOpType.SUM"])
    with pytest.raises(ReplayMismatch, match="op 0 of step 7 is broadcast"):
        _broadcast(proxy, tensor)


def test_an_overridden_broadcast_goes_out_with_the_given_input(proxy):
    tensor = torch.zeros(3, dtype=torch.int32)
    proxy.begin_step(2)
    proxy.override_broadcast(2, 0, torch.tensor([4, 5, 6], dtype=torch.int32))
    _broadcast(proxy, tensor)
    assert tensor.tolist() == [4, 5, 6]


def test_served_broadcasts_and_a_skipped_step_need_no_network(proxy):
    proxy.begin_step(1)
    proxy.skip_rest_of_step()  # local from now on
    proxy.serve_broadcasts([torch.tensor([1, 2]), torch.tensor([3, 4])])
    first, second, third = torch.zeros(2), torch.zeros(2), torch.full((2,), 9.0)
    for tensor in (first, second, third):
        _broadcast(proxy, tensor)
    assert first.tolist() == [1, 2] and second.tolist() == [3, 4]
    assert third.tolist() == [9, 9]  # nothing left to serve: its own input
    started = time.monotonic()
    proxy.halt()
    _broadcast(proxy, torch.zeros(1))  # served locally even while halted
    assert time.monotonic() - started < 5


# ---- several process groups -------------------------------------------------------------------


def test_a_synchronous_op_is_launched_for_a_work_the_proxy_can_wait_on(proxy):
    """c10d hands ``async_op=False`` on as ``asyncOp``, and NCCL (torch 2.11) then returns no
    work at all: the proxy always asks for one."""
    launched = []
    real = proxy.communicator.backend

    class Recording:
        def allreduce(self, tensors, opts):
            launched.append(opts.asyncOp)
            return real.allreduce(tensors, opts)

    proxy.communicator.backend = Recording()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    tensor = torch.ones(3)
    proxy.allreduce([tensor], opts).wait()
    assert launched == [True] and tensor.tolist() == [1.0, 1.0, 1.0]


def test_the_process_waits_for_a_communicator_being_aborted(proxy):
    from xmig.proxy import wait_for_aborts

    ended = threading.Event()

    class Slow:  # NCCL's abort takes ~0.5 s
        def abort(self):
            time.sleep(0.3)
            ended.set()

    proxy.communicator.kind, proxy.communicator.backend = "nccl", Slow()
    proxy.abort_communicator()
    assert not ended.is_set()
    assert wait_for_aborts(5.0) and ended.is_set()
    assert wait_for_aborts(0.0)  # nothing left to wait for


def test_a_boundary_lets_go_of_old_records_on_another_thread(proxy):
    """Destroying the works and futures of two steps back is off the step loop's thread."""
    import weakref

    proxy.begin_step(1)
    proxy.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
    (record,) = proxy.log
    gone, where = threading.Event(), []
    weakref.finalize(record, lambda: (where.append(threading.current_thread().name), gone.set()))
    del record
    proxy.begin_step(2)
    # (the proxy's waiter holds the last op it completed until it takes the next one)
    proxy.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
    assert not gone.is_set()  # the step before is kept
    proxy.begin_step(3)
    assert gone.wait(5.0) and where == ["xmig-let-go"]
    assert [r.step for r in proxy.log] == [2]


def _one_allreduce(proxy):
    proxy.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()


def test_a_deferred_trim_keeps_old_records_until_the_forward_is_queued(proxy):
    for step in (1, 2):
        proxy.begin_step(step, defer_trim=True)
        _one_allreduce(proxy)
        proxy.trim_log()
    proxy.begin_step(3, defer_trim=True)
    assert [r.step for r in proxy.log] == [1, 2]  # not at the boundary
    proxy.trim_log()  # (the forward's hook)
    assert [r.step for r in proxy.log] == [2]
    proxy.trim_log()  # once per boundary
    assert [r.step for r in proxy.log] == [2]


def test_a_trim_left_undone_is_done_at_the_next_boundary_with_its_own_step(proxy):
    """A step with no forward, then a step redone: the trims happen as they would have at
    each boundary (the redo's keeps what its own step keeps)."""
    for step in (1, 2, 3):
        proxy.begin_step(step)
        _one_allreduce(proxy)
    proxy.begin_step(4, defer_trim=True)  # no forward in step 4
    proxy.begin_step(2, defer_trim=True)  # step 2 redone: step 4's trim (keeps 3) first
    assert [r.step for r in proxy.log] == [3]
    proxy.trim_log()
    assert [r.step for r in proxy.log] == [3]


def test_a_registered_model_trims_the_logs_after_its_forward():
    """The step loop defers the boundary's trim to the model's forward hook."""
    from xmig.worker.hooks import OptimizerGate, install_hooks

    trimmed = []
    proxies = [types.SimpleNamespace(trim_log=lambda: trimmed.append("world"))]
    model = torch.nn.Linear(2, 2)
    ctx = types.SimpleNamespace(
        injector=types.SimpleNamespace(pending=[], at_point=lambda *_a: None),
        registry=types.SimpleNamespace(model=lambda: model, optimizer=lambda: None),
        tracer=None, step=0, groups=types.SimpleNamespace(proxies=lambda: proxies),
        trims_after_forward=False,
    )  # fmt: skip
    handles = install_hooks(ctx, OptimizerGate(ctx))
    assert ctx.trims_after_forward
    model(torch.ones(1, 2))
    assert trimmed == ["world"]
    for handle in handles:
        handle.remove()
    model(torch.ones(1, 2))
    assert trimmed == ["world"]


class _Closable:
    """An NCCL backend's two ways to close, recorded; ``shutdown`` as told."""

    def __init__(self, shutdown=None):
        self.calls, self._shutdown = [], shutdown

    def shutdown(self):
        self.calls.append("shutdown")
        if self._shutdown is not None:
            self._shutdown()

    def abort(self):
        self.calls.append("abort")


def test_a_paused_communicator_is_shut_down_not_aborted(proxy):
    backend = _Closable()
    proxy.communicator.kind, proxy.communicator.backend = "nccl", backend
    assert proxy.release_communicator() == "shutdown"
    assert backend.calls == ["shutdown"]


def test_a_shutdown_that_fails_or_does_not_return_falls_back_to_the_abort(proxy):
    def broken():
        raise RuntimeError("NCCL error: remote process exited")

    release = threading.Event()
    for shutdown, timeout in ((broken, 5.0), (lambda: release.wait(10), 0.2)):
        backend = _Closable(shutdown)
        proxy.communicator.kind, proxy.communicator.backend = "nccl", backend
        started = time.monotonic()
        assert proxy.release_communicator(timeout_s=timeout) == "abort"
        assert backend.calls == ["shutdown", "abort"]
        assert time.monotonic() - started < 3.0  # bounded by the timeout, not the hang
    release.set()


def test_a_communicator_aborted_already_is_not_shut_down_at_the_pause(proxy):
    # a shrink's survivors abort the communicator of the lost peer, then pause: a shutdown
    # would wait for that peer until its timeout (10 s on the GPU)
    backend = _Closable(lambda: time.sleep(30))
    proxy.communicator.kind, proxy.communicator.backend = "nccl", backend
    proxy.abort_communicator(wait=True)
    assert proxy.release_communicator() == "abort"
    assert backend.calls == ["abort"]  # no shutdown: it would wait out the sleep above


def test_gloo_has_nothing_to_release(proxy):
    assert proxy.communicator.kind == "gloo"
    assert proxy.release_communicator() == "none"


def _group_proxy(name, sequence, seen):
    comm = Communicator("gloo", name, 0, dist.HashStore(), 0, 1, timedelta(seconds=10))
    return ProxyProcessGroup(comm, before_op=lambda step, index, op: seen.append((name, index)),
                             group=name, sequence=sequence)  # fmt: skip


def test_ops_of_several_groups_are_numbered_and_replayed_in_the_order_they_were_issued():
    from xmig.proxy import OpSequence, replay_groups

    sequence, seen = OpSequence(), []
    world, sub = _group_proxy("world", sequence, seen), _group_proxy("pg1", sequence, seen)
    for proxy in (world, sub):
        proxy.begin_step(3)
    for proxy in (world, sub, sub, world):
        proxy.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
    # a collective=K fault counts the step's ops across the groups
    assert seen == [("world", 0), ("pg1", 1), ("pg1", 2), ("world", 3)]
    order = []
    for proxy in (world, sub):
        original = proxy.replay_one

        def replay_one(record, pending, timeout, original=original):
            order.append((record.group, record.index))
            return original(record, pending, timeout)

        proxy.replay_one = replay_one
    check = replay_groups([sub, world], 3, timeout=10.0)
    assert order == [("world", 0), ("pg1", 0), ("pg1", 1), ("world", 1)]
    assert check.compared == 4 and not check.differ


def test_a_worker_knows_which_of_its_groups_a_replaced_rank_is_in():
    from xmig.proxy import OpSequence
    from xmig.worker.groups import Group, Groups

    groups, seen = Groups(), []
    for name, c10d, ranks in (("world", "0", [0, 1, 2, 3]), ("pg1", "1", [0, 2]),
                              ("pg3", "3", [0, 1])):  # fmt: skip
        groups.add(Group(name, c10d, ranks, _group_proxy(name, OpSequence(), seen)))
    assert [g.label for g in groups.holding([1])] == ["world", "pg3[0,1]"]
    assert [g.label for g in groups.kept([1])] == ["pg1[0,2]"]
    assert groups.of(None).name == "world" and groups.named("pg1").ranks == [0, 2]
    assert groups.of(SimpleNamespace(group_name="3")).name == "pg3"
    with pytest.raises(ValueError, match="made twice"):
        groups.add(Group("pg1", "1", [0, 2], groups.named("pg1").proxy))


def test_a_split_is_checked_as_torch_documents_it_and_this_ranks_is_found():
    from xmig.worker.groups import Groups, _my_split

    assert _my_split([[1, 0], [3, 2]], 4, 0) == [0, 1]
    assert _my_split([[1, 0], [3, 2]], 4, 3) == [2, 3]
    assert _my_split([[0, 1]], 4, 2) is None  # in no split: no group
    for splits, why in (([], "cannot be None or empty"), ([[0], []], "cannot be empty"),
                        ([[0, 0]], "duplicate ranks"), ([[0, 4]], r"ranks \[4\] are not in"),
                        ([[0, 1], [1, 2]], r"overlap: \[1\]")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            _my_split(splits, 4, 0)
    groups = Groups()
    assert groups.name_for("0", None) == "world" and groups.name_for("5", [0, 1]) == "pg5"
    # a group its members made alone: named after them and how many such they made before
    first, second = groups.name_for("9e1f", [0, 1]), groups.name_for("77aa", [0, 1])
    assert first.startswith("pgm") and len({first, second}) == 2
    other = Groups()
    assert other.name_for("c0de", [0, 1]) == first  # whatever c10d's hash
    assert other.name_for("c0de", [0, 2]) != second


def test_the_single_tensor_ops_of_newer_torch_go_through_the_proxy_as_the_ops_they_are(proxy):
    """torch 2.13's all_gather_single and reduce_scatter_single (FSDP2 issues them) are
    logged as _allgather_base and _reduce_scatter_base; gloo's reduce-scatter work has no
    future, and its op still completes."""
    proxy.begin_step(0)
    gathered, shard = torch.zeros(4), torch.arange(4.0)
    proxy.all_gather_single(gathered, shard, AllgatherOptions()).wait()
    out = torch.zeros(4)
    proxy.reduce_scatter_single(out, torch.arange(4.0) * 2, dist.ReduceScatterOptions()).wait()
    assert torch.equal(gathered, shard) and torch.equal(out, torch.arange(4.0) * 2)
    assert [r.op for r in proxy.logged(0)] == ["_allgather_base", "_reduce_scatter_base"]
    assert all(r.state == "done" for r in proxy.logged(0))
    check = proxy.replay(0, timeout=10.0)  # re-issued and compared like any other op
    assert check.compared == 2 and not check.differ


def test_a_dtensor_parameter_is_fingerprinted_by_its_local_shard():
    from xmig.state.fingerprint import local_part, params_sha256

    class Sharded(torch.Tensor):
        def to_local(self):
            return torch.ones(2)

    plain = torch.zeros(3)
    assert local_part(plain) is plain
    assert torch.equal(local_part(torch.zeros(3).as_subclass(Sharded)), torch.ones(2))
    model = torch.nn.Linear(2, 1, bias=False)
    assert len(params_sha256(model)) == 64


def test_the_replicas_of_a_dtensor_rank_are_those_with_its_shard_coordinates():
    from xmig.worker.context import dtensor_replicas, dtensor_shard

    def placement(replicate):
        return SimpleNamespace(is_replicate=lambda: replicate)

    def model_on(grid, placements):
        model = torch.nn.Linear(2, 2, bias=False)
        model.weight.device_mesh = SimpleNamespace(mesh=torch.tensor(grid))
        model.weight.placements = tuple(placement(r) for r in placements)
        return model

    hsdp = model_on([[0, 1], [2, 3]], [True, False])  # (replicate, shard)
    assert dtensor_replicas(hsdp, 1) == [1, 3] and dtensor_shard(hsdp, 1) == "1"
    fsdp = model_on([0, 1, 2, 3], [False])
    assert dtensor_replicas(fsdp, 2) == [2] and dtensor_shard(fsdp, 2) == "2"
    assert dtensor_replicas(torch.nn.Linear(2, 2), 0) is None  # no DTensor: no sets


def test_sharded_state_travels_as_its_local_shards():
    from xmig.state.dtensors import is_dtensor, local_shards

    class Sharded(torch.Tensor):
        device_mesh = "mesh"

        def to_local(self):
            return torch.full((2,), 7.0)

    sharded = torch.zeros(4).as_subclass(Sharded)
    state = {"w": sharded, "nested": [sharded, {"step": 3}], "plain": torch.ones(1)}
    assert is_dtensor(sharded) and not is_dtensor(torch.ones(1))
    out = local_shards(state)
    assert torch.equal(out["w"], torch.full((2,), 7.0)) and not is_dtensor(out["w"])
    assert torch.equal(out["nested"][0], torch.full((2,), 7.0)) and out["nested"][1] == {"step": 3}
    assert torch.equal(out["plain"], torch.ones(1))


def test_a_world_whose_script_draws_its_shards_ahead_cannot_change_size():
    """A batch drawn before its step at the old size would be trained at the new one."""
    from xmig.worker.partition import BatchPolicy, GlobalPartition
    from xmig.worker.resize import Resizer
    from xmig.worker.shards import Shards

    def resizer(draws_ahead: bool) -> Resizer:
        stream = Shards(list(range(12)), GlobalPartition(12, 4, 0, BatchPolicy.GLOBAL, False),
                        name="data", world_size=2, rank=0)  # fmt: skip
        if draws_ahead:
            next(stream)  # before the loop's first boundary
        stream.at_boundary(0)
        ctx = SimpleNamespace(groups=SimpleNamespace(all=lambda: []),
                              registry=SimpleNamespace(streams={"data": stream}, ddp=None,
                                                       model=lambda: None))  # fmt: skip
        return Resizer(ctx, layout=None, verifier=None, make_group=None, on_world=None)

    assert resizer(draws_ahead=False).why_not() is None
    assert "draws ahead of its steps" in resizer(draws_ahead=True).why_not()


def test_a_moving_gpu_rank_shrinks_its_local_memory_and_sets_its_stack_again_after(monkeypatch):
    # on the GPU the context's local memory (the stack size times every thread the GPU can
    # hold) is about 0.27 GB that the driver's checkpoint and CRIU would carry for nothing
    limits = {"stack": 1024}
    calls = []

    def set_stack_size(size):
        calls.append(size)
        limits["stack"] = size

    monkeypatch.setattr(migration_module.cuda, "stack_size", lambda: limits["stack"])
    monkeypatch.setattr(migration_module.cuda, "set_stack_size", set_stack_size)
    migration, _, _ = _migration({})
    migration._ctx.backend = "nccl"
    stack = migration._shrink_local_memory()
    assert stack == 1024 and limits["stack"] == migration_module.MOVING_STACK_BYTES
    limits["stack"] = 128  # a kernel after the restore needed more: the driver grew it
    migration._restore_local_memory(stack)
    assert limits["stack"] == 1024 and calls == [migration_module.MOVING_STACK_BYTES, 1024]
    # a stack the job set smaller than the moving one, and one grown past it, are left alone
    limits["stack"] = 8
    assert migration._shrink_local_memory() == 8 and limits["stack"] == 8
    migration._restore_local_memory(4)
    assert limits["stack"] == 8 and len(calls) == 2


def test_a_rank_whose_stack_size_cannot_be_read_moves_its_local_memory_whole(monkeypatch):
    def unreadable():
        raise migration_module.cuda.GpuCheckpointError("cuda-bindings is not installed")

    monkeypatch.setattr(migration_module.cuda, "stack_size", unreadable)
    migration, _, _ = _migration({})
    migration._ctx.backend = "nccl"
    assert migration._shrink_local_memory() is None
    migration._ctx.backend = "gloo"  # a CPU rank has no context to shrink
    monkeypatch.setattr(migration_module.cuda, "stack_size", lambda: 1024)
    assert migration._shrink_local_memory() is None
