"""Recovery plans: replay when the survivors' logs allow it, roll back otherwise, and the
record a finished recovery leaves behind."""

from dataclasses import replace

import pytest

from xmig.coord.recovery import Recovery, RecoveryImpossible, describe_recovery, plan_rebuild
from xmig.protocol import FaultRecord, Position, Rebuild, Recovered

SUM = "allreduce|(10,):torch.float32|reduceOp=RedOpType.SUM"
MAX = "allreduce|(10,):torch.float32|reduceOp=RedOpType.MAX"
GATHER = "allgather|(4,);(4,)|(4,):torch.float32|"


def position(step, stepped=False, log_from=None, keep_log=True, signatures=None, waiting=False):
    """What a survivor reports when it parks at ``step`` (``waiting``: past the update, in a
    collective issued after it)."""
    return Position(
        step=step,
        state_step=step + 1 if stepped else step,
        log_from=step - 1 if log_from is None else log_from,
        keep_log=keep_log,
        signatures={str(step): [SUM]} if signatures is None else signatures,
        pending=1 if waiting or not stepped else 0,
        optimizer_waiting=False,
    )


# ---- replay --------------------------------------------------------------------------------


def test_replay_resumes_at_the_lowest_state_step():
    """Every survivor keeps its log back to the lowest state step: replay from there."""
    positions = {
        0: position(3, stepped=True),  # state_step 4
        2: position(3),  # state_step 3
        3: position(3),
    }
    plan = plan_rebuild(positions, replaced=[5, 1], generation=7)
    assert isinstance(plan, Rebuild)
    assert plan.generation == 7
    assert plan.mode == "replay"
    assert plan.step == 3
    assert plan.source in (2, 3)
    assert positions[plan.source].state_step == 3
    assert plan.pulls == [1, 5]
    assert plan.why is None


def test_replay_source_prefers_the_longest_log_of_the_resume_step():
    """Among survivors at the resume step, the one that logged most ops of it serves."""
    positions = {
        0: position(3, signatures={"3": [SUM]}),
        1: position(3, signatures={"3": [SUM, GATHER, SUM]}),
        2: position(3, signatures={"3": [SUM, GATHER]}),
        # further ahead and with the longest log of all, but not at the resume step
        3: position(3, stepped=True, signatures={"3": [SUM, GATHER, SUM, MAX]}),
    }
    plan = plan_rebuild(positions, replaced=[4], generation=1)
    assert plan.mode == "replay"
    assert plan.step == 3
    assert plan.source == 1
    assert plan.pulls == [4]


def test_replay_source_ties_go_to_the_lowest_rank():
    positions = {r: position(2) for r in (3, 1, 2)}
    plan = plan_rebuild(positions, replaced=[0], generation=2)
    assert plan.mode == "replay"
    assert plan.source == 1


def test_prefix_consistent_logs_still_replay():
    """A survivor that logged fewer ops of a step (it was behind) does not force a rollback."""
    positions = {
        0: position(4, signatures={"4": [SUM]}),
        1: position(4, signatures={"4": [SUM, GATHER, MAX]}),
        2: position(4, signatures={"4": []}),
        3: position(4, signatures={}),
    }
    plan = plan_rebuild(positions, replaced=[], generation=3)
    assert plan.mode == "replay"
    assert plan.step == 4
    assert plan.source == 1
    assert plan.pulls == []
    assert plan.why is None


def test_replay_with_survivors_in_different_steps():
    """Ops logged in the step before the resume step are not compared."""
    positions = {
        0: position(5, stepped=True, log_from=4, signatures={"4": [MAX], "5": [SUM]}),
        1: position(5, log_from=4, signatures={"4": [SUM], "5": [SUM]}),
    }
    plan = plan_rebuild(positions, replaced=[2], generation=1)
    assert plan.mode == "replay"
    assert plan.step == 5
    assert plan.source == 1


