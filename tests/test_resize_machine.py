"""The coordinator's side of a planned resize, without processes: a ``Job`` fed events, one
test per change of the resize's phase (``coord/resizing.py``)."""

import pytest

from test_coord_machines import T0, running_job, said, sent
from xmig.coord.machine import JobState
from xmig.coord.orders import AgentLost, Refused, Reply, Tick, ToLaunchers
from xmig.coord.resizing import RESIZE_TRANSITIONS, ResizePhase
from xmig.coord.snapshot import restore, snapshot
from xmig.faults import parse_fault
from xmig.protocol import (
    Abort,
    AgentHello,
    EndRank,
    Fault,
    FaultRecord,
    Park,
    Parked,
    Pause,
    Paused,
    PauseRefused,
    Position,
    Progress,
    Resize,
    Respawn,
    Resume,
    Resumed,
    ScaleRequest,
    Shrink,
    StartNode,
    StateAnnounced,
    StateSent,
    WorkerDone,
    WorkerJoined,
    WorkerStarted,
)

S = JobState


def resizing_job(world=2, **fields):
    """A job of 3 ranks on 3 nodes at step 3, asked to go on with ``world``."""
    job = running_job(nnodes=3, **fields)
    orders = job.on(ScaleRequest(world_size=world), T0)
    return job, orders


def paused(job, step=4, t=T0 + 0.1, why=None, ranks=(0, 1, 2), generation=1):
    orders = []
    for rank in ranks:
        orders += job.on(Paused(generation=generation, step=step, rank=rank,
                                stop_s=0.01 * (rank + 1),
                                cannot_resize=why if rank == 1 else None), t)  # fmt: skip
    return orders


def test_scale_pauses_every_rank_at_the_next_boundary():
    job, orders = resizing_job()
    assert job.state is S.RESIZING and job.resizing.phase is ResizePhase.PAUSING
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=4))]
    assert isinstance(orders[-1], Reply)
    assert "from 3 to 2 ranks at the start of step 4" in orders[-1].value["resize"]


def test_every_rank_paused_sends_the_new_world_and_renumbers_the_job():
    job, _ = resizing_job()
    orders = paused(job)
    assert job.resizing.phase is ResizePhase.RESIZING
    assert sent(orders, Resize) == [("all", Resize(generation=1, step=4, world_size=2,
                                                   ranks=[0, 1, -1]))]  # fmt: skip
    assert job.world_size == 2 and sorted(job.members) == [0, 1]
    assert job.members[1].pid == 201 and 202 in job.retiring  # the leaver's end is expected


def test_the_new_world_resumed_ends_running_with_the_record():
    job, _ = resizing_job()
    paused(job)
    assert not job.on(Resumed(generation=1, rank=0), T0 + 0.2)
    orders = job.on(Resumed(generation=1, rank=1), T0 + 0.3)
    assert job.state is S.RUNNING and job.resizing is None
    (record,) = job.resizes
    assert record["what"] == "shrunk from 3 to 2 at step 4 (planned)"
    assert record["left"] == [2] and record["refused"] is None
    assert record["phases"]["stop"] == 0.03 and record["downtime_s"] == pytest.approx(0.23)
    assert any("shrunk from 3 to 2 at step 4" in line for line in said(orders))


def test_a_rank_that_cannot_resize_resumes_everyone_at_the_old_size():
    job, _ = resizing_job()
    orders = paused(job, why="the data stream 'data' is drawn through session.batches()")
    assert job.resizing.phase is ResizePhase.REFUSED and not sent(orders, Resize)
    assert sent(orders, Resume) == [("all", Resume(generation=1))]
    assert job.world_size == 3
    for rank in range(3):
        orders = job.on(Resumed(generation=1, rank=rank), T0 + 0.3)
    assert job.state is S.RUNNING and job.world_size == 3
    assert "session.batches()" in job.resizes[0]["refused"]
    assert any("refused" in line for line in said(orders))


def test_pause_refused_moves_the_resize_to_a_later_step():
    job, _ = resizing_job()
    job.on(Paused(generation=1, step=4, rank=0), T0)
    orders = job.on(PauseRefused(generation=1, step=6, rank=2), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=7))]
    assert job.resizing.paused == {} and job.resizing.step == 7
    assert sent(paused(job, step=7), Resize)[0][1].step == 7


