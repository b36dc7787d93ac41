"""The data stream behind ``session.batches``: a replacement that resumes from a peer's state
draws exactly the batches the failed rank would have drawn, whatever the loop looks like."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from xmig.worker.data import Batches, DataPositionError


class Numbers(Dataset):
    """Items 0..n-1, each with a random number drawn when it is loaded (an augmentation)."""

    def __init__(self, n=23):
        self.n = n
        self.loaded = 0  # in this process (num_workers=0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded += 1
        return torch.tensor([float(i), torch.rand(()).item()])


def loader_of(kind, dataset, rank=0):
    if kind == "shuffle":
        return DataLoader(dataset, batch_size=4, shuffle=True)
    if kind == "workers":
        return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, pin_memory=True)
    if kind == "persistent":
        return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True)  # fmt: skip
    if kind == "distributed":
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=5)
        return DataLoader(dataset, batch_size=3, sampler=sampler)
    if kind == "generator":
        return DataLoader(dataset, batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(9))  # fmt: skip
    raise AssertionError(kind)


def noise():
    while True:
        yield torch.randn(3)


def train(stream, steps, start=0, prefetch=False, per_step=1, snapshot_at=None):
    """The batches each step trains on, as a script's loop would see them. ``prefetch``:
    the next step's batch is drawn at the end of a step, into a local."""
    seen, state = {}, None
    batch = next(stream) if prefetch else None
    for step in range(start, steps):
        stream.at_boundary(step)
        torch.manual_seed(1000 + step)  # the step loop reseeds: draws must not depend on it
        torch.rand(5)
        if step == snapshot_at:
            state = stream.state_dict()  # a peer serving the state mid-step
        if prefetch:
            seen[step] = [batch]
            batch = next(stream)
        else:
            seen[step] = [next(stream) for _ in range(per_step)]
    return seen, state


def same(a, b):
    assert a.keys() == b.keys()
    for step in a:
        assert len(a[step]) == len(b[step])
        for x, y in zip(a[step], b[step], strict=True):
            assert torch.equal(x, y), f"step {step}: {x} != {y}"


def replacement(make_source, state, step, **kw):
    return Batches(make_source(), name="data", seed=7, rank=1,
                   resume_from=lambda: (state, step), **kw)  # fmt: skip


@pytest.mark.parametrize("kind", ["shuffle", "workers", "persistent", "distributed", "generator"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_replacement_draws_what_the_failed_rank_would_have(kind, prefetch):
    steps = 17  # three epochs of 6 batches
    for resume_at in (0, 4, 6, 12, 16):
        original = Batches(loader_of(kind, Numbers(), rank=1), name="data", seed=7, rank=1)
        reference, state = train(original, steps, prefetch=prefetch, snapshot_at=resume_at)
        stream = replacement(lambda: loader_of(kind, Numbers(), rank=1), state, resume_at)
        seen, _ = train(stream, steps, start=resume_at, prefetch=prefetch)
        same(seen, {s: reference[s] for s in seen})


def test_epochs_differ_and_a_loader_skips_without_loading():
    dataset = Numbers()
    stream = Batches(DataLoader(dataset, batch_size=4, shuffle=True), name="data", seed=7,
                     rank=1)  # fmt: skip
    seen, state = train(stream, 14, snapshot_at=13)
    first = torch.cat([b[:, 0] for s in range(6) for b in seen[s]])
    second = torch.cat([b[:, 0] for s in range(6, 12) for b in seen[s]])
    assert sorted(first.tolist()) == sorted(second.tolist()) == [float(i) for i in range(23)]
    assert not torch.equal(first, second)  # a new shuffle each epoch
    fresh = Numbers()
    resumed = replacement(lambda: DataLoader(fresh, batch_size=4, shuffle=True), state, 13)
    again, _ = train(resumed, 14, start=13)
    same(again, {13: seen[13]})
    assert fresh.loaded == len(seen[13][0])  # the 13 batches before were not loaded


def test_a_generator_of_random_batches_is_a_function_of_the_position():
    stream = Batches(noise(), name="data", seed=7, rank=1)
    seen, state = train(stream, 8, per_step=2, snapshot_at=5)
    resumed = replacement(noise, state, 5)
    again, _ = train(resumed, 8, start=5, per_step=2)
    same(again, {s: seen[s] for s in again})
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    next(stream)  # a draw leaves the script's generators where they were
    assert torch.equal(torch.rand(2), expected)


def test_a_survivor_goes_back_to_the_start_of_a_step_it_redoes():
    for make in (noise, lambda: DataLoader(Numbers(), batch_size=4, shuffle=True,
                                           num_workers=2, persistent_workers=True)):  # fmt: skip
        stream = Batches(make(), name="data", seed=7, rank=0)
        seen, _ = train(stream, 5)
        stream.rewind(4)
        assert all(torch.equal(a, b) for a, b in zip([next(stream)], seen[4], strict=True))
        stream.rewind(3)
        redo = [next(stream), next(stream)]
        assert torch.equal(redo[0], seen[3][0]) and torch.equal(redo[1], seen[4][0])


def test_an_iterator_cannot_go_back_further_than_it_kept():
    stream = Batches(noise(), name="data", seed=7, rank=0)
    train(stream, 6)
    with pytest.raises(DataPositionError, match="no position for step 1"):
        stream.rewind(1)
    stream.load_state_dict({"position": 1})
    with pytest.raises(DataPositionError, match="cannot go back to batch 1"):
        next(stream)


def test_a_replacement_that_draws_otherwise_before_its_loop_says_so():
    original = Batches(noise(), name="data", seed=7, rank=1)
    _, state = train(original, 6, prefetch=True, snapshot_at=4)
    said = []
    stream = replacement(noise, state, 4, mismatch=said.append)
    next(stream)
    next(stream)  # two before the loop, where the failed rank drew one
    stream.at_boundary(4)
    assert said and "at batch 6 at the start of step 4, its peers' at batch 5" in said[0]


def test_a_stream_ends_with_its_iterator_and_refuses_what_is_not_iterable():
    stream = Batches(iter(range(3)), name="data", seed=7, rank=0)
    assert list(itertools.islice(stream, 5)) == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(stream)
    empty = Batches([], name="data", seed=7, rank=0)
    with pytest.raises(StopIteration):
        next(empty)
    with pytest.raises(Exception, match="needs an iterable"):
        Batches(5, name="data", seed=7, rank=0)