def test_survivors_waiting_in_a_collective_after_the_update_replay_that_step_in_place():
    """A mean loss all-reduced after the update broke: the step's logged ops are issued
    again from its start (done ones into scratch), and the job resumes past the update."""
    positions = {0: position(3, stepped=True, waiting=True), 1: position(3, stepped=True)}
    plan = plan_rebuild(positions, replaced=[], generation=2)
    assert (plan.mode, plan.step, plan.replay_from, plan.pulls) == ("replay", 4, 3, [])


def test_a_plain_replay_starts_at_its_resume_step():
    positions = {0: position(3, stepped=True), 1: position(3)}
    assert plan_rebuild(positions, replaced=[2], generation=1).replay_from is None


def test_a_replacement_cannot_issue_the_collective_its_peers_wait_in_after_the_update():
    positions = {0: position(3, stepped=True, waiting=True), 1: position(3, stepped=True)}
    with pytest.raises(RecoveryImpossible, match="rank 0 has taken step 3's update.*rank 2's "
                       "replacement resumes at step 4 and cannot issue it"):  # fmt: skip
        plan_rebuild(positions, replaced=[2], generation=1)


@pytest.mark.parametrize("survivor, why", [
    ({"keep_log": False}, "the replay log is off"),
    ({"log_from": 4}, "no longer holds the log of step 3"),
])  # fmt: skip
def test_no_rollback_hands_a_waiting_survivor_a_result_made_without_its_peers(survivor, why):
    """A rollback serves the rest of the step locally, and that rank's step is not redone."""
    positions = {0: position(3, stepped=True, waiting=True, **survivor),
                 1: position(3, stepped=True, **survivor)}  # fmt: skip
    with pytest.raises(RecoveryImpossible, match=f"waits in a collective.*{why}"):
        plan_rebuild(positions, replaced=[], generation=1)


# ---- rollback ------------------------------------------------------------------------------


def test_rollback_when_the_replay_log_is_off():
    """Without logs the job resumes at the furthest state step; laggards pull it too."""
    positions = {
        0: position(3, stepped=True, keep_log=False),  # state_step 4
        1: position(3, keep_log=False),  # state_step 3
        2: position(3, stepped=True, keep_log=False),  # state_step 4
        4: position(3, keep_log=False),  # state_step 3
    }
    plan = plan_rebuild(positions, replaced=[5, 3], generation=4)
    assert plan.mode == "rollback"
    assert plan.generation == 4
    assert plan.step == 4
    assert plan.source == 0
    assert plan.pulls == [1, 3, 4, 5]
    assert "replay log" in plan.why


def test_rollback_when_one_survivor_keeps_no_log():
    positions = {0: position(3, stepped=True), 1: position(3, keep_log=False)}
    plan = plan_rebuild(positions, replaced=[2], generation=1)
    assert plan.mode == "rollback"
    assert plan.step == 4
    assert plan.source == 0
    assert plan.pulls == [1, 2]
    assert "replay log" in plan.why


def test_rollback_when_a_log_starts_after_the_lowest_state_step():
    """A survivor that dropped the log of the resume step cannot replay it."""
    positions = {
        0: position(6, stepped=True, log_from=7),  # state_step 7, log only from 7
        1: position(6),  # state_step 6
    }
    plan = plan_rebuild(positions, replaced=[2], generation=2)
    assert plan.mode == "rollback"
    assert plan.step == 7
    assert plan.source == 0
    assert plan.pulls == [1, 2]
    assert "6" in plan.why
    assert "log" in plan.why


def test_rollback_when_a_log_start_is_unknown():
    positions = {0: position(6, log_from=6), 1: position(6)}
    positions[0] = replace(positions[0], log_from=None)
    plan = plan_rebuild(positions, replaced=[2], generation=2)
    assert plan.mode == "rollback"
    assert plan.why is not None


