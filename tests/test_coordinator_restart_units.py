"""A restarted coordinator: the snapshot its predecessor kept, and the decisions of
``REJOINING`` (one test per way out of it), without sockets or processes."""

import json

import pytest

from test_coord_machines import SETTLE_WINDOW_S, T0, kill, running_job, said, sent
from xmig.coord.machine import JobState
from xmig.coord.orders import Finish, Reply, Tick
from xmig.coord.snapshot import SnapshotError, restore, revision, snapshot
from xmig.protocol import (
    AgentHello,
    EndRank,
    MigrateRequest,
    Park,
    Progress,
    Respawn,
    StatusRequest,
    StoreRestarted,
    WorkerDone,
    WorkerExited,
    WorkerJoined,
)

S = JobState
LATER = T0 + 100


def restarted(job, now=LATER):
    """``job`` as a new coordinator reads it back from its snapshot (through JSON)."""
    return restore(job.spec, json.loads(json.dumps(snapshot(job))), now)


def rejoin(job, node, now=LATER, step=5, state="running", pid=None, attempt=0):
    """Node ``node``'s agent says hello again with its workers (one rank per node)."""
    held = [{"rank": node, "pid": pid or 200 + node, "attempt": attempt, "step": step,
             "state": state}]  # fmt: skip
    return job.on(AgentHello(node=node, pid=100 + node, netns=None, workers=held), now)


def test_a_running_job_goes_on_once_every_agent_rejoined():
    job = restarted(running_job(nnodes=2))
    assert job.state is S.REJOINING and job.restarts == 1
    assert rejoin(job, 0)[-1] == Reply({"job": job.spec.to_json(), "generation": 0})
    assert job.state is S.REJOINING  # node 1 is still away
    orders = rejoin(job, 1)
    assert job.state is S.RUNNING and job.progress == {0: 5, 1: 5}
    assert sent(orders, StoreRestarted) == [("all", StoreRestarted(master_addr="127.0.0.1",
                                                                   master_port=0))]  # fmt: skip
    assert "coordinator restarted (restart 1): the job goes on at generation 0" in said(orders)
    (record,) = job.coordinator_restarts
    assert record["state_before"] == "running" and record["missing_nodes"] == []


def test_events_that_come_while_agents_rejoin_wait_and_are_applied_after():
    job = restarted(running_job(nnodes=2))
    rejoin(job, 0)
    # node 0's agent sends what it kept for the coordinator right after its hello
    assert job.on(Progress(rank=0, step=6), LATER) == []
    assert job.on(WorkerExited(rank=0, pid=200, t=LATER), LATER) == []
    assert job.on(StatusRequest(), LATER)[0].value["status"]["status"] == "rejoining"
    rejoin(job, 1)
    assert job.progress[0] == 6 and 0 in job.exited


def test_a_fault_after_the_restart_is_recovered_as_any_other():
    job = restarted(running_job(nnodes=2))
    rejoin(job, 0)
    rejoin(job, 1)
    job.on(kill(1, t=LATER), LATER)
    orders = job.on(Tick(), LATER + SETTLE_WINDOW_S)
    assert job.state is S.RECOVERING
    assert sent(orders, Park) == [("all", Park(generation=1, replaced=[1]))]
    assert [n for n, _ in sent(orders, Respawn)] == [1]


def test_an_agent_that_does_not_come_back_is_a_lost_node():
    job = restarted(running_job(nnodes=2, spare_nodes=1), now=LATER)
    rejoin(job, 0)
    job.on(AgentHello(node=2, pid=102, netns=None, workers=[]), LATER)  # the spare
    assert job.on(Tick(), LATER + job.spec.rejoin_timeout - 1) == []
    orders = job.on(Tick(), LATER + job.spec.rejoin_timeout + 0.1)
    assert job.coordinator_restarts[0]["missing_nodes"] == [1]
    assert job.lost_nodes == [1] and job.state is S.SETTLING
    assert "nodes [1] did not come back" in said(orders)[0]


def test_a_recovery_in_progress_starts_over_rolling_the_step_back():
    job = running_job(nnodes=2)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    job.members[1].attempt, job.members[1].pid = 1, 301  # its replacement had started
    job.worker_pids[1].append(301)
    job = restarted(job)
    rejoin(job, 0)
    orders = rejoin(job, 1, pid=301, attempt=1)
    assert job.state is S.RECOVERING and job.generation == 2
    assert sent(orders, EndRank) == [(1, EndRank(rank=1, pid=301))] and 301 in job.retiring
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1]))]
    ((node, respawn),) = sent(orders, Respawn)
    assert node == 1 and respawn.attempt == 2 and respawn.generation == 2
    assert job.recovery is not None and "restarted during the recovery" in job.recovery.no_replay
    assert "during the recovery: it starts over" in " ".join(said(orders))
    # the ended replacement's hello, kept by its agent while the coordinator was away, is not
    # the new replacement's
    job.on(WorkerJoined(rank=1, pid=301, attempt=1, t=LATER), LATER)
    assert 1 not in job.recovery.joined
    job.on(WorkerJoined(rank=1, pid=302, attempt=2, t=LATER + 1), LATER + 1)
    assert 1 in job.recovery.joined


