"""The coordinator's state machines, without sockets, threads or processes: each test feeds
events to a ``Job`` (with the wall clock as an argument) and checks the orders and states."""

import dataclasses
from types import SimpleNamespace

import pytest

from xmig.coord.machine import (
    SETTLE_QUIET_S,
    SETTLE_WINDOW_S,
    TRANSITIONS,
    IllegalTransition,
    Job,
    JobState,
)
from xmig.coord.migration import (
    DOWNTIME_PHASES,
    MIGRATION_TRANSITIONS,
    MigrationPhase,
    describe_migration,
)
from xmig.coord.orders import (
    AgentLost,
    Finish,
    Note,
    Refused,
    Reply,
    Say,
    Tick,
    ToAll,
    ToNode,
)
from xmig.coord.recovery import RECOVERY_TRANSITIONS, RecoveryPhase
from xmig.jobspec import HostLaunch, JobSpec
from xmig.protocol import (
    Abort,
    AgentHello,
    CheckpointWritten,
    CriuStatus,
    Dump,
    Dumped,
    Fault,
    FaultRecord,
    MigrateRequest,
    Park,
    Parked,
    Pause,
    Paused,
    PauseRefused,
    Position,
    Prepare,
    Prepared,
    Progress,
    Rebuild,
    Recovered,
    RecoveryFailed,
    Rejoined,
    Release,
    ReplayMismatched,
    Respawn,
    Restore,
    Restored,
    Resume,
    Resumed,
    StateAnnounced,
    StateSent,
    StatusRequest,
    StopJob,
    Stopped,
    StopWorkers,
    WorkerDone,
    WorkerExited,
    WorkerJoined,
    WorkerStarted,
    WriteCheckpoint,
)

S = JobState
T0 = 1000.0


def make_spec(**fields):
    base = {"job_id": "job", "script": "train.py", "args": (), "cwd": "/", "nnodes": 2,
            "nproc_per_node": 1}  # fmt: skip
    return JobSpec(**{**base, **fields})


def sent(orders, kind):
    """The messages of type ``kind`` the orders push, with where: ("all" or a node, msg)."""
    out = []
    for order in orders:
        if isinstance(order, ToAll) and isinstance(order.msg, kind):
            out.append(("all", order.msg))
        elif isinstance(order, ToNode) and isinstance(order.msg, kind):
            out.append((order.node, order.msg))
    return out


def said(orders):
    return [o.text for o in orders if isinstance(o, Say)]


def started_job(**fields) -> Job:
    """A job whose agents all joined: RUNNING, one rank per node, no rank in its loop yet."""
    spec = make_spec(**fields)
    job = Job(spec, started=T0)
    for node in range(spec.all_nodes):
        job.on(AgentHello(node=node, pid=100 + node, netns=None), T0)
    for rank in range(spec.world_size):
        node = rank // spec.nproc_per_node
        job.on(WorkerStarted(rank=rank, node=node, pid=200 + rank, attempt=0, t=T0,
                             from_spare=False), T0)  # fmt: skip
        job.on(WorkerJoined(rank=rank, pid=200 + rank, attempt=0, t=T0), T0)
    return job


def running_job(**fields) -> Job:
    """A job in its steps: every rank at step 3, CRIU usable everywhere."""
    job = started_job(**fields)
    for node in range(job.spec.all_nodes):
        job.on(CriuStatus(node=node, usable=True, detail="ok", gpus=[]), T0)
    for rank in range(job.spec.world_size):
        job.on(Progress(rank=rank, step=3), T0)
    return job


def kill(rank, t=T0, kind="signal", step=3, generation=None):
    return Fault(record=FaultRecord(
        rank=rank, node=rank, pid=200 + rank, attempt=0, kind=kind, detail="SIGKILL", step=step,
        t_fault=t, t_detected=t + 0.01, fault_time_source="detection", detected_after_s=0.01,
        generation=generation,
    ))  # fmt: skip


def position(step=3, stepped=False):
    return Position(step=step, state_step=step + 1 if stepped else step, log_from=step - 1,
                    keep_log=True, signatures={str(step): ["allreduce"]})  # fmt: skip


def recovering_job(**fields) -> tuple[Job, list]:
    """Rank 1 killed, the settle window over: a recovery to generation 1 has begun."""
    job = running_job(**fields)
    job.on(kill(1), T0)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING
    return job, orders


# ---- the tables ----------------------------------------------------------------------------


@pytest.mark.parametrize("table, terminal", [
    (TRANSITIONS, {S.COMPLETED, S.FAILED}),
    (RECOVERY_TRANSITIONS, {RecoveryPhase.DONE, RecoveryPhase.FAILED}),
    (MIGRATION_TRANSITIONS, {MigrationPhase.DONE, MigrationPhase.DROPPED, MigrationPhase.FAILED}),
])  # fmt: skip
def test_every_state_has_a_row_and_only_terminal_states_are_dead_ends(table, terminal):
    states = set(type(next(iter(table))))
    assert set(table) == states
    assert {s for s, nexts in table.items() if not nexts} == terminal
    assert all(nexts <= states for nexts in table.values())


def test_a_transition_outside_the_table_is_refused():
    job = Job(make_spec(), started=T0)
    with pytest.raises(IllegalTransition):
        job._enter(S.COMPLETED, T0)  # STARTING cannot complete
    assert job.state is S.STARTING


# ---- starting ------------------------------------------------------------------------------


def test_starting_to_running_when_every_agent_joined():
    job = Job(make_spec(nnodes=2), started=T0)
    first = job.on(AgentHello(node=0, pid=1, netns=None), T0)
    assert job.state is S.STARTING and isinstance(first[-1], Reply)
    assert first[-1].value["job"]["job_id"] == "job"
    job.on(AgentHello(node=1, pid=2, netns=None), T0)
    assert job.state is S.RUNNING


def test_an_agent_of_an_unknown_or_joined_node_is_refused():
    job = Job(make_spec(nnodes=2, spare_nodes=1), started=T0)
    job.on(AgentHello(node=0, pid=11, netns=None), T0)
    with pytest.raises(Refused, match=r"node rank 0 has already joined \(agent pid 11\)"):
        job.on(AgentHello(node=0, pid=12, netns=None), T0)
    with pytest.raises(Refused, match=r"node rank 5 is not expected: .* 2 node\(s\) and 1 "
                       r"spare, node ranks 0..2"):  # fmt: skip
        job.on(AgentHello(node=5, pid=1, netns=None), T0)
    assert job.agents == {0} and job.agent_pids == {0: 11}