def test_rollback_when_survivors_logged_different_ops():
    """Lists that are not prefixes of one another mean the ranks diverged."""
    positions = {
        0: position(3, stepped=True, signatures={"3": [SUM, GATHER]}),  # state_step 4
        1: position(3, signatures={"3": [SUM, MAX]}),  # state_step 3
    }
    plan = plan_rebuild(positions, replaced=[2], generation=5)
    assert plan.mode == "rollback"
    assert plan.step == 4
    assert plan.source == 0
    assert plan.pulls == [1, 2]
    assert "different ops" in plan.why
    assert "3" in plan.why


def test_rollback_at_the_same_step_pulls_only_the_replaced():
    """When every survivor is at the same state step, a rollback pulls nothing more."""
    positions = {
        0: position(3, signatures={"3": [SUM]}),
        1: position(3, signatures={"3": [MAX]}),
    }
    plan = plan_rebuild(positions, replaced=[2], generation=1)
    assert plan.mode == "rollback"
    assert plan.step == 3
    assert plan.source == 0
    assert plan.pulls == [2]


# ---- impossible ----------------------------------------------------------------------------


def test_impossible_before_the_step_boundary():
    positions = {0: position(3), 1: position(3)}
    positions[1] = replace(positions[1], state_step=None)
    with pytest.raises(RecoveryImpossible, match=r"session\.steps\(\)") as info:
        plan_rebuild(positions, replaced=[2], generation=1)
    assert "rank 1" in str(info.value)


def test_impossible_without_survivors():
    with pytest.raises(RecoveryImpossible):
        plan_rebuild({}, replaced=[0, 1], generation=1)


# ---- the record ----------------------------------------------------------------------------

PHASES = ["detect", "park", "respawn", "rebuild", "pull", "replay"]


def finished_recovery(plan, replaced, survivors, t0=1000.0):
    """A recovery whose every rank resumed, with made-up but consistent times."""
    primary = FaultRecord(rank=2, node=0, pid=1, attempt=0, kind="kill", detail="", step=3,
                          t_fault=t0, t_detected=t0 + 0.25, fault_time_source="detection",
                          detected_after_s=0.25)  # fmt: skip
    rec = Recovery(
        generation=plan.generation,
        primary=primary,
        replaced=replaced,
        survivors=survivors,
        started=t0 + 0.5,
        deadline=t0 + 100,
    )
    rec.parked_at = t0 + 0.75
    rec.plan = plan
    for r in replaced:
        rec.joined[r] = t0 + 3.5
    for i, r in enumerate(survivors):
        rec.recovered[r] = Recovered(
            generation=plan.generation, role="survivor", rank=r,
            phases={"rebuild": 0.5 + 0.1 * i, "replay": 0.2 + 0.1 * i},
            pull=None, t_resumed=t0 + 4.0 + 0.1 * i,
        )  # fmt: skip
    for r in replaced:
        rec.recovered[r] = Recovered(
            generation=plan.generation, role="replacement", rank=r,
            phases={"rebuild": 9.0, "replay": 9.0},  # joiners do not count for these
            pull={"bytes": 2_000_000_000, "seconds": 0.5}, t_resumed=t0 + 4.5,
        )  # fmt: skip
    return rec


def test_record_of_a_respawn():
    plan = plan_rebuild({0: position(3), 1: position(3)}, replaced=[2], generation=1)
    rec = finished_recovery(plan, replaced=[2], survivors=[0, 1])
    assert rec.expected == {0, 1, 2}
    record = rec.record(1000.0)
    assert record["mode"] == "respawn"
    assert record["generation"] == 1
    assert record["rank"] == 2
    assert record["ranks"] == [2]
    assert record["fault_kind"] == "kill"
    assert record["step"] == 3
    assert record["resume_step"] == 3
    assert record["source"] == plan.source
    assert record["why_rollback"] is None
    assert list(record["phases"]) == PHASES
    assert record["phases"]["detect"] == pytest.approx(0.25)
    assert record["phases"]["park"] == pytest.approx(0.25)
    assert record["phases"]["respawn"] == pytest.approx(3.0)
    assert record["phases"]["rebuild"] == pytest.approx(0.6)
    assert record["phases"]["pull"] == pytest.approx(0.5)
    assert record["phases"]["replay"] == pytest.approx(0.3)
    assert record["total_s"] == pytest.approx(4.5)
    assert record["total_s"] > 0
    assert record["pull_bytes"] == 2_000_000_000
    assert record["pull_gb_per_s"] == pytest.approx(4.0)

    text = describe_recovery(record)
    assert "rank 2" in text
    assert "respawn" in text
    assert "rolled back" not in text