def test_a_fault_being_settled_is_settled_by_the_restarted_coordinator():
    job = running_job(nnodes=2)
    job.on(kill(1), T0)  # the window is open when the coordinator dies
    job = restarted(job)
    rejoin(job, 0)
    orders = rejoin(job, 1)
    assert job.state is S.RECOVERING and job.generation == 1
    assert sent(orders, Park) == [("all", Park(generation=1, replaced=[1]))]
    assert [f.rank for f in job.faults] == [1]


def test_a_migration_in_progress_is_not_taken_up_the_state_is_saved():
    job = running_job(nnodes=2, spare_nodes=1, checkpoint_dir="/ck")
    job.on(MigrateRequest(rank=1, to=2), T0)
    assert job.state is S.MIGRATING
    job = restarted(job)
    for node in (0, 1):
        rejoin(job, node)
    orders = job.on(AgentHello(node=2, pid=102, netns=None, workers=[]), LATER)
    assert job.state is S.CHECKPOINTING
    assert job.reason == "the coordinator was restarted during a migration"
    assert job.checkpoint is not None and job.checkpoint.holders == [0]
    assert "the job saves its state and stops" in " ".join(said(orders))


@pytest.mark.parametrize("before", [S.COMPLETED, S.STOPPING])
def test_a_job_that_had_ended_or_was_stopping_ends_again(before):
    job = running_job(nnodes=2)
    if before is S.COMPLETED:
        for rank in range(2):
            job.on(WorkerDone(rank=rank, steps=5, params_sha256="ab", checksum="cd",
                              replicas=None), T0)  # fmt: skip
            job.on(WorkerExited(rank=rank, pid=200 + rank, t=T0), T0)
    else:
        job.on(StatusRequest(), T0)
        job._stop("stopped by request", T0)
    assert job.state is before
    job = restarted(job)
    rejoin(job, 0, state="done")
    orders = rejoin(job, 1, state="done")
    assert job.state is (S.COMPLETED if before is S.COMPLETED else S.STOPPING)
    if before is S.COMPLETED:
        (finish,) = [o for o in orders if isinstance(o, Finish)]
        assert finish.summary["status"] == "completed"
        assert finish.summary["coordinator_restarts"][0]["state_before"] == "completed"


def test_the_snapshot_keeps_what_the_summary_reports():
    job = running_job(nnodes=2)
    job.on(kill(1), T0)
    job.on(Tick(), T0 + SETTLE_WINDOW_S)
    back = restarted(job)
    assert back.faults == job.faults and back.generation == job.generation == 1
    assert back.members == job.members and back.worker_pids == job.worker_pids
    assert back.joined == job.joined and back.fired == job.fired
    assert back.rejoin is not None and back.rejoin.busy == {"what": "recovery", "ranks": [1],
                                                            "generation": 1}  # fmt: skip
    assert revision(job) != revision(back)  # a restart is a change of its own


def test_a_snapshot_of_another_job_or_version_is_refused():
    job = running_job(nnodes=2)
    data = snapshot(job)
    with pytest.raises(SnapshotError, match="not a snapshot of job"):
        restore(job.spec, {**data, "job_id": "other"}, LATER)
    with pytest.raises(SnapshotError, match="not a snapshot of job"):
        restore(job.spec, {**data, "version": 99}, LATER)
    with pytest.raises(SnapshotError, match="cannot be read"):
        restore(job.spec, {k: v for k, v in data.items() if k != "members"}, LATER)


def test_the_snapshot_is_rewritten_for_decisions_not_for_every_report():
    """A rank's progress and its end are reported again by its agent to a restarted
    coordinator: writing the snapshot for each (1,024 of them at the end) would cost the
    decision thread seconds."""
    job = running_job(nnodes=2)
    before = revision(job)
    job.on(Progress(rank=0, step=9), T0)
    job.on(WorkerDone(rank=0, steps=9, params_sha256="ab", checksum="cd", replicas=None), T0)
    assert revision(job) == before
    job.on(kill(1), T0)
    assert revision(job) != before


def test_a_death_held_during_a_recovery_is_replaced_when_the_recovery_starts_over():
    """Rank 2 had recovered and died while rank 0 still recovered (held); the coordinator
    restarts: the recovery starts over with rank 2 replaced too."""
    from test_coord_machines import rank_2_recovered

    job, _ = rank_2_recovered()
    job.on(kill(2, t=T0 + 0.6, step=4), T0 + 0.6)
    job = restarted(job)
    assert [f.rank for f in job.held] == [2]
    for node in range(3):
        orders = rejoin(job, node)
    assert job.state is S.RECOVERING and job.recovery.replaced == [1, 2]
    assert sent(orders, Park) == [("all", Park(generation=2, replaced=[1, 2]))]
    assert job.held == [] and [f.rank for f in job.faults] == [1, 2]