def test_starting_to_stopping_when_agents_do_not_connect_in_time():
    job = Job(make_spec(nnodes=2, agent_connect_timeout=5.0), started=T0)
    job.on(AgentHello(node=0, pid=1, netns=None), T0)
    assert job.on(Tick(), T0 + 4.9) == []
    orders = job.on(Tick(), T0 + 5.1)
    assert job.state is S.STOPPING
    assert "agents of nodes [1] did not connect within 5 s" in job.reason
    assert sent(orders, StopWorkers) == [(0, StopWorkers(grace=3.0))]


def test_a_job_of_hosts_names_the_hosts_that_never_joined():
    job = Job(make_spec(nnodes=3, agent_connect_timeout=5.0, multi_host=True), started=T0)
    job.on(AgentHello(node=1, pid=1, netns=None), T0)
    job.on(Tick(), T0 + 5.1)
    assert job.state is S.STOPPING
    assert "hosts of node ranks [0, 2] did not connect within 5 s (--join-timeout)" in job.reason


def test_the_job_runs_once_its_nodes_joined_and_warns_once_of_spares_that_did_not():
    job = Job(make_spec(nnodes=2, spare_nodes=1, agent_connect_timeout=5.0), started=T0)
    job.on(AgentHello(node=0, pid=1, netns=None), T0)
    job.on(AgentHello(node=1, pid=2, netns=None), T0)
    assert job.state is S.RUNNING  # spare node 2 has not joined: not needed to start
    orders = job.on(Tick(), T0 + 5.1)
    warned = [o for o in orders if isinstance(o, Say)]
    assert len(warned) == 1 and "spare nodes [2] have not joined" in warned[0].text
    assert [o for o in job.on(Tick(), T0 + 6) if isinstance(o, Say)] == []
    job.on(AgentHello(node=2, pid=3, netns=None), T0 + 7)  # a late spare is taken
    assert job.agents == {0, 1, 2} and job.state is S.RUNNING


def _launch(**fields):
    base = {"script": "/job/train.py", "script_sha256": "ab" * 32, "args": ["--lr", "0.1"],
            "cwd": "/job", "nproc_per_node": 2, "nnodes": 2, "spare_nodes": 1,
            "keep_log": True, "faults": [], "resume": None}  # fmt: skip
    return HostLaunch(**{**base, **fields})


def test_a_host_started_with_another_command_line_is_refused_naming_what_differs():
    job = Job(make_spec(nnodes=2, nproc_per_node=2, spare_nodes=1, multi_host=True),
              started=T0, launch=_launch())  # fmt: skip
    # another folder and path to the same script is fine: hosts mount the job where they do
    job.on(
        AgentHello(
            node=1,
            pid=1,
            netns=None,
            launch=_launch(script="/other/train.py", cwd="/other").to_json(),
        ),
        T0,
    )
    assert job.agents == {1}
    bad = _launch(script_sha256="cd" * 32, args=["--lr", "0.2"], nproc_per_node=4)
    with pytest.raises(Refused) as refused:
        job.on(AgentHello(node=0, pid=2, netns=None, launch=bad.to_json()), T0)
    text = str(refused.value)
    assert text.startswith("node rank 0 was started with another command line than node 0's")
    assert "the script's content (train.py: sha256 cdcdcdcdcdcd… vs abababababab…)" in text
    assert "args: ['--lr', '0.2'] vs ['--lr', '0.1']" in text
    assert "nproc-per-node: 4 vs 2" in text
    with pytest.raises(Refused, match="each started by `xmig run --rdzv-endpoint"):
        job.on(AgentHello(node=0, pid=2, netns=None), T0)  # no launch at all
    with pytest.raises(Refused, match="not a host's launch"):
        job.on(AgentHello(node=0, pid=2, netns=None, launch={"script": "x"}), T0)
    assert job.agents == {1} and job.state is S.STARTING


# ---- faults: settle, then recover or stop --------------------------------------------------


def test_running_to_settling_then_recovering_once_no_other_death_came():
    job = running_job()
    orders = job.on(kill(1), T0)
    assert job.state is S.SETTLING
    assert sent(orders, Park) == []  # nothing decided while deaths may still come
    assert job.next_deadline() == T0 + SETTLE_QUIET_S
    assert job.on(Tick(), T0 + SETTLE_QUIET_S / 2) == []
    orders = job.on(Tick(), T0 + SETTLE_QUIET_S)
    assert job.state is S.RECOVERING and job.generation == 1
    assert sent(orders, Park) == [("all", Park(generation=1, replaced=[1]))]
    assert sent(orders, Respawn) == [(1, Respawn(rank=1, generation=1, local_rank=0, attempt=1,
                                                 fired=[], world_size=2,
                                                 launched_as=1))]  # fmt: skip
    assert any("fault: rank 1" in line for line in said(orders))


def test_deaths_that_keep_coming_are_weighed_together_up_to_the_window():
    job = running_job(nnodes=4)
    job.on(kill(1), T0)
    job.on(kill(2), T0 + SETTLE_QUIET_S / 2)  # another death: the quiet time starts again
    assert job.next_deadline() == T0 + SETTLE_QUIET_S * 1.5
    assert job.on(Tick(), T0 + SETTLE_QUIET_S * 1.2) == []
    job.on(kill(3), T0 + SETTLE_WINDOW_S - SETTLE_QUIET_S / 2)  # the window bounds the wait
    assert job.next_deadline() == T0 + SETTLE_WINDOW_S
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING and job.recovery.replaced == [1, 2, 3]


def test_a_communication_error_waits_for_its_death_up_to_the_window():
    job = running_job(nnodes=3)
    job.on(kill(2, kind="comm_error"), T0)
    assert job.next_deadline() == T0 + SETTLE_WINDOW_S  # no death yet: the cause may come
    job.on(kill(1), T0 + 0.01)
    assert job.next_deadline() == T0 + 0.01 + SETTLE_QUIET_S  # it came: settled soon
    job.on(Tick(), T0 + 0.01 + SETTLE_QUIET_S)
    assert job.primary.rank == 1 and job.recovery.replaced == [1]
    lone = running_job(nnodes=3)
    lone.on(kill(2, kind="comm_error"), T0)
    assert lone.on(Tick(), T0 + SETTLE_WINDOW_S / 2) == []
    lone.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert lone.state is S.RECOVERING and lone.recovery.replaced == []  # rebuilt in place