def test_record_of_an_in_place_retry():
    plan = plan_rebuild({0: position(3), 1: position(3)}, replaced=[], generation=2)
    rec = finished_recovery(plan, replaced=[], survivors=[0, 1])
    record = rec.record(1000.0)
    assert record["mode"] == "in-place retry"
    assert list(record["phases"]) == PHASES
    assert record["phases"]["respawn"] == 0.0
    assert record["phases"]["pull"] == 0.0
    assert record["pull_bytes"] == 0
    assert record["pull_gb_per_s"] is None
    assert record["total_s"] == pytest.approx(4.1)
    text = describe_recovery(record)
    assert "rank 2" in text
    assert "in-place retry" in text


def test_record_of_a_rollback():
    positions = {0: position(3, stepped=True, keep_log=False), 1: position(3, keep_log=False)}
    plan = plan_rebuild(positions, replaced=[2], generation=3)
    rec = finished_recovery(plan, replaced=[2], survivors=[0, 1])
    record = rec.record(1000.0)
    assert record["mode"] == "rollback"
    assert record["resume_step"] == 4
    assert record["source"] == 0
    assert "replay log" in record["why_rollback"]
    assert list(record["phases"]) == PHASES
    assert record["total_s"] > 0
    text = describe_recovery(record)
    assert "rank 2" in text
    assert "rollback" in text
    assert "rolled back because the replay log is off" in text


def test_record_without_parking_time_counts_zero():
    plan = plan_rebuild({0: position(3)}, replaced=[1], generation=1)
    rec = finished_recovery(plan, replaced=[1], survivors=[0])
    rec.parked_at = None
    assert rec.record(1000.0)["phases"]["park"] == 0.0


# ---- DDP's bucket layout -------------------------------------------------------------------


def with_layout(step, digest, source):
    return replace(position(step), ddp_layout=digest, ddp_layout_source=source)


def test_layout_sources_are_the_workers_names():
    """The coordinator (no torch) and the worker's DDP module spell the sources alike."""
    from xmig.coord import recovery
    from xmig.state import ddp

    assert (recovery.LAYOUT_LOCAL, recovery.LAYOUT_INCONSISTENT) == (ddp.LOCAL, ddp.INCONSISTENT)


def test_survivors_with_different_layouts_cannot_be_joined():
    positions = {1: with_layout(1, "aaaa", "local"), 2: with_layout(1, "bbbb", "local")}
    with pytest.raises(RecoveryImpossible, match="different DDP bucket layouts"):
        plan_rebuild(positions, replaced=[0], generation=1)


def test_a_layout_half_received_from_a_dead_root_that_differs_is_lost():
    positions = {1: with_layout(1, "aaaa", "inconsistent"), 2: with_layout(1, "aaaa", "mixed")}
    with pytest.raises(RecoveryImpossible, match="rest of it is lost"):
        plan_rebuild(positions, replaced=[0], generation=1)


@pytest.mark.parametrize("sources, verify", [
    (("local", "local"), True),  # nobody saw rank 0's: its replacement checks its order
    (("mixed", "local"), True),
    (("root", "root"), False),
    (("mixed", "mixed"), False),
])  # fmt: skip
def test_a_layout_the_survivors_made_themselves_is_verified(sources, verify):
    positions = {r + 1: with_layout(1, "aaaa", s) for r, s in enumerate(sources)}
    plan = plan_rebuild(positions, replaced=[0], generation=1)
    assert plan.mode == "replay" and plan.verify_ready_order is verify


# ---- replicas: each rank's state from a rank that holds the same ---------------------------


