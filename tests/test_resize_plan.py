"""The pure decisions on the world size (``xmig.coord.resize``): one test per outcome."""

import pytest

from xmig.coord.resize import (
    OnNoSpare,
    Refusal,
    ResizeCause,
    ResizePlan,
    free_slots,
    plan_grow,
    plan_planned,
    plan_shrink,
)

# 3 nodes of 2 ranks each
NODES = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}


def test_a_lost_node_with_no_spare_shrinks_the_world_and_renumbers_in_order():
    plan = plan_shrink(NODES, lost={1}, step=5, min_world_size=1, policy=OnNoSpare.SHRINK)
    assert isinstance(plan, ResizePlan)
    assert plan.cause is ResizeCause.NODE_LOST and plan.step == 5
    assert (plan.old_world, plan.new_world) == (6, 4)
    assert plan.ranks == {0: 0, 1: 1, 4: 2, 5: 3}
    assert plan.dropped == [2, 3]
    assert plan.nodes == {0: 0, 1: 0, 2: 2, 3: 2}
    assert plan.describe() == "shrunk from 6 to 4 at step 5 (node lost)"


def test_stop_policy_refuses_the_shrink_and_stops():
    refusal = plan_shrink(NODES, lost={2}, step=5, min_world_size=1, policy=OnNoSpare.STOP)
    assert isinstance(refusal, Refusal) and refusal.stop
    assert "node 2 was lost" in refusal.reason and "--on-no-spare shrink" in refusal.reason


def test_a_shrink_below_the_minimum_stops():
    refusal = plan_shrink(NODES, lost={0, 1}, step=5, min_world_size=3, policy=OnNoSpare.SHRINK)
    assert isinstance(refusal, Refusal) and refusal.stop
    assert "2 rank(s) would be left, below --min-world-size 3" in refusal.reason


def test_losing_every_node_stops():
    refusal = plan_shrink(NODES, lost={0, 1, 2}, step=5, min_world_size=1, policy=OnNoSpare.SHRINK)
    assert isinstance(refusal, Refusal) and refusal.stop and "every rank" in refusal.reason


def test_a_lost_node_without_ranks_is_not_a_shrink():
    with pytest.raises(ValueError, match="no rank"):
        plan_shrink(NODES, lost={7}, step=5, min_world_size=1, policy=OnNoSpare.SHRINK)


def test_a_planned_shrink_drops_the_highest_ranks():
    plan = plan_planned(NODES, world_size=4, step=5, min_world_size=1, free={})
    assert isinstance(plan, ResizePlan) and plan.cause is ResizeCause.PLANNED
    assert plan.ranks == {0: 0, 1: 1, 2: 2, 3: 3} and plan.dropped == [4, 5]


def test_a_fault_shrink_and_a_planned_shrink_give_the_same_world():
    """What the yardstick rests on: the same new size, ranks 0..N-1 (which old rank a new rank
    was does not enter what it computes)."""
    lost = plan_shrink(NODES, lost={0}, step=5, min_world_size=1, policy=OnNoSpare.SHRINK)
    planned = plan_planned(NODES, world_size=4, step=5, min_world_size=1, free={})
    assert sorted(lost.ranks.values()) == sorted(planned.ranks.values()) == [0, 1, 2, 3]
    assert lost.new_world == planned.new_world


def test_a_planned_grow_fills_the_nodes_that_run_ranks_then_idle_ones():
    world = {0: 0, 1: 0, 2: 2}
    free = free_slots(world, live=[0, 1, 2], nproc_per_node=2)
    assert free == {1: 2, 2: 1}
    plan = plan_planned(world, world_size=6, step=9, min_world_size=1, free=free)
    assert isinstance(plan, ResizePlan) and plan.added == {3: 2, 4: 1, 5: 1}
    assert plan.describe() == "grown from 3 to 6 at step 9 (planned)"
    assert plan.nodes == {0: 0, 1: 0, 2: 2, 3: 2, 4: 1, 5: 1}


@pytest.mark.parametrize(("size", "live", "needle"), [
    (0, [0, 1, 2], "not possible"),
    (6, [0, 1, 2], "already 6"),
    (8, [0, 1, 2], "the job has room for 0"),
    (9, [0, 1, 2, 3], "the job has room for 2"),
])  # fmt: skip
def test_impossible_planned_sizes_are_refused_and_the_job_goes_on(size, live, needle):
    refusal = plan_planned(NODES, world_size=size, step=5, min_world_size=1,
                           free=free_slots(NODES, live, nproc_per_node=2))  # fmt: skip
    assert isinstance(refusal, Refusal) and not refusal.stop and needle in refusal.reason


def test_a_planned_size_below_the_minimum_is_refused():
    refusal = plan_planned(NODES, world_size=2, step=5, min_world_size=4, free={})
    assert isinstance(refusal, Refusal) and "below --min-world-size 4" in refusal.reason


def test_an_added_node_grows_the_world_back_to_its_launch_size_and_no_further():
    world = {0: 0, 1: 0, 2: 2, 3: 2}
    plan = plan_grow(world, node=1, step=12, idle=[1], nproc_per_node=2, max_world_size=6)
    assert isinstance(plan, ResizePlan) and plan.cause is ResizeCause.NODE_ADDED
    assert plan.added == {4: 1, 5: 1} and plan.new_world == 6
    full = plan_grow(NODES, node=3, step=12, idle=[3], nproc_per_node=2, max_world_size=6)
    assert isinstance(full, Refusal) and not full.stop and "stays a spare" in full.reason


def test_a_node_that_is_not_idle_cannot_be_added():
    world = {0: 0, 1: 0}
    refusal = plan_grow(world, node=0, step=1, idle=[1], nproc_per_node=2, max_world_size=4)
    assert isinstance(refusal, Refusal) and "not an idle node" in refusal.reason