def test_a_death_while_the_survivors_park_widens_the_recovery():
    """A death settled alone, then another one before the plan: the recovery starts over
    with both ranks replaced, and the first replacement's reports are those of a process
    being ended."""
    job = running_job(nnodes=3)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    job.on(WorkerStarted(rank=1, node=1, pid=301, attempt=1, t=T0, from_spare=True), T0 + 0.11)
    job.on(Parked(rank=0, generation=1, position=position(), t=T0), T0 + 0.12)
    orders = job.on(kill(2), T0 + 0.13)
    assert job.state is S.RECOVERING and job.generation == 2
    assert job.recovery.replaced == [1, 2] and job.recovery.survivors == [0]
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1, 2]))]
    assert sent(orders, Respawn) == [
        (1, Respawn(rank=1, generation=2, local_rank=0, attempt=2, fired=[], world_size=3,
                    launched_as=1)),
        (2, Respawn(rank=2, generation=2, local_rank=0, attempt=1, fired=[], world_size=3,
                    launched_as=2)),
    ]  # fmt: skip
    assert 301 in job.retiring
    assert [(f.rank, f.secondary) for f in job.faults] == [(1, False), (2, False)]
    # the first replacement's join, late, is not the recovery's
    job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=T0), T0 + 0.14)
    assert job.recovery.joined == {}
    job.on(WorkerStarted(rank=1, node=1, pid=302, attempt=2, t=T0, from_spare=False), T0 + 0.15)
    assert job.members[1].pid == 302
    orders = job.on(Parked(rank=0, generation=2, position=position(), t=T0), T0 + 0.16)
    assert sent(orders, Rebuild)[0][1].pulls == [1, 2]


def test_a_node_lost_while_the_survivors_park_moves_its_ranks_too():
    job = running_job(nnodes=3, spare_nodes=1)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    orders = job.on(AgentLost(2), T0 + 0.15)
    assert job.state is S.RECOVERING and job.recovery.replaced == [1, 2]
    assert sorted(sent(orders, Respawn), key=lambda s: s[1].rank)[1][0] == 3  # the spare node


def test_a_death_once_the_plan_is_out_ends_the_recovery():
    job = running_job(nnodes=3)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    for rank in (0, 2):
        job.on(Parked(rank=rank, generation=1, position=position(), t=T0), T0 + 0.12)
    assert job.recovery.plan is not None
    job.on(kill(2), T0 + 0.13)
    assert job.recovery is None and job.generation == 1
    assert "a second fault hit during recovery" in job.reason


def test_the_earliest_death_is_the_cause_and_errors_it_explains_are_secondary():
    job = running_job(nnodes=3)
    job.on(kill(2, t=T0 + 0.02, kind="comm_error"), T0)
    job.on(kill(1, t=T0 + 0.01), T0)  # reported later, happened first
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.primary.rank == 1
    assert [(f.rank, f.secondary) for f in job.faults] == [(1, False), (2, True)]
    assert job.recovery.replaced == [1]


def in_group(fault, group, t=None):
    """``fault`` (a comm_error) as failed in the group of ranks ``group``."""
    record = dataclasses.replace(fault.record, group=group)
    if t is not None:
        record = dataclasses.replace(record, t_fault=t)
    return Fault(record=record)


@pytest.mark.parametrize(("group", "rolls_back"), [([0, 1], True), ([1, 3], False),
                                                   (None, False)])  # fmt: skip
def test_an_error_in_a_group_the_death_is_not_in_rolls_the_step_back(group, rolls_back):
    """Rank 3 dies; rank 1's collective failed too. In a group with rank 3 (or one not
    known, as before groups were reported) the death explains it. In one without, a replay
    would keep that group as it is, its failed op never sent again: only a rollback rebuilds
    every group."""
    job = running_job(nnodes=4)
    job.on(in_group(kill(1, kind="comm_error", t=T0), group), T0)
    job.on(kill(3, t=T0 + 0.01), T0 + 0.01)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING and job.recovery.replaced == [3]
    error = next(f for f in job.faults if f.rank == 1)
    if rolls_back:
        assert "group of ranks [0, 1], which holds none of the replaced" in job.recovery.no_replay
        assert not error.secondary and any("also: rank 1" in line for line in said(orders))
    else:
        assert job.recovery.no_replay is None and error.secondary


@pytest.mark.parametrize("planned", [False, True])
def test_an_error_during_a_replay_in_a_group_the_replaced_are_not_in_starts_over_rolling_back(
    planned,
):
    """The error comes once the recovery has begun (from the generation before: the ranks
    have not switched yet). The recovery starts over as a rollback; an error in a group
    with the replaced rank stays the recovered fault's echo."""
    job = planned_job(nnodes=3) if planned else recovering_job(nnodes=3)[0]
    assert job.on(in_group(kill(2, kind="comm_error", generation=0), [1, 2]), T0 + 0.3) == []
    assert job.generation == 1
    orders = job.on(in_group(kill(2, kind="comm_error", generation=0), [0, 2]), T0 + 0.3)
    assert job.generation == 2 and job.recovery.replaced == [1]
    assert "group of ranks [0, 2]" in job.recovery.no_replay
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1]))]
    assert any("rolling the step back instead" in line for line in said(orders))
    # the rollback's own echo of it changes nothing
    assert job.on(in_group(kill(2, kind="comm_error", generation=1), [0, 2]), T0 + 0.4) == []
    assert job.generation == 2


def test_settling_to_stopping_when_no_recovery_is_allowed():
    job = running_job(max_recoveries=0)
    job.on(kill(1), T0)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.STOPPING
    assert "--max-recoveries" in job.reason
    assert {node for node, _ in sent(orders, StopWorkers)} == {0, 1}


def test_a_migration_requested_in_the_settle_window_is_refused_and_recovery_wins():
    """The race of the old coordinator: a migration accepted while a fault settled left the
    dead rank unrecovered until the recovery deadline."""
    job = running_job(spare_nodes=1)
    job.on(kill(1), T0)
    with pytest.raises(Refused, match="handling a fault"):
        job.on(MigrateRequest(rank=0, to=2), T0 + 0.01)
    assert job.migration is None
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING


def test_a_comm_error_of_an_earlier_generation_is_ignored():
    job, _ = recovering_job()
    assert job.on(kill(0, kind="comm_error", generation=0), T0 + 1) == []
    assert job.state is S.RECOVERING


# ---- recovery ------------------------------------------------------------------------------


def test_parking_to_restoring_sends_the_plan_when_every_survivor_parked():
    job, _ = recovering_job(nnodes=3)
    assert sent(job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2), object) == []
    assert job.recovery.phase is RecoveryPhase.PARKING
    orders = job.on(Parked(generation=1, position=position(), rank=2), T0 + 0.3)
    assert job.recovery.phase is RecoveryPhase.RESTORING
    ((where, plan),) = sent(orders, Rebuild)
    assert where == "all" and plan.mode == "replay" and plan.step == 3 and plan.pulls == [1]


def test_a_report_of_another_generation_is_ignored():
    job, _ = recovering_job()
    job.on(Parked(generation=0, position=position(), rank=0), T0 + 0.2)
    assert job.recovery.parked == {}


