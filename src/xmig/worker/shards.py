"""A map-style dataset as each rank's share of every step's global batch
(``session.shards``), its position counted in global samples (``worker/partition.py``).

Each draw is one step's share: the items of its indices, each loaded with the generators
seeded from (job seed, epoch, index) and never from the rank, so an item is the same
whichever rank loads it, then put together by the collate function. The position is the
number of samples the job took before the next draw, the same on every rank. So the stream
goes on from the same place when the world changes size (``resize``), a replacement resumes
from its peer's position, and a step redone draws its share again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from xmig.state.rng import controlled, derived_seed
from xmig.worker.data import KEPT_BOUNDARIES, DataPositionError, Resume
from xmig.worker.errors import XmigError
from xmig.worker.partition import GlobalPartition, Share


def _stack(items: list[Any]) -> Any:
    from torch.utils.data import default_collate

    return default_collate(items)


class Shards:
    """This rank's share of each step's samples of ``dataset`` (anything with ``len`` and
    ``[]``). ``weight``: the last share's weight against an even split (``Share``)."""

    def __init__(
        self,
        dataset: Sequence[Any],
        partition: GlobalPartition,
        *,
        name: str,
        world_size: int,
        rank: int,
        collate: Callable[[list[Any]], Any] | None = None,
        resume_from: Callable[[], Resume] | None = None,
        mismatch: Callable[[str], None] | None = None,
    ) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise XmigError(f"session.shards() needs a map-style dataset (len and []), got "
                            f"{type(dataset).__name__}")  # fmt: skip
        if len(dataset) != partition.dataset_size:
            raise XmigError(f"the partition is of {partition.dataset_size} samples, the dataset "
                            f"has {len(dataset)}")  # fmt: skip
        partition.step_samples(world_size)  # refuses a global batch smaller than the world
        self.name = name
        self.partition = partition
        self._dataset = dataset
        self._collate = collate or _stack
        self.world_size = world_size
        self.rank = rank
        self._resume_from = resume_from
        self._mismatch = mismatch
        self.position = 0  # global samples taken before the next draw
        self.weight = 1.0
        self._drawn = 0  # draws this process made
        self.pre_loop: int | None = None  # draws before this process's first boundary
        self._boundaries: dict[int, int] = {}  # step -> position at its start
        self._expected: tuple[int, int] | None = None
        self._lock = threading.Lock()

    # ---- iterating ---------------------------------------------------------------------------
    def __iter__(self) -> Shards:
        return self

    def __next__(self) -> Any:
        if self._resume_from is not None:  # a replacement: go where the failed rank was
            resume_from, self._resume_from = self._resume_from, None
            state, step = resume_from()
            self.resume(state, step, fresh=True)
        with self._lock:
            position, world, rank = self.position, self.world_size, self.rank
        share = self.partition.share(position, world, rank)
        batch = self._load(share, position)
        with self._lock:
            self.position = self.partition.after(position, world)
            self.weight = share.weight
            self._drawn += 1
        return batch

    def _load(self, share: Share, position: int) -> Any:
        seed = self.partition.seed
        items = []
        for offset, index in enumerate(share.indices):
            epoch, _ = self.partition.epoch_of(position + offset)
            with controlled(derived_seed(seed, 0, self.name, "item", epoch, index)):
                items.append(self._dataset[index])
        with controlled(derived_seed(seed, self.rank, self.name, "collate", position)):
            return self._collate(items)

    def resize(self, world_size: int, rank: int) -> None:
        """The world has ``world_size`` ranks from the next draw on, this one ``rank``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.partition.step_samples(world_size)
        with self._lock:
            self.world_size, self.rank = world_size, rank

    # ---- boundaries and state ------------------------------------------------------------------
    def at_boundary(self, step: int) -> None:
        """The step loop is at the start of ``step``."""
        with self._lock:
            if self.pre_loop is None:
                self.pre_loop = self._drawn
            self._boundaries[step] = self.position
            for old in [s for s in self._boundaries if s <= step - KEPT_BOUNDARIES]:
                del self._boundaries[old]
            expected = self._expected
            if expected is not None and expected[0] == step:
                self._expected = None
            else:
                expected = None
        if expected is not None and expected[1] != self.position and self._mismatch is not None:
            self._mismatch(
                f"the replacement's data stream {self.name!r} is at sample {self.position} "
                f"at the start of step {step}, its peers' at sample {expected[1]}: the "
                "script does not draw the same number of batches before its loop in "
                "every process"
            )

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "position": self.position,
                "world_size": self.world_size,
                "boundaries": {str(s): p for s, p in sorted(self._boundaries.items())},
                "pre_loop": self.pre_loop if self.pre_loop is not None else self._drawn,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from where ``state_dict`` was taken (a script's own checkpoint)."""
        with self._lock:
            self.position = int(state["position"])

    def resume(self, state: dict[str, Any], step: int, *, fresh: bool) -> None:
        """Go to where the stream of ``state`` was at the start of ``step``; a ``fresh``
        process has yet to make the draws the script makes before its loop."""
        self._resume_from = None
        at_step = int(state["boundaries"].get(str(step), state["position"]))
        to_come = int(state["pre_loop"]) - self._drawn if fresh else 0
        back = to_come * self.partition.step_samples(int(state["world_size"]))
        if to_come < 0 or at_step - back < 0:
            raise DataPositionError(
                f"data stream {self.name!r}: this process drew {self._drawn} batches before "
                f"its loop, more than its peer's {state['pre_loop']}"
            )
        with self._lock:
            self.position = at_step - back
            if fresh:
                self._expected = (step, at_step)

    def rewind(self, step: int) -> None:
        """Go back to where the stream was at the start of ``step`` (a step redone)."""
        with self._lock:
            if step not in self._boundaries:
                raise DataPositionError(f"data stream {self.name!r} has no position for step "
                                        f"{step}")  # fmt: skip
            self.position = self._boundaries[step]
