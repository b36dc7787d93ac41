"""The samples of a dataset split among the ranks of a world whose size may change.

The job's samples are one stream: epoch after epoch, each a permutation of the dataset's
indices drawn from the job's seed and the epoch. A step takes the next samples of the stream
(its global batch) and gives each rank a contiguous share of them, the first ranks one more
where they do not divide evenly. The position is the number of samples the job has taken,
counted globally, so it is the same on every rank and does not depend on the world size: a
world that shrinks or grows at a step boundary goes on from the same position, and every
sample of every epoch is taken exactly once (a step may span two epochs).

What a rank gets is a function of (seed, position, world size, rank) only: a replacement, a
renumbered survivor and a fresh rank that joins all draw exactly what the rank of that number
would have drawn in a job of that size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from xmig.state.rng import derived_seed


class BatchPolicy(enum.Enum):
    """What stays fixed when the world size changes."""

    GLOBAL = "global"  # the global batch: each rank's share changes (the default)
    PER_RANK = "per-rank"  # each rank's batch: the global batch, and steps per epoch, change


@dataclass(frozen=True)
class Share:
    """One rank's samples of one step, and its weight: its share against an even split
    (a loss multiplied by it makes DDP's average of the ranks' means the mean of the step's
    global batch, where the shares are uneven)."""

    indices: list[int]
    weight: float


class GlobalPartition:
    """The global sample stream of one dataset; ``batch`` is the global batch (policy
    ``GLOBAL``) or each rank's (``PER_RANK``)."""

    def __init__(
        self,
        dataset_size: int,
        batch: int,
        seed: int,
        policy: BatchPolicy = BatchPolicy.GLOBAL,
        shuffle: bool = True,
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"the dataset is empty (size {dataset_size})")
        if batch < 1:
            raise ValueError(f"a batch of {batch} samples is not possible")
        self.dataset_size = dataset_size
        self.batch = batch
        self.seed = seed
        self.policy = policy
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def step_samples(self, world_size: int) -> int:
        """How many samples a step takes at this world size."""
        if world_size < 1:
            raise ValueError(f"a world of {world_size} ranks is not possible")
        if self.policy is BatchPolicy.PER_RANK:
            return self.batch * world_size
        if self.batch < world_size:
            raise ValueError(f"a global batch of {self.batch} cannot be split among "
                             f"{world_size} ranks (each needs a sample): keep the per-rank "
                             "batch instead")  # fmt: skip
        return self.batch

    def order(self, epoch: int) -> list[int]:
        """The dataset's indices in the order epoch ``epoch`` takes them."""
        found = self._orders.get(epoch)
        if found is None:
            if not self.shuffle:
                found = list(range(self.dataset_size))
            else:
                generator = torch.Generator().manual_seed(
                    derived_seed(self.seed, 0, "partition", "epoch", epoch)
                )
                found = torch.randperm(self.dataset_size, generator=generator).tolist()
            if len(self._orders) >= 2:  # a step spans two epochs at most
                self._orders.pop(min(self._orders))
            self._orders[epoch] = found
        return found

    def samples(self, start: int, count: int) -> list[int]:
        """The stream's samples ``start`` .. ``start + count - 1``."""
        taken: list[int] = []
        while len(taken) < count:
            epoch, offset = divmod(start + len(taken), self.dataset_size)
            order = self.order(epoch)
            taken += order[offset : offset + count - len(taken)]
        return taken

    def share(self, position: int, world_size: int, rank: int) -> Share:
        """Rank ``rank``'s samples of the step that starts at ``position``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        total = self.step_samples(world_size)
        even, extra = divmod(total, world_size)
        start = rank * even + min(rank, extra)
        size = even + (1 if rank < extra else 0)
        return Share(self.samples(position + start, size), size * world_size / total)

    def after(self, position: int, world_size: int) -> int:
        """The position after the step that starts at ``position``."""
        return position + self.step_samples(world_size)

    def epoch_of(self, position: int) -> tuple[int, int]:
        """The epoch a position is in, and how far into it."""
        return divmod(position, self.dataset_size)