def test_restoring_to_done_settles_the_job_running():
    job, _ = recovering_job()
    job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2)
    job.on(WorkerStarted(rank=1, node=1, pid=301, attempt=1, t=T0, from_spare=True), T0 + 0.2)
    job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=T0 + 0.25), T0 + 0.25)
    report = {"phases": {"pull": 0.1}, "pull": None, "t_resumed": T0 + 0.5}
    job.on(Recovered(generation=1, role="survivor", rank=0, **report), T0 + 0.5)
    assert job.state is S.RECOVERING
    orders = job.on(Recovered(generation=1, role="replacement", rank=1, **report), T0 + 0.5)
    assert job.state is S.RUNNING and job.recovery is None
    (record,) = job.recoveries
    assert record["rank"] == 1 and record["mode"] == "respawn" and record["from_spare"] == [True]
    assert record["total_s"] == pytest.approx(0.5)
    assert any(line.startswith("recovered rank 1") for line in said(orders))


def rank_2_recovered():
    """Rank 1 killed in a job of 3 ranks; the plan is out and rank 2 has recovered (ranks 0
    and 1 have not yet): the job, and a ``Recovered`` report's fields."""
    job = running_job(nnodes=3)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    for rank in (0, 2):
        job.on(Parked(generation=1, position=position(), rank=rank), T0 + 0.2)
    report = {"phases": {"pull": 0.1}, "pull": None, "t_resumed": T0 + 0.5}
    job.on(Recovered(generation=1, role="survivor", rank=2, **report), T0 + 0.5)
    return job, report


def test_a_death_of_a_rank_that_had_recovered_waits_for_the_recovery_to_end():
    """Under HSDP or tensor parallel a rank that has recovered goes on while others still
    recover. Its death then is held: ending the recovery would leave the ranks at two steps,
    which no checkpoint joins. Once the recovery ends, the death is settled and recovered."""
    job, report = rank_2_recovered()
    job.on(WorkerStarted(rank=1, node=1, pid=301, attempt=1, t=T0, from_spare=True), T0 + 0.2)
    job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=T0 + 0.25), T0 + 0.25)
    orders = job.on(kill(2, t=T0 + 0.6, step=4), T0 + 0.6)
    assert job.state is S.RECOVERING and job.recovery.generation == 1
    assert [f.rank for f in job.held] == [2]
    assert any("fault after its rank had recovered: rank 2" in line for line in said(orders))
    job.on(Recovered(generation=1, role="survivor", rank=0, **report), T0 + 0.7)
    job.on(Recovered(generation=1, role="replacement", rank=1, **report), T0 + 0.7)
    assert job.state is S.SETTLING and job.held == [] and len(job.recoveries) == 1
    orders = job.on(Tick(), T0 + 0.7)
    assert job.state is S.RECOVERING and job.generation == 2 and job.recovery.replaced == [2]
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[2]))]
    assert [f.rank for f in job.faults] == [1, 2]


def test_a_death_of_a_recovered_rank_still_in_the_recoverys_step_ends_the_recovery():
    """A rank that reported it recovered and died in the step the recovery resumed at (its
    rollback could not undo an update it had begun, say) did not go on: nobody is past
    that step, and the recovery ends with the state saved, as for any second fault."""
    job, report = rank_2_recovered()
    job.on(kill(2, t=T0 + 0.6, step=job.recovery.plan.step), T0 + 0.6)
    assert job.held == [] and job.recovery is None
    assert job.reason == "a second fault hit during recovery"


def test_a_death_held_during_a_recovery_that_fails_is_kept_and_not_a_holder():
    job, report = rank_2_recovered()
    job.on(kill(2, t=T0 + 0.6, step=4), T0 + 0.6)
    job.on(Tick(), T0 + 1000)  # the recovery's deadline
    assert job.state is S.STOPPING and job.held == []
    assert [f.rank for f in job.faults] == [1, 2]


def test_a_recovery_notes_each_phase_and_each_ranks_report_for_the_event_log():
    job, orders = recovering_job()
    notes = [o.fields for o in orders if isinstance(o, Note) and o.event == "recovery"]
    assert notes == [{"generation": 1, "what": "phase", "after_s": 0.0, "phase": "parking",
                      "replaced": [1], "placement": {1: 1}}]  # fmt: skip
    report = {"phases": {"pull": 0.1}, "pull": None, "t_resumed": T0 + 0.5}
    orders = [
        *job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2),
        *job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=T0 + 0.25), T0 + 0.25),
        *job.on(Recovered(generation=1, role="survivor", rank=0, **report), T0 + 0.5),
        *job.on(Recovered(generation=1, role="replacement", rank=1, **report), T0 + 0.6),
    ]
    notes = [o.fields for o in orders if isinstance(o, Note) and o.event == "recovery"]
    assert [(n["what"], n.get("phase"), n.get("rank")) for n in notes] == [
        ("parked", None, 0), ("phase", "restoring", None), ("joined", None, 1),
        ("recovered", None, 0), ("recovered", None, 1), ("phase", "done", None),
    ]  # fmt: skip
    assert notes[-1]["record"]["phases"]["respawn"] == pytest.approx(0.15)
    assert [n["after_s"] for n in notes] == sorted(n["after_s"] for n in notes)


def _recovered(job, replay_check, t=T0 + 0.5):
    """Rank 0 parks and recovers with ``replay_check``, rank 1's replacement joins: the
    orders of the last report (the recovery settles)."""
    job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2)
    job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=T0 + 0.25), T0 + 0.25)
    report = {"phases": {"pull": 0.1}, "pull": None, "t_resumed": t}
    job.on(Recovered(generation=1, role="survivor", rank=0, replay_check=replay_check,
                     **report), t)  # fmt: skip
    return job.on(Recovered(generation=1, role="replacement", rank=1, **report), t)


def _summary_record(job):
    from xmig.coord.summary import summary

    return summary(job, T0 + 1)["recoveries"][0]


@pytest.mark.parametrize("check, verified, words", [
    ({"compared": 2, "unverifiable": 0, "differ": []}, True, "verified: 2 replayed"),
    ({"compared": 0, "unverifiable": 0, "differ": []}, "unverifiable", "unverifiable: no coll"),
    (None, "unverifiable", "unverifiable: no collective"),
])  # fmt: skip
def test_a_recovery_says_what_its_replay_showed(check, verified, words):
    job, _ = recovering_job()
    orders = _recovered(job, check)
    assert job.state is S.RUNNING
    (line,) = [text for text in said(orders) if text.startswith("recovered rank 1")]
    assert words in line
    assert _summary_record(job)["verified"] == verified


def test_a_replay_that_came_out_different_is_not_bit_identical_and_the_job_goes_on():
    job, _ = recovering_job()
    check = {"compared": 2, "unverifiable": 0,
             "differ": [{"step": 3, "index": 0, "op": "allreduce"}]}  # fmt: skip
    orders = _recovered(job, check)
    assert job.state is S.RUNNING
    warning = [t for t in said(orders) if t.startswith("warning:")]
    assert warning and "op 0 of step 3 (allreduce) came out different" in warning[0]
    assert "rank 1's inputs for step 3 differ" in warning[0]
    record = _summary_record(job)
    assert (
        record["verified"] is False and "not a function of the step" in record["not_bit_identical"]
    )


