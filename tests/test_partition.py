"""The global sample partition (``xmig.worker.partition``): every sample of every epoch taken
exactly once, whatever the world size does at the step boundaries."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xmig.worker.partition import BatchPolicy, GlobalPartition


def _take(partition, worlds):
    """Run the steps at the given world sizes; every rank's samples, and the end position."""
    position, taken = 0, []
    for world in worlds:
        for rank in range(world):
            taken += partition.share(position, world, rank).indices
        position = partition.after(position, world)
    return taken, position


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 60), batch=st.integers(1, 12), seed=st.integers(0, 2**32),
       per_rank=st.booleans(),
       worlds=st.lists(st.integers(1, 6), min_size=1, max_size=30))  # fmt: skip
def test_every_sample_of_an_epoch_is_taken_exactly_once_across_shrinks_and_grows(
        size, batch, seed, per_rank, worlds):  # fmt: skip
    policy = BatchPolicy.PER_RANK if per_rank else BatchPolicy.GLOBAL
    if policy is BatchPolicy.GLOBAL:
        worlds = [min(w, batch) for w in worlds]  # a global batch needs a sample a rank
    partition = GlobalPartition(size, batch, seed, policy)
    taken, position = _take(partition, worlds)
    assert len(taken) == position
    full, _ = partition.epoch_of(position)
    counts = collections.Counter(taken[: full * size])
    assert all(counts[i] == full for i in range(size)) and len(counts) == (size if full else 0)
    for epoch in range(full):  # each complete epoch is one permutation of the dataset
        assert sorted(taken[epoch * size : (epoch + 1) * size]) == list(range(size))
    assert len(set(taken[full * size :])) == len(taken) - full * size  # the epoch under way


def test_a_shrink_at_step_s_equals_a_job_that_ran_at_the_smaller_size_from_s():
    """A rank's samples depend on (position, world, rank) only."""
    partition = GlobalPartition(100, 12, seed=7)
    again = GlobalPartition(100, 12, seed=7)
    position = 0
    for world in (3, 3, 2, 2, 4):
        for rank in range(world):
            assert partition.share(position, world, rank) == again.share(position, world, rank)
        position = partition.after(position, world)


def test_shares_are_contiguous_and_the_first_ranks_take_the_remainder():
    partition = GlobalPartition(10, 7, seed=0, shuffle=False)
    shares = [partition.share(0, 3, rank) for rank in range(3)]
    assert [s.indices for s in shares] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [round(s.weight, 4) for s in shares] == [round(3 * 3 / 7, 4), round(2 * 3 / 7, 4),
                                                    round(2 * 3 / 7, 4)]  # fmt: skip
    # the next step runs into the next epoch
    assert partition.share(7, 1, 0).indices == [7, 8, 9, 0, 1, 2, 3]


def test_per_rank_batches_stay_and_the_global_batch_follows_the_world():
    partition = GlobalPartition(50, 4, seed=1, policy=BatchPolicy.PER_RANK)
    assert partition.step_samples(3) == 12 and partition.step_samples(2) == 8
    assert len(partition.share(0, 3, 2).indices) == 4


def test_epochs_are_shuffled_differently_and_reproducibly():
    partition = GlobalPartition(20, 5, seed=3)
    assert partition.order(0) != partition.order(1)
    assert GlobalPartition(20, 5, seed=3).order(1) == partition.order(1)
    assert GlobalPartition(20, 5, seed=4).order(0) != partition.order(0)


@pytest.mark.parametrize(("args", "call", "needle"), [
    ((0, 4, 0), None, "empty"),
    ((10, 0, 0), None, "not possible"),
    ((10, 2, 0), ("step_samples", 3), "cannot be split among 3"),
    ((10, 2, 0), ("share", 0, 2, 2), "rank 2 is not in a world of 2"),
])  # fmt: skip
def test_bad_input_is_refused_with_what_is_wrong(args, call, needle):
    with pytest.raises(ValueError, match=needle):
        partition = GlobalPartition(*args)
        getattr(partition, call[0])(*call[1:])