def test_a_resize_the_job_outran_is_dropped():
    job, _ = resizing_job()
    orders = job.on(WorkerDone(rank=0, steps=4, params_sha256=None, checksum=None), T0)
    assert job.state is S.RUNNING and job.resizing is None
    assert any("finished first" in line for line in said(orders))


def test_a_fault_during_the_resize_stops_the_job():
    job, _ = resizing_job()
    record = FaultRecord(rank=0, node=0, pid=200, attempt=0, kind="signal", detail="SIGKILL",
                         step=4, t_fault=T0, t_detected=T0, fault_time_source="detection",
                         detected_after_s=0.0)  # fmt: skip
    orders = job.on(Fault(record=record), T0 + 0.1)
    assert sent(orders, Abort) and job.state is S.STOPPING


def test_a_resize_past_its_deadline_fails():
    job, _ = resizing_job(recovery_timeout=5.0)
    orders = job.on(Paused(generation=1, step=4, rank=0), T0 + 6.0)
    assert job.state is S.STOPPING and any("not resized within" in s for s in said(orders))


@pytest.mark.parametrize("world, why", [
    (3, "already 3"), (4, "room for 0"), (0, "not possible"),
])  # fmt: skip
def test_sizes_that_cannot_be_had_are_refused(world, why):
    job = running_job(nnodes=3)
    with pytest.raises(Refused, match=why):
        job.on(ScaleRequest(world_size=world), T0)
    assert job.state is S.RUNNING and job.generation == 0


def test_an_injected_resize_starts_two_steps_ahead_at_its_own_step():
    spec = parse_fault("resize:world=1:step=6").to_json()
    job = running_job(nnodes=3, faults=(spec,))
    assert not sent(job.on(Progress(rank=0, step=3), T0), Pause)
    orders = job.on(Progress(rank=1, step=4), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=6))]
    assert job.resizing.why == "resize:world=1:step=6"


def test_an_injected_resize_some_rank_has_passed_goes_to_the_next_step_none_began():
    spec = parse_fault("resize:world=1:step=6").to_json()
    job = running_job(nnodes=3, faults=(spec,))
    job.on(Progress(rank=0, step=7), T0)  # reports came late: rank 0 is past step 6
    assert job.resizing.plan.step == 8


def test_a_snapshot_keeps_the_world_size_and_the_resizes():
    job, _ = resizing_job()
    paused(job)
    for rank in (0, 1):
        job.on(Resumed(generation=1, rank=rank), T0 + 0.3)
    again = restore(job.spec, snapshot(job), T0 + 1)
    assert again.world_size == 2 and again.resizes == job.resizes


def test_every_phase_can_end():
    ended = {ResizePhase.DONE, ResizePhase.DROPPED, ResizePhase.FAILED}
    for phase, targets in RESIZE_TRANSITIONS.items():
        assert phase in ended or ResizePhase.FAILED in targets, phase


# ---- a shrink: a lost node whose ranks have no spare -----------------------------------------


def shrinking_job(**fields):
    """3 ranks on 3 nodes at step 3, ``--on-no-spare shrink``; node 1 is lost."""
    job = running_job(nnodes=3, on_no_spare="shrink", checkpoint_dir="/ckpt", **fields)
    orders = job.on(AgentLost(1), T0)
    orders += job.on(Tick(), T0 + 1.0)  # the fault settles
    return job, orders


def parked_at(job, step=3, stepped=(), pending=0, t=T0 + 1.1):
    """Ranks 0 and 2 park in ``step``; those in ``stepped`` took its update (and wait in
    ``pending`` collectives issued after it)."""
    orders = []
    for rank in (0, 2):
        after = rank in stepped
        orders += job.on(Parked(generation=1, rank=rank, position=Position(
            step=step, state_step=step + 1 if after else step, log_from=step - 1,
            keep_log=True, signatures={}, pending=pending if after else 0)), t)  # fmt: skip
    return orders


def test_a_lost_node_without_a_spare_parks_the_survivors_for_a_shrink():
    job, orders = shrinking_job()
    assert job.state is S.RESIZING and job.resizing.phase is ResizePhase.PARKING
    assert sent(orders, Park) == [("all", Park(generation=1, replaced=[1], shrink=True))]
    assert job.resizing.survivors == [0, 2]