def test_with_strict_a_replay_that_came_out_different_stops_the_job():
    job, _ = recovering_job(strict=True)
    check = {"compared": 1, "unverifiable": 0,
             "differ": [{"step": 3, "index": 0, "op": "allreduce"}]}  # fmt: skip
    orders = _recovered(job, check)
    assert job.state is S.STOPPING
    assert any(t.startswith("stopping: --strict: the replayed step is not bit-identical")
               for t in said(orders))  # fmt: skip
    assert sent(orders, Release) == []


def test_with_strict_a_report_that_the_recovery_cannot_be_bit_identical_stops_the_job():
    from xmig.protocol import NotBitIdentical

    for strict, state in ((False, S.RUNNING), (True, S.STOPPING)):
        job, _ = recovering_job(strict=strict)
        _recovered(job, {"compared": 1, "unverifiable": 0, "differ": []})
        orders = job.on(NotBitIdentical(generation=1, why="the data stream is elsewhere",
                                        rank=1), T0 + 0.7)  # fmt: skip
        assert job.state is state
        assert any("the data stream is elsewhere" in t for t in said(orders))
        assert _summary_record(job)["verified"] is False


def test_the_source_digest_is_relayed_and_another_ranks_ignored():
    job, _ = recovering_job(nnodes=3)
    for rank in (0, 2):
        job.on(Parked(generation=1, position=position(), rank=rank), T0 + 0.2)
    source = job.recovery.plan.source
    other = 2 if source == 0 else 0
    assert sent(job.on(StateSent(generation=1, target=1, digest="d", rank=other), T0), object) == []
    orders = job.on(StateSent(generation=1, target=1, digest="d", rank=source), T0)
    assert sent(orders, StateAnnounced) == [
        ("all", StateAnnounced(generation=1, rank=1, source=source, digest="d"))
    ]


def test_parking_to_failed_when_no_plan_can_work():
    job, _ = recovering_job()
    early = Position(step=None, state_step=None, log_from=None, keep_log=True, signatures={})
    orders = job.on(Parked(generation=1, position=early, rank=0), T0 + 0.2)
    assert job.state is S.STOPPING
    assert sent(orders, Abort) and "has not reached session.steps()" in job.reason


def planned_job(**fields) -> Job:
    """``recovering_job`` whose survivors have parked: the plan is out."""
    job, _ = recovering_job(**fields)
    for rank in job.recovery.survivors:
        job.on(Parked(generation=1, position=position(), rank=rank), T0 + 0.2)
    assert job.recovery.plan is not None
    return job


def test_a_second_fault_during_recovery_stops_the_job():
    job = planned_job(nnodes=3)
    orders = job.on(kill(2, t=T0 + 0.3), T0 + 0.3)
    assert job.state is S.STOPPING
    assert job.reason == "a second fault hit during recovery"
    assert sent(orders, Abort) == [("all", Abort(reason="a second fault hit during recovery"))]
    assert [f.rank for f in job.faults] == [1, 2]


@pytest.mark.parametrize("during", ["recovery", "migration"])
def test_an_injected_fault_that_hits_a_recovery_or_a_move_has_fired(during):
    """Whatever state a fault hits, an injected one is counted as fired: a replacement
    started later does not carry it out again, and the run's summary does not call it
    never fired."""
    job = planned_job(nnodes=3) if during == "recovery" else migrating_job()[0]
    spec = {"kind": "kill", "rank": 0, "step": 3, "at": "park"}
    fault = kill(0, t=T0 + 0.3)
    fault = Fault(record=dataclasses.replace(fault.record, injected=spec))
    job.on(fault, T0 + 0.3)
    assert job.fired == {0: [spec]}
    assert [f.injected for f in job.faults][-1] == spec


def test_a_recovery_deadline_stops_the_job_naming_who_is_late():
    job, _ = recovering_job(nnodes=3, recovery_timeout=10.0)
    job.on(Parked(generation=1, position=position(), rank=0), T0 + 1)
    job.on(Tick(), T0 + 9)
    assert job.state is S.RECOVERING
    job.on(Tick(), T0 + 11)
    assert job.state is S.STOPPING
    assert job.reason == "ranks [2] did not park in time"


def test_a_rank_that_cannot_recover_stops_the_job():
    job, _ = recovering_job()
    job.on(RecoveryFailed(error="no state", rank=1), T0 + 1)
    assert job.state is S.STOPPING and "rank 1 could not recover: no state" in job.reason


def test_an_agent_lost_during_recovery_stops_the_job():
    job = planned_job(nnodes=3)
    job.on(AgentLost(2), T0 + 1)
    assert job.state is S.STOPPING
    assert job.reason == "the agent of node 2 was lost during recovery"


def test_a_survivor_exiting_during_recovery_stops_the_job():
    job, _ = recovering_job()
    job.on(WorkerExited(rank=0, pid=200, t=T0), T0 + 1)
    assert job.state is S.STOPPING and "finished and exited during the recovery" in job.reason


def test_a_lost_node_with_a_spare_node_is_recovered_there():
    job = running_job(spare_nodes=1)
    job.on(AgentLost(1), T0)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING
    assert [node for node, _ in sent(orders, Respawn)] == [2]


def test_a_lost_node_without_a_spare_node_stops_the_job():
    job = running_job()
    job.on(AgentLost(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    assert job.state is S.STOPPING and "no spare node" in job.reason


# ---- migration -----------------------------------------------------------------------------


def migrating_job(prepared=True, **fields):
    """A job migrating rank 1 to node 2; ``prepared``: rank 1 has made its room (room for
    3 bytes, at step 3), so every rank is told to pause."""
    job = running_job(spare_nodes=1, **fields)
    orders = job.on(MigrateRequest(rank=1, to=2), T0)
    assert job.state is S.MIGRATING
    if prepared:
        orders = job.on(Prepared(generation=1, ok=True, room_bytes=3, prepare_s=0.05, step=3,
                                 rank=1), T0)  # fmt: skip
    return job, orders


def test_running_to_migrating_asks_the_moving_rank_to_prepare():
    job, orders = migrating_job(prepared=False)
    assert sent(orders, Prepare) == [("all", Prepare(generation=1, rank=1))]
    assert not sent(orders, Pause) and job.migration.phase is MigrationPhase.PREPARING
    assert isinstance(orders[-1], Reply) and "moving rank 1 from node 1 to node 2" in \
        orders[-1].value["migration"]  # fmt: skip


def test_prepared_pauses_every_rank_at_the_next_boundary():
    job, orders = migrating_job()
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=4))]
    assert job.migration.phase is MigrationPhase.PAUSING and job.migration.room_bytes == 3


