"""The data stream behind ``session.shards``: each rank's share of every step's global batch,
its position in samples of the whole job, so it survives a replacement, a step redone and a
change of the world size with every sample drawn exactly once."""

import collections

import pytest
import torch

from xmig.worker.data import DataPositionError
from xmig.worker.partition import BatchPolicy, GlobalPartition
from xmig.worker.shards import Shards

SIZE = 29


class Numbered(torch.utils.data.Dataset):
    """Item i: its index and a random number drawn when it is loaded (an augmentation)."""

    def __len__(self):
        return SIZE

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item()])


def shards(world, rank, batch=6, policy=BatchPolicy.GLOBAL, **kw):
    partition = GlobalPartition(SIZE, batch, seed=11, policy=policy)
    return Shards(Numbered(), partition, name="data", world_size=world, rank=rank, **kw)


def run(streams, steps, start=0):
    """Every rank's batch of each step, the ranks' streams in lockstep."""
    seen = {}
    for step in range(start, steps):
        for stream in streams:
            stream.at_boundary(step)
        seen[step] = [next(stream) for stream in streams]
    return seen


def indices(batches):
    return [int(x) for batch in batches for x in batch[:, 0].tolist()]


def test_the_ranks_draw_disjoint_shares_covering_each_epoch_once():
    streams = [shards(3, r) for r in range(3)]
    seen = run(streams, 10)  # 60 samples: two whole epochs of 29, and 2 of the third
    taken = [i for step in range(10) for i in indices(seen[step])]
    counts = collections.Counter(taken[: 2 * SIZE])
    assert all(counts[i] == 2 for i in range(SIZE))
    assert [s.weight for s in streams] == [1.0, 1.0, 1.0]


def test_an_item_is_the_same_whichever_rank_loads_it():
    """Its augmentation is seeded from the sample, not the rank: what a resize needs."""
    three = run([shards(3, r) for r in range(3)], 1)[0]
    two = run([shards(2, r) for r in range(2)], 1)[0]
    assert torch.equal(torch.cat(three), torch.cat(two))


def test_a_replacement_draws_what_the_failed_rank_would_have():
    reference = run([shards(2, r) for r in range(2)], 8)
    survivor, failed = shards(2, 0), shards(2, 1)
    run([survivor, failed], 5)
    survivor.at_boundary(5)
    state = survivor.state_dict()
    fresh = shards(2, 1, resume_from=lambda: (state, 5))
    later = run([survivor, fresh], 8, start=5)  # (its boundary 5 again: nothing drawn since)
    for step in range(5, 8):
        assert torch.equal(later[step][1], reference[step][1])


def test_a_replacement_that_prefetched_before_its_loop_resumes_in_the_same_place():
    def loop(stream, steps, start=0):
        seen, batch = {}, next(stream)
        for step in range(start, steps):
            stream.at_boundary(step)
            seen[step], batch = batch, next(stream)
        return seen

    reference = loop(shards(2, 1), 6)
    peer = shards(2, 0)
    loop(peer, 3)  # step 3's batch prefetched at the end of step 2
    peer.at_boundary(3)
    state = peer.state_dict()
    mismatches = []
    fresh = shards(2, 1, resume_from=lambda: (state, 3), mismatch=mismatches.append)
    got = loop(fresh, 6, start=3)
    assert all(torch.equal(got[s], reference[s]) for s in range(3, 6)) and not mismatches


def test_a_step_redone_draws_its_share_again():
    stream = shards(2, 0)
    first = run([stream], 4)
    stream.rewind(2)
    again = run([stream], 4, start=2)
    assert all(torch.equal(first[s][0], again[s][0]) for s in (2, 3))
    with pytest.raises(DataPositionError, match="no position for step 0"):
        stream.rewind(0)


@pytest.mark.parametrize("policy", [BatchPolicy.GLOBAL, BatchPolicy.PER_RANK])
def test_a_shrink_and_a_grow_take_every_sample_once_and_match_a_planned_resize(policy):
    """World 3 -> 2 at step 4 (rank 1 lost, rank 2 renumbered 1) -> 3 at step 9."""

    def job(lost):
        streams = [shards(3, r, batch=7, policy=policy) for r in range(3)]
        seen = run(streams, 4)
        kept = [s for i, s in enumerate(streams) if i != lost]
        for new_rank, stream in enumerate(kept):
            stream.resize(2, new_rank)
        seen.update(run(kept, 9, start=4))
        newcomer = shards(2, 0, batch=7, policy=policy)
        newcomer.resume(kept[0].state_dict(), 9, fresh=False)  # the state it pulls
        streams = [*kept, newcomer]
        for rank, stream in enumerate(streams):
            stream.resize(3, rank)
        seen.update(run(streams, 14, start=9))
        return seen

    faulted, planned = job(lost=1), job(lost=2)  # planned: the highest rank leaves
    taken = [i for step in sorted(faulted) for i in indices(faulted[step])]
    epochs = len(taken) // SIZE
    assert epochs >= 2
    for epoch in range(epochs):
        assert sorted(taken[epoch * SIZE : (epoch + 1) * SIZE]) == list(range(SIZE))
    assert len(set(taken[epochs * SIZE :])) == len(taken) - epochs * SIZE
    for step in faulted:
        assert all(torch.equal(a, b) for a, b in zip(faulted[step], planned[step], strict=True))


def test_bad_input_is_refused():
    from xmig.worker.errors import XmigError

    with pytest.raises(XmigError, match="map-style"):
        Shards(iter([1]), GlobalPartition(1, 1, 0), name="d", world_size=1, rank=0)
    with pytest.raises(XmigError, match="partition is of 5 samples"):
        Shards(Numbered(), GlobalPartition(5, 1, 0), name="d", world_size=1, rank=0)
    with pytest.raises(ValueError, match="cannot be split among 8"):
        shards(8, 0, batch=6)
    with pytest.raises(ValueError, match="rank 3 is not in a world of 2"):
        shards(2, 0).resize(2, 3)