def test_the_survivors_parked_in_one_step_roll_it_back_and_pause_there():
    job, _ = shrinking_job()
    orders = parked_at(job)
    assert sent(orders, Shrink) == [("all", Shrink(generation=1, step=3))]
    assert job.resizing.phase is ResizePhase.PAUSING
    orders = paused(job, step=3, ranks=(0, 2))
    assert sent(orders, Resize) == [("all", Resize(generation=1, step=3, world_size=2,
                                                   ranks=[0, -1, 1]))]  # fmt: skip
    job.on(Resumed(generation=1, rank=0), T0 + 1.3)
    job.on(Resumed(generation=1, rank=1), T0 + 1.3)
    (record,) = job.resizes
    assert record["cause"] == "node lost" and record["lost"] == [1]
    assert job.state is S.RUNNING and job.members[1].node == 2


def test_a_survivor_still_in_the_step_before_pulls_the_next_ones_state_and_all_pause_there():
    job, _ = shrinking_job()
    orders = parked_at(job, stepped=(2,))  # rank 2 took step 3's update; rank 0 had not
    assert sent(orders, Shrink) == [("all", Shrink(generation=1, step=4, sources={"0": 2}))]
    assert job.resizing.step == 4
    orders = job.on(StateSent(generation=1, target=0, digest="ab", rank=2), T0 + 1.2)
    assert sent(orders, StateAnnounced) == [
        ("all", StateAnnounced(generation=1, rank=0, source=2, digest="ab"))
    ]
    # a digest from a rank that serves nothing is not passed on
    assert not sent(job.on(StateSent(generation=1, target=2, digest="cd", rank=0), T0 + 1.2),
                    StateAnnounced)  # fmt: skip
    orders = paused(job, step=4, ranks=(0, 2))
    assert sent(orders, Resize) == [("all", Resize(generation=1, step=4, world_size=2,
                                                   ranks=[0, -1, 1]))]  # fmt: skip


def test_a_survivor_waiting_in_a_collective_after_its_update_stops_the_shrink_with_a_save():
    job, _ = shrinking_job()
    orders = parked_at(job, stepped=(2,), pending=1)
    assert job.state is S.CHECKPOINTING and not sent(orders, Shrink)
    assert any("waits in a collective" in line for line in said(orders))


def test_a_shrink_below_the_minimum_saves_the_state():
    job, orders = shrinking_job(min_world_size=3)
    assert job.state is S.CHECKPOINTING and job.resizing is None
    assert any("below --min-world-size 3" in line for line in said(orders))


def test_without_shrink_a_lost_node_stops_the_job_as_before():
    job = running_job(nnodes=3, checkpoint_dir="/ckpt")
    orders = job.on(AgentLost(1), T0) + job.on(Tick(), T0 + 1.0)
    assert job.state is S.CHECKPOINTING
    assert any("no spare node" in line for line in said(orders))


# ---- a grow: new ranks on an idle node ------------------------------------------------------


def test_a_larger_world_starts_new_ranks_on_an_idle_node_and_resizes_once_all_are_there():
    job = running_job(nnodes=3, spare_nodes=1)
    orders = job.on(ScaleRequest(world_size=4), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=4))]
    assert "ranks [3] start on node(s) [3]" in orders[-1].value["resize"]
    # the new rank starts at once (the long pole) while the others go on to the pause
    respawn = Respawn(rank=3, generation=1, local_rank=0, attempt=1, fired=[], world_size=4,
                      launched_as=-1)  # fmt: skip
    assert sent(orders, Respawn) == [(3, respawn)]
    job.on(WorkerStarted(rank=3, node=3, pid=303, attempt=1, t=T0, from_spare=False), T0 + 0.05)
    assert job.members[3].node == 3 and job.worker_pids[3] == [303]
    orders = paused(job)
    # every rank paused, the new one not there yet: they wait for it
    assert job.resizing.phase is ResizePhase.STARTING and not sent(orders, Resize)
    # once it has joined (xmig.init()), every rank hears of the new world
    orders = job.on(WorkerJoined(rank=3, pid=303, attempt=1, t=T0), T0 + 0.25)
    assert sent(orders, Resize) == [
        ("all", Resize(generation=1, step=4, world_size=4, ranks=[0, 1, 2], sources={"3": 0}))
    ]
    assert job.world_size == 4 and job.launched_as[3] == -1
    relayed = job.on(StateSent(generation=1, target=3, digest="ab", rank=0), T0 + 0.3)
    assert sent(relayed, StateAnnounced) == [
        ("all", StateAnnounced(generation=1, rank=3, source=0, digest="ab"))
    ]
    for rank in range(3):
        assert not job.on(Resumed(generation=1, rank=rank), T0 + 0.3)
    orders = job.on(Resumed(generation=1, rank=3), T0 + 0.4)
    assert job.state is S.RUNNING and job.resizing is None
    (record,) = job.resizes
    assert record["what"] == "grown from 3 to 4 at step 4 (planned)"
    assert record["added"] == {"3": 3} and record["pulled"] == {"3": 0}
    assert record["from_spare"] == [False]
    assert any("ranks [3] started on node 3" in line for line in said(orders))