def test_a_rank_that_trained_on_while_preparing_pauses_after_where_it_got():
    job, _ = migrating_job(prepared=False)
    assert not job.on(Prepared(generation=1, ok=True, step=9, rank=0), T0)  # not the mover
    orders = job.on(Prepared(generation=1, ok=True, room_bytes=3, step=9, rank=1), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=10))]


def test_a_rank_that_could_not_prepare_moves_without_parking():
    job, _ = migrating_job(prepared=False)
    orders = job.on(Prepared(generation=1, ok=False, error="no room", step=3, rank=1), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=4))]
    assert job.migration.room_bytes == 0 and job.migration.prepare_error == "no room"


def test_a_migration_nobody_can_do_is_refused():
    job = running_job()
    with pytest.raises(Refused, match="no idle node"):
        job.on(MigrateRequest(rank=1), T0)
    with pytest.raises(Refused, match="already on node 1"):
        job.on(MigrateRequest(rank=1, to=1), T0)
    assert job.state is S.RUNNING and job.generation == 0


def test_pause_refused_moves_the_pause_to_a_later_step():
    job, _ = migrating_job()
    job.on(Paused(generation=1, step=4, rank=0, stop_s=0.5, park_s=0.4), T0)
    orders = job.on(PauseRefused(generation=1, step=5, rank=1), T0)
    assert sent(orders, Pause) == [("all", Pause(generation=1, step=6))]
    assert job.migration.paused == {}
    assert job.migration.stop_s == job.migration.park_s == 0.0  # that pause's do not count


def test_the_whole_migration_ends_running_with_its_record():
    job, _ = migrating_job()
    job.on(Paused(generation=1, step=4, rank=0, stop_s=0.08), T0 + 0.1)
    # the moving rank parked while its communicator was aborted
    orders = job.on(Paused(generation=1, step=4, rank=1, stop_s=0.15, park_s=0.1), T0 + 0.2)
    assert job.migration.phase is MigrationPhase.DUMPING
    ((node, dump),) = sent(orders, Dump)
    assert node == 1 and dump.rank == 1
    files = [["/dev/shm/xmig-park-j-rank1", 3]]
    orders = job.on(Dumped(rank=1, node=1, generation=1, ok=True, dump_s=0.3, image_bytes=5,
                           held_bytes=7, parked_bytes=3, host_files=files),
                    T0 + 0.6)  # fmt: skip
    ((node, restore),) = sent(orders, Restore)
    assert node == 2 and restore.pid == 201 and job.migration.phase is MigrationPhase.RESTORING
    assert restore.host_files == files
    job.on(Restored(rank=1, node=2, generation=1, ok=True, pid=201, restore_s=0.2), T0 + 0.9)
    assert job.members[1].node == 2 and job.migration.phase is MigrationPhase.REJOINING
    orders = job.on(Rejoined(generation=1, netns=7, rank=1, unpark_s=0.05), T0 + 1.0)
    assert sent(orders, Resume) == [("all", Resume(generation=1))]
    job.on(Resumed(generation=1, rank=0), T0 + 1.1)
    job.on(Resumed(generation=1, rank=1), T0 + 1.2)
    assert job.state is S.RUNNING
    (record,) = job.migrations
    assert record["pid_kept"] and record["to_node"] == 2 and record["total_s"] == pytest.approx(1.2)
    assert (record["held_bytes"], record["parked_bytes"]) == (7, 3)
    phases = record["phases"]
    assert (phases["stop"], phases["park"], phases["unpark"]) == (0.15, 0.1, 0.05)
    assert phases["dump"] == pytest.approx(0.6 - 0.2)  # after every rank paused
    assert phases["rejoin"] == pytest.approx(1.2 - 0.9 - 0.05)
    # the downtime counts from the pause boundary of the rank that took longest to stop,
    # and its phases add up to it
    assert record["downtime_s"] == pytest.approx(0.15 + 1.2 - 0.2)
    assert sum(phases[k] for k in DOWNTIME_PHASES) == pytest.approx(record["downtime_s"])


def test_a_moved_container_keeps_its_pid_inside_and_its_host_pid_is_followed():
    """A container's init is PID 1 of its namespace before and after the move; its PID on
    the host changes, and the job follows it (an order to end the rank names the new one)."""
    job, _ = migrating_job()
    for rank in (0, 1):
        job.on(Paused(generation=1, step=4, rank=rank), T0)
    orders = job.on(Dumped(rank=1, node=1, generation=1, ok=True, container="xmig-j-n1-r1a0-1",
                           own_pid=1), T0)  # fmt: skip
    ((_, restore),) = sent(orders, Restore)
    assert restore.container == "xmig-j-n1-r1a0-1"
    job.on(Restored(rank=1, node=2, generation=1, ok=True, pid=777, own_pid=1), T0 + 0.5)
    assert job.members[1].pid == 777 and job.worker_pids[1] == [201, 777]
    job.on(Rejoined(generation=1, netns=7, rank=1), T0 + 0.6)
    for rank in (0, 1):
        job.on(Resumed(generation=1, rank=rank), T0 + 0.7)
    (record,) = job.migrations
    assert record["pid_kept"] and record["container"] == "xmig-j-n1-r1a0-1"
    assert (record["pid"], record["restored_pid"], record["pid_in_container"]) == (201, 777, 1)
    assert "same PID 1 in container xmig-j-n1-r1a0-1, host PID 201 -> 777" in \
        describe_migration(record)  # fmt: skip


@pytest.mark.parametrize("machines", [("m1", "m1"), ("m1", "m2"), ("", "")])
def test_a_target_on_the_source_machine_reads_the_images_where_they_were_written(machines):
    job = running_job(spare_nodes=1)
    for node, machine in zip((1, 2), machines, strict=True):  # the source and the target
        job.agent_machines[node] = machine
    job.on(MigrateRequest(rank=1, to=2), T0)
    job.on(Prepared(generation=1, ok=True, room_bytes=3, step=3, rank=1), T0)
    job.on(Paused(generation=1, step=4, rank=0), T0)
    ((_, dump),) = sent(job.on(Paused(generation=1, step=4, rank=1), T0), Dump)
    serve = [["10.0.0.1", 5000]] if dump.serve else None
    orders = job.on(Dumped(rank=1, node=1, generation=1, ok=True, serve=serve), T0)
    ((_, restore),) = sent(orders, Restore)
    local = machines[0] == machines[1] != ""
    assert (restore.images == dump.images) is local and dump.serve is not local
    assert (restore.fetch is None) is local