def test_each_replaced_rank_pulls_from_a_replica_of_its_own_state():
    """DDP over sub-groups {0, 1} and {2, 3}: rank 1's state is rank 0's, rank 3's rank 2's."""
    positions = {r: replace(position(4), replicas=[r - r % 2, r - r % 2 + 1]) for r in (0, 2)}
    plan = plan_rebuild(positions, replaced=[1, 3], generation=2)
    assert plan.mode == "replay" and plan.sources == {"1": 0, "3": 2}
    assert plan.served_by(0) == [1] and plan.served_by(2) == [3] and plan.served_by(1) == []
    assert plan.source_of(3) == 2


def test_a_plan_without_sources_is_served_by_its_source():
    plan = Rebuild(generation=1, mode="replay", step=3, source=2, pulls=[0, 1])
    assert plan.served_by(2) == [0, 1] and plan.source_of(1) == 2


def test_no_surviving_replica_means_no_recovery():
    positions = {0: replace(position(4), replicas=[0, 1]), 1: replace(position(4), replicas=[0, 1])}
    with pytest.raises(RecoveryImpossible, match="no surviving rank holds a replica of rank 3"):
        plan_rebuild(positions, replaced=[3], generation=2)


def test_a_replica_that_stepped_already_rolls_everyone_forward():
    """Rank 3's replica (rank 2) has taken step 4's update, rank 1 (waiting for rank 3) has
    not: nothing can replay step 4 for rank 3, so every rank goes on from step 5, rank 1
    with its own replica's state."""
    positions = {
        0: replace(position(4, stepped=True), replicas=[0, 1]),
        1: replace(position(4), replicas=[0, 1]),
        2: replace(position(4, stepped=True), replicas=[2, 3]),
    }
    plan = plan_rebuild(positions, replaced=[3], generation=2)
    assert plan.mode == "rollback" and plan.step == 5
    assert plan.why == "rank 3's replicas have taken step 4's update already"
    assert plan.sources == {"1": 0, "3": 2}


def test_a_group_whose_members_logged_different_ops_is_rolled_back():
    positions = {
        0: replace(position(4), group_signatures={"pg3": {"4": [SUM, SUM]}}),
        1: replace(position(4), group_signatures={"pg3": {"4": [SUM, MAX]}}),
        2: replace(position(4), group_signatures={"pg4": {"4": [GATHER]}}),
    }
    plan = plan_rebuild(positions, replaced=[3], generation=2)
    assert plan.mode == "rollback"
    assert plan.why == "the survivors logged different ops of group pg3 in step 4"


def test_the_record_names_the_groups_and_who_served_whom():
    positions = {r: replace(position(4), replicas=[r - r % 2, r - r % 2 + 1]) for r in (0, 2)}
    recovery = finished_recovery(plan_rebuild(positions, [1, 3], 2), [1, 3], [0, 2])
    for rank, groups in ((0, ["world", "pg3[0,1]"]), (2, ["world", "pg4[2,3]"])):
        recovery.recovered[rank] = replace(
            recovery.recovered[rank], groups={"rebuilt": groups, "kept": ["pg1[0,2]"]}
        )
    record = recovery.record(2000.0)
    assert record["groups"] == {"rebuilt": ["pg3[0,1]", "pg4[2,3]", "world"],
                                "kept": ["pg1[0,2]"]}  # fmt: skip
    assert record["sources"] == {"1": 0, "3": 2}
    assert "with state from rank 0 (to 1), rank 2 (to 3)" in describe_recovery(record)


def test_every_rank_checks_its_replica_after_the_latest_step_any_survivor_is_in():
    """Rank 0 finished step 4 (its group needed nothing of rank 1's last op), rank 1 did not:
    both report their checksums at the start of step 6, where both have been through step 5."""
    positions = {0: position(5), 1: position(4), 2: position(5), 3: position(4)}
    plan = plan_rebuild(positions, replaced=[], generation=2)
    assert plan.mode == "replay" and plan.step == 4 and plan.check_after == 5