def new_rank_exits(job, t):
    """Rank 3, started for a grow, exits before it joins."""
    job.on(WorkerStarted(rank=3, node=3, pid=303, attempt=1, t=t, from_spare=False), t)
    return job.on(Fault(record=FaultRecord(
        rank=3, node=3, pid=303, attempt=1, kind="exit", detail="exit code 1", step=None,
        t_fault=t + 0.01, t_detected=t + 0.01, fault_time_source="detection",
        detected_after_s=0.0)), t + 0.01)  # fmt: skip


def test_a_new_rank_that_does_not_start_leaves_the_world_as_it_was():
    job = running_job(nnodes=3, spare_nodes=1)
    job.on(ScaleRequest(world_size=4), T0)
    paused(job)
    orders = new_rank_exits(job, T0 + 0.2)
    assert job.resizing.phase is ResizePhase.REFUSED and not sent(orders, Resize)
    # its process is ended, and the paused ranks go on on communicators of a generation
    # the new rank never met under
    assert sent(orders, EndRank) == [(3, EndRank(rank=3, pid=303))]
    assert sent(orders, Resume) == [("all", Resume(generation=1, communicators=2))]
    assert sorted(job.members) == [0, 1, 2] and 3 not in job.worker_pids
    assert job.left_ranks[-1]["rank"] == 3 and job.left_ranks[-1]["joined"] is False
    for rank in range(3):
        orders = job.on(Resumed(generation=1, rank=rank), T0 + 0.4)
    assert job.state is S.RUNNING and job.world_size == 3
    assert "new rank(s) [3] did not start: exit code 1" in job.resizes[0]["refused"]


def test_a_new_rank_that_fails_before_the_pause_leaves_the_world_as_it_was_once_paused():
    job = running_job(nnodes=3, spare_nodes=1)
    job.on(ScaleRequest(world_size=4), T0)
    orders = new_rank_exits(job, T0 + 0.05)
    assert job.resizing.phase is ResizePhase.PAUSING and not sent(orders, Resume)
    orders = paused(job)
    assert sent(orders, Resume) == [("all", Resume(generation=1, communicators=2))]
    assert "did not start" in job.resizing.refusals[3]


def test_a_grow_refused_at_the_pause_ends_its_new_ranks_first():
    job = running_job(nnodes=3, spare_nodes=1)
    job.on(ScaleRequest(world_size=4), T0)
    job.on(WorkerStarted(rank=3, node=3, pid=303, attempt=1, t=T0, from_spare=False), T0 + 0.05)
    job.on(WorkerJoined(rank=3, pid=303, attempt=1, t=T0), T0 + 0.06)
    orders = paused(job, why="the data stream 'data' is drawn through session.batches()")
    assert sent(orders, EndRank) == [(3, EndRank(rank=3, pid=303))]
    assert sent(orders, Resume) == [("all", Resume(generation=1, communicators=2))]


def test_a_grow_the_job_outran_ends_its_new_ranks():
    job = running_job(nnodes=3, spare_nodes=1)
    job.on(ScaleRequest(world_size=4), T0)
    job.on(WorkerStarted(rank=3, node=3, pid=303, attempt=1, t=T0, from_spare=False), T0 + 0.05)
    orders = job.on(WorkerDone(rank=0, steps=4, params_sha256=None, checksum=None), T0 + 0.1)
    assert job.state is S.RUNNING and sent(orders, EndRank) and not sent(orders, Resume)
    assert 3 not in job.members