def test_a_failed_dump_stops_the_job():
    job, _ = migrating_job()
    for rank in (0, 1):
        job.on(Paused(generation=1, step=4, rank=rank), T0)
    orders = job.on(Dumped(rank=1, node=1, generation=1, ok=False, error="criu"), T0)
    assert job.state is S.STOPPING and sent(orders, Abort)
    assert job.reason == "checkpointing rank 1 failed: criu"


@pytest.mark.parametrize("prepared", [False, True])
def test_a_rank_finishing_before_the_pause_drops_the_migration(prepared):
    job, _ = migrating_job(prepared=prepared)
    orders = job.on(WorkerDone(rank=0, steps=4, params_sha256=None, checksum=None), T0)
    assert job.state is S.RUNNING and job.migration is None
    assert any("the job finished first" in line for line in said(orders))


def test_an_agent_lost_mid_migration_stops_the_job():
    job, _ = migrating_job()
    for rank in (0, 1):
        job.on(Paused(generation=1, step=4, rank=rank), T0)
    job.on(AgentLost(2), T0)  # the target, a spare node without ranks
    assert job.state is S.STOPPING and job.reason == "the agent of node 2 was lost"


def test_a_fault_during_a_migration_with_nowhere_to_save_stops_the_job():
    job, _ = migrating_job()
    job.on(kill(0), T0)
    assert job.state is S.STOPPING and job.reason == "a fault hit during the migration"


def test_a_fault_while_the_world_pauses_for_a_migration_saves_from_every_rank_left():
    # rank 1, the one to move, is still at its boundary with its tensors (it gives them back
    # as it parks): it holds the state as every other rank does
    job, _ = migrating_job(checkpoint_dir="/ck")
    job.on(Paused(generation=1, step=4, rank=1, stop_s=0.1, park_s=0.05), T0)
    orders = job.on(kill(0), T0 + 0.1)
    assert job.state is S.CHECKPOINTING and job.reason == "a fault hit during the migration"
    assert job.checkpoint.holders == [1]
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[0]))]
    assert "saving a just-in-time checkpoint from ranks [1]" in said(orders)


def test_a_fault_while_a_rank_is_being_moved_saves_from_the_ranks_not_in_flight():
    job = running_job(nnodes=3, spare_nodes=1, checkpoint_dir="/ck")
    job.on(MigrateRequest(rank=1, to=3), T0)
    job.on(Prepared(generation=1, ok=True, room_bytes=3, step=3, rank=1), T0)
    for rank in range(3):
        job.on(Paused(generation=1, step=4, rank=rank), T0 + 0.1)
    assert job.migration.phase is MigrationPhase.DUMPING
    orders = job.on(kill(2), T0 + 0.2)
    # rank 1 is frozen, or on its way to node 3: rank 0 alone holds the state it can write
    assert job.state is S.CHECKPOINTING and job.checkpoint.holders == [0]
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1, 2]))]


def test_the_pause_gets_the_whole_deadline_after_the_room_is_made():
    job, _ = migrating_job(prepared=False, recovery_timeout=5.0)
    job.on(Tick(), T0 + 4)
    job.on(Prepared(generation=1, ok=True, room_bytes=3, step=3, rank=1), T0 + 4)
    job.on(Tick(), T0 + 8)
    assert job.state is S.MIGRATING
    job.on(Tick(), T0 + 9.5)  # 5 s after the room was made, 9 s after the start
    assert job.state is S.STOPPING and "was not moved within 9 s" in job.reason


def test_a_migration_deadline_stops_the_job():
    job, _ = migrating_job(recovery_timeout=5.0)
    job.on(Tick(), T0 + 6)
    assert job.state is S.STOPPING and "was not moved within 5 s" in job.reason


# ---- ending --------------------------------------------------------------------------------


def test_every_rank_done_releases_them_then_running_to_completed():
    job = running_job()
    job.on(WorkerDone(rank=0, steps=5, params_sha256="abc", checksum="c"), T0)
    orders = job.on(WorkerDone(rank=1, steps=5, params_sha256=None, checksum="c"), T0)
    assert sent(orders, Release) == [("all", Release())]
    job.on(WorkerExited(rank=0, pid=200, t=T0), T0)
    orders = job.on(WorkerExited(rank=1, pid=201, t=T0), T0 + 2)
    assert job.state is S.COMPLETED
    (finish,) = [o for o in orders if isinstance(o, Finish)]
    assert finish.summary["exit_code"] == 0 and finish.summary["final_params_sha256"] == "abc"
    assert finish.summary["duration_s"] == pytest.approx(2.0)


def test_replicas_that_end_different_fail_the_job():
    job = running_job()
    job.on(WorkerDone(rank=0, steps=5, params_sha256="abc", checksum="c0"), T0)
    orders = job.on(WorkerDone(rank=1, steps=5, params_sha256=None, checksum="c1"), T0)
    assert job.state is S.STOPPING and not sent(orders, Release)
    assert "parameters differ at the end" in job.verdict


def test_stopping_to_failed_once_every_agent_stopped():
    job = running_job()
    job.on(StopJob(reason="interrupted by SIGINT"), T0)
    assert job.state is S.STOPPING
    job.on(Stopped(node=0), T0 + 0.1)
    orders = job.on(Stopped(node=1), T0 + 0.2)
    assert job.state is S.FAILED
    (finish,) = [o for o in orders if isinstance(o, Finish)]
    assert finish.summary["message"] == "failed: interrupted by SIGINT"
    assert finish.summary["stop_s"] == pytest.approx(0.2)


def test_stopping_to_failed_when_agents_do_not_confirm_in_time():
    job = running_job(stop_grace=1.0)
    job.on(StopJob(reason="test"), T0)
    job.on(Stopped(node=0), T0)
    assert job.on(Tick(), T0 + 10) == []
    orders = job.on(Tick(), T0 + 11.5)
    assert job.state is S.FAILED
    assert any("agents of nodes [1] did not confirm the stop" in line for line in said(orders))


def test_every_state_change_is_noted_for_the_event_log():
    job, orders = recovering_job()
    notes = [o for o in orders if isinstance(o, Note)]
    assert {"from": "settling", "to": "recovering"} in [n.fields for n in notes if n.event == "job"]
    assert any(n.event == "generation" and n.fields["generation"] == 1 for n in notes)


def test_status_answers_without_changing_anything():
    job = running_job()
    (reply,) = job.on(StatusRequest(), T0)
    assert reply.value["status"]["status"] == "running"
    assert reply.value["status"]["progress"] == {"0": 3, "1": 3}


def test_replicas_are_compared_within_their_own_set():
    from xmig.coord.decide import differing_replicas

    sets = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    assert differing_replicas({0: "a", 1: "a", 2: "b", 3: "b"}, sets) is None
    assert differing_replicas({0: "a", 1: "a", 2: "b", 3: "c"}, sets) == {2: "b", 3: "c"}
    # no sets named: every rank is a replica of every other
    assert differing_replicas({0: "a", 1: "b"}, {0: None, 1: None}) == {0: "a", 1: "b"}


def test_the_final_fingerprint_covers_every_set_of_replicas():
    import hashlib

    from xmig.coord.summary import final_fingerprint
    from xmig.protocol import WorkerDone

    def done(rank, digest, replicas):
        return WorkerDone(rank=rank, steps=8, params_sha256=digest, checksum=None,
                          replicas=replicas)  # fmt: skip

    job = SimpleNamespace(done={0: done(0, "a", None), 1: done(1, None, None)})
    assert final_fingerprint(job) == "a"  # one set: rank 0's, as always
    job.done = {0: done(0, "a", [0, 1]), 1: done(1, None, [0, 1]), 2: done(2, "b", [2, 3])}
    assert final_fingerprint(job) == hashlib.sha256(b"0:a;2:b;").hexdigest()


# ---- a fault that cannot be recovered: a just-in-time checkpoint, then the stop ----------------


def test_an_unrecoverable_fault_saves_the_state_before_the_job_stops():
    from xmig.coord.checkpoint import Sealed
    from xmig.coord.orders import Seal

    job = running_job(nnodes=3, max_recoveries=0, checkpoint_dir="/ck")
    job.on(kill(1), T0)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S + 0.01)
    assert job.state is S.CHECKPOINTING and job.generation == 1
    assert sent(orders, Park) == [("all", Park(generation=1, replaced=[1]))]
    assert not sent(orders, StopWorkers)
    job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2)
    orders = job.on(Parked(generation=1, position=position(), rank=2), T0 + 0.2)
    ((_, write),) = sent(orders, WriteCheckpoint)
    assert write == WriteCheckpoint(generation=1, folder="/ck/.job-step3.partial", step=3,
                                    writers={"0": 0})  # fmt: skip
    orders = job.on(CheckpointWritten(generation=1, shard=0, file="shard-00000.safetensors",
                                      bytes=100, sha256="ab", seconds=0.1, objects=["model"],
                                      first_step=0, rank=0), T0 + 0.3)  # fmt: skip
    (seal,) = [o for o in orders if isinstance(o, Seal)]
    assert (seal.partial, seal.final) == ("/ck/.job-step3.partial", "/ck/job-step3")
    orders = job.on(Sealed(1), T0 + 0.4)
    assert job.state is S.STOPPING and sent(orders, StopWorkers)
    assert any("just-in-time checkpoint of step 3 written to /ck/job-step3" in t
               for t in said(orders))  # fmt: skip
    assert job.jit_checkpoint["path"] == "/ck/job-step3" and job.jit_checkpoint["complete"]


def test_a_fault_while_parking_for_the_checkpoint_leaves_that_rank_out():
    job = running_job(nnodes=3, max_recoveries=0, checkpoint_dir="/ck")
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S + 0.01)
    job.on(Parked(generation=1, position=position(), rank=0), T0 + 0.2)
    orders = job.on(kill(2, t=T0 + 0.3), T0 + 0.3)
    assert job.state is S.CHECKPOINTING
    assert sent(orders, WriteCheckpoint)[0][1].writers == {"0": 0}


def test_without_a_holder_nothing_is_saved_and_the_job_stops_at_once():
    job = running_job(nnodes=1, nproc_per_node=1, checkpoint_dir="/ck")
    job.on(kill(0), T0)
    orders = job.on(Tick(), T0 + SETTLE_WINDOW_S + 0.01)
    assert job.state is S.STOPPING and sent(orders, Abort)
    assert job.jit_checkpoint == {"path": None, "step": None,
                                  "why": "no rank that holds the state is left"}  # fmt: skip


def test_a_replay_refused_by_a_replacement_starts_the_recovery_over_as_a_rollback():
    job, _ = recovering_job(nnodes=3)
    job.on(WorkerStarted(rank=1, node=1, pid=301, attempt=1, t=T0, from_spare=False), T0)
    for rank in (0, 2):
        job.on(Parked(generation=1, position=position(), rank=rank), T0 + 0.2)
    assert job.recovery.plan.mode == "replay"
    orders = job.on(ReplayMismatched(generation=1, why="op 0 differs", rank=1), T0 + 0.5)
    assert job.state is S.RECOVERING and job.generation == 2
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1]))]
    ((node, respawn),) = sent(orders, Respawn)
    assert node == 1 and respawn.attempt == 2
    # the refusing replacement's end and the survivors' failed replay belong to generation 1
    job.on(RecoveryFailed(error="connection closed", generation=1, rank=0), T0 + 0.6)
    exit_of_refuser = Fault(record=FaultRecord(
        rank=1, node=1, pid=301, attempt=1, kind="exit", detail="exit 3", step=3,
        t_fault=T0 + 0.6, t_detected=T0 + 0.61, fault_time_source="detection",
        detected_after_s=0.01))  # fmt: skip
    job.on(exit_of_refuser, T0 + 0.61)
    assert job.state is S.RECOVERING and job.recovery.generation == 2
    job.on(Parked(generation=2, position=position(), rank=0), T0 + 0.7)
    orders = job.on(Parked(generation=2, position=position(), rank=2), T0 + 0.7)
    ((_, plan),) = sent(orders, Rebuild)
    assert plan.mode == "rollback" and plan.why.startswith("replaying it failed: rank 1's op")


def test_a_recovery_given_up_ends_its_replacement_before_the_survivors_save():
    from xmig.protocol import EndRank

    job = planned_job(nnodes=3, checkpoint_dir="/ck")
    job.on(WorkerStarted(rank=1, node=1, pid=301, attempt=1, t=T0, from_spare=False), T0)
    orders = job.on(kill(2, t=T0 + 0.3), T0 + 0.3)
    assert sent(orders, EndRank) == [(1, EndRank(rank=1, pid=301))]
    assert job.state is S.CHECKPOINTING
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1, 2]))]


@pytest.mark.parametrize(("rank", "group", "replaced", "unexplained"), [
    (1, [0, 1], [3], True),  # a group without the dead rank: a fault of its own
    (1, [1, 3], [3], False),  # the dead rank's group: its echo
    (3, [2, 3], [3], False),  # the dead rank's own report
    (1, None, [3], False),  # a group not said
    (1, [0, 1], [], False),  # nobody replaced: every group is rebuilt anyway
])  # fmt: skip
def test_which_failed_collectives_the_deaths_explain(rank, group, replaced, unexplained):
    from xmig.coord.decide import unexplained_error

    error = dataclasses.replace(kill(rank, kind="comm_error").record, group=group)
    why = unexplained_error([error], replaced)
    assert (why is not None) is unexplained
    if unexplained:
        assert f"rank {rank} in the group of ranks {group}" in why