def test_a_new_rank_that_does_not_join_in_time_is_given_up():
    job = running_job(nnodes=3, spare_nodes=1, recovery_timeout=5.0)
    job.on(ScaleRequest(world_size=4), T0)
    paused(job)
    orders = job.on(Tick(), T0 + 6.0)
    assert job.resizing.phase is ResizePhase.REFUSED
    assert sent(orders, Resume) == [("all", Resume(generation=1, communicators=2))]
    assert "did not join within 5 s" in job.resizing.refusals[3]


def shrunk_job(**fields):
    """3 ranks on 3 nodes; node 1 lost in step 3: the world shrank to 2 (ranks 0 and 2,
    now 0 and 1, on nodes 0 and 2), running again."""
    job, _ = shrinking_job(**fields)
    parked_at(job)
    paused(job, step=3, ranks=(0, 2))
    for rank in (0, 1):
        job.on(Resumed(generation=1, rank=rank), T0 + 1.3)
    assert job.state is S.RUNNING and job.world_size == 2
    return job


def test_an_added_node_grows_a_shrunk_world_back_to_its_launch_size():
    job = shrunk_job()
    orders = job.on(ScaleRequest(add_node=True), T0 + 2)
    assert [o.msg for o in orders if isinstance(o, ToLaunchers)] == [StartNode(node=3)]
    assert "grows from 2 ranks toward 3" in orders[-1].value["resize"]
    assert job.state is S.RUNNING  # until the node's agent is there
    job.on(Progress(rank=0, step=5), T0 + 2.5)
    orders = job.on(AgentHello(node=3, pid=93, netns=None), T0 + 3)
    assert sent(orders, Pause) == [("all", Pause(generation=2, step=6))]
    assert job.resizing.plan.added == {2: 3}
    assert sent(orders, Respawn)[0][0] == 3
    job.on(WorkerJoined(rank=2, pid=303, attempt=1, t=T0), T0 + 3.2)
    # the new rank joined before the others paused: they resize as soon as they have
    orders = paused(job, step=6, ranks=(0, 1), generation=2)
    assert sent(orders, Resize) == [
        ("all", Resize(generation=2, step=6, world_size=3, ranks=[0, 1], sources={"2": 0}))
    ]


def test_a_lost_node_back_from_repair_grows_the_world_it_left():
    job = shrunk_job()
    job.on(AgentHello(node=1, pid=91, netns=None), T0 + 3)
    assert job.state is S.RESIZING and job.resizing.plan.added == {2: 1}
    assert job.resizing.why == "node 1 joined"


def test_an_added_node_waits_as_a_spare_when_the_world_is_whole():
    job = running_job(nnodes=3)
    orders = job.on(ScaleRequest(add_node=True), T0)
    assert "waits as a spare node" in orders[-1].value["resize"]
    job.on(AgentHello(node=3, pid=93, netns=None), T0 + 1)
    job.on(Progress(rank=0, step=4), T0 + 1.5)
    assert job.state is S.RUNNING and job.resizing is None and 3 in job.agents


def test_a_world_shrunk_by_request_does_not_grow_back_by_itself():
    job, _ = resizing_job()
    paused(job)
    for rank in (0, 1):
        job.on(Resumed(generation=1, rank=rank), T0 + 0.3)
    assert job.wanted_world == 2
    job.on(ScaleRequest(add_node=True), T0 + 1)
    job.on(AgentHello(node=3, pid=93, netns=None), T0 + 1.5)
    assert job.state is S.RUNNING and job.world_size == 2


def test_an_injected_added_node_starts_two_steps_ahead_and_grows_at_its_step():
    job = shrunk_job(faults=(parse_fault("add-node:step=8").to_json(),))
    orders = job.on(Progress(rank=0, step=5), T0 + 2)
    assert not any(isinstance(o, ToLaunchers) for o in orders)
    orders = job.on(Progress(rank=0, step=6), T0 + 2.1)
    assert [o.msg for o in orders if isinstance(o, ToLaunchers)] == [StartNode(node=3)]
    job.on(AgentHello(node=3, pid=93, netns=None), T0 + 3)
    assert job.resizing.plan.step == 8  # not 7, the next step none began


def test_a_node_added_by_request_is_refused_with_hosts_of_their_own():
    job = running_job(nnodes=3, multi_host=True)
    with pytest.raises(Refused, match="launcher of its own"):
        job.on(ScaleRequest(add_node=True), T0)


def test_a_replacement_after_a_resize_starts_in_the_world_of_now_with_its_launch_faults():
    job = shrunk_job()
    job.on(Fault(record=FaultRecord(
        rank=1, node=2, pid=202, attempt=0, kind="signal", detail="SIGKILL", step=5,
        t_fault=T0 + 4, t_detected=T0 + 4, fault_time_source="detection",
        detected_after_s=0.0)), T0 + 4)  # fmt: skip
    orders = job.on(Tick(), T0 + 5)
    ((node, respawn),) = sent(orders, Respawn)
    assert node == 2 and respawn.world_size == 2 and respawn.launched_as == 2


def test_a_snapshot_keeps_what_a_grow_needs():
    job = shrunk_job(faults=(parse_fault("add-node:step=9").to_json(),))
    job.on(ScaleRequest(add_node=True), T0 + 2)
    again = restore(job.spec, snapshot(job), T0 + 3)
    assert again.added_nodes == [3] and again.wanted_world == 3
    assert again.launched_as == {0: 0, 1: 2} and again.scheduled_nodes == job.scheduled_nodes


def test_an_added_node_lost_before_its_rank_joined_leaves_the_world_as_it_was():
    job = shrunk_job()
    job.on(ScaleRequest(add_node=True), T0 + 2)
    job.on(AgentHello(node=3, pid=93, netns=None), T0 + 3)
    job.on(WorkerStarted(rank=2, node=3, pid=303, attempt=1, t=T0, from_spare=True), T0 + 3.1)
    job.on(AgentLost(3), T0 + 3.2)
    assert job.state is S.RESIZING and job.resizing.start_failed is not None
    orders = paused(job, step=4, ranks=(0, 1), generation=2)
    assert sent(orders, Resume) == [("all", Resume(generation=2, communicators=3))]
    for rank in (0, 1):
        job.on(Resumed(generation=2, rank=rank), T0 + 3.5)
    assert job.state is S.RUNNING and job.world_size == 2 and 2 not in job.members
    assert "did not start" in job.resizes[-1]["refused"]


def test_a_spare_node_the_shrink_left_idle_grows_the_world_back_at_the_next_boundary():
    """Two nodes lost at once, one spare node: the world shrinks by both, then grows onto the
    spare (a lost node's ranks all go to one idle node, or none do)."""
    job = running_job(nnodes=3, spare_nodes=1, on_no_spare="shrink", checkpoint_dir="/ckpt")
    job.on(AgentLost(1), T0)
    job.on(AgentLost(2), T0 + 0.001)
    job.on(Tick(), T0 + 1.0)
    assert job.state is S.RESIZING and job.resizing.lost == [1, 2]
    job.on(Parked(generation=1, rank=0, position=Position(
        step=3, state_step=3, log_from=2, keep_log=True, signatures={})), T0 + 1.1)  # fmt: skip
    paused(job, step=3, ranks=(0,))
    job.on(Resumed(generation=1, rank=0), T0 + 1.3)
    assert job.world_size == 1
    orders = job.on(Progress(rank=0, step=3), T0 + 1.4)
    assert job.resizing.plan.added == {1: 3} and job.resizing.why == "node 3 is idle"
    assert sent(orders, Pause) == [("all", Pause(generation=2, step=4))]


def test_a_survivor_whose_world_cannot_shrink_says_so_as_it_parks_and_the_state_is_saved():
    """Found at the park, before any survivor is told to resize (one told to resume at the
    old size would wait for the lost ranks): the survivors save the state, the job stops."""
    job, _ = shrinking_job()
    orders = []
    for rank in (0, 2):
        orders += job.on(Parked(generation=1, rank=rank, position=Position(
            step=3, state_step=3, log_from=2, keep_log=True, signatures={},
            cannot_resize="the data stream 'data' is drawn through session.batches()")),
            T0 + 1.1)  # fmt: skip
    assert job.state is S.CHECKPOINTING and not sent(orders, Shrink)
    assert any("cannot shrink: rank 0: the data stream" in line for line in said(orders))
