"""A script's batches as a stream whose position travels with the state (``session.batches``).

Every batch is a function of (job seed, rank, its position in the stream): each is drawn with
the random generators seeded from its position (and put back afterwards), each epoch's
iterator is made with them seeded from the epoch, and a loader's or sampler's own generator
is reseeded from its first state and the epoch. So a replacement that skips to the position
its failed rank had reached draws exactly the batches that rank would have drawn, whenever it
draws them: at the top of a step, or at the end of the one before (a batch prefetched into
locals), or in the middle (gradient accumulation).

The position at each step boundary is recorded. A replacement resuming at step S goes to the
position its peer had at S, less what the script draws before its loop (the same script draws
the same there), and checks at its first boundary that it is there.

A ``torch.utils.data.DataLoader`` over a map-style dataset skips to a position without loading
what it skips: while one of its iterators is made, its index sampler is one that drops the
first indices and tags each with its epoch, its dataset loads each item with the generators
seeded from (epoch, index) and its collate function runs seeded from the batch's first tag, so
that what its workers draw does not depend on what they loaded before. Anything else skips by
drawing (a generator can do nothing else).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from xmig.state.rng import controlled, derived_seed
from xmig.worker.errors import XmigError

logger = logging.getLogger(__name__)

KEPT_BOUNDARIES = 3  # steps whose start positions are kept (a recovery needs the last two)
KEPT_EPOCHS = 4  # epochs whose start positions travel with the state

# what a recovery is handed for one stream: its state and the step to resume at
Resume = tuple[dict[str, Any], int]


class DataPositionError(XmigError):
    """The stream cannot be put where a recovery needs it."""


class _Tag(NamedTuple):
    """An index as the sampler gave it, with the epoch it was given in."""

    epoch: int
    index: Any


class _Tagged:
    """A loaded item with the tag it was loaded for (until the collate function)."""

    __slots__ = ("item", "tag")

    def __init__(self, tag: _Tag, item: Any) -> None:
        self.tag = tag
        self.item = item


class _Streamed:
    """Seeds for what a loader's workers do: derived from the stream and the tag."""

    def __init__(self, seed: int, rank: int, name: str) -> None:
        self.seed = seed
        self.rank = rank
        self.name = name

    def of(self, what: str, tag: _Tag) -> int:
        return derived_seed(self.seed, self.rank, self.name, what, tag.epoch, tag.index)


class _TaggedIndices:
    """A loader's index sampler whose indices carry their epoch, and whose next iterator
    drops its first ``skip`` entries. Its first entry is taken as the iterator is made, with
    the generators seeded from the epoch (``seed``), so that whatever the sampler draws (a
    shuffle) is the same however often a loader asks for an iterator (a new one asks twice, a
    persistent one once an epoch)."""

    def __init__(self, inner: Any, batched: bool) -> None:
        self.inner = inner
        self.batched = batched
        self.epoch = 0
        self.seed = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.epoch, self.skip
        with controlled(self.seed):
            if self.batched:
                tagged = ([_Tag(epoch, i) for i in batch] for batch in iter(self.inner))
            else:
                tagged = (_Tag(epoch, i) for i in iter(self.inner))
            head = list(itertools.islice(tagged, skip + 1))
        return itertools.chain(head[skip:], tagged)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # set_epoch, sampler, batch_size ...
        if name == "inner":  # not yet set (a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)


class _SeededItems:
    """A map-style dataset whose items are each loaded with the generators seeded from
    (epoch, index): random augmentation in a worker does not depend on what that worker
    loaded before, so a loader started in the middle of an epoch loads the same items."""

    def __init__(self, dataset: Any, seeds: _Streamed) -> None:
        self.dataset = dataset
        self.seeds = seeds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, tag: Any) -> Any:
        if not isinstance(tag, _Tag):  # not from the stream's sampler
            return self.dataset[tag]
        with controlled(self.seeds.of("item", tag)):
            return _Tagged(tag, self.dataset[tag.index])

    def __getitems__(self, tags: list[Any]) -> list[Any]:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is None or not tags or not isinstance(tags[0], _Tag):
            return [self[tag] for tag in tags]
        with controlled(self.seeds.of("items", tags[0])):
            items = batched([tag.index for tag in tags])
        return [_Tagged(tag, item) for tag, item in zip(tags, items, strict=True)]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _SeededCollate:
    """The loader's collate function, run with the generators seeded from the batch's
    first tag (random masking in a collate function is a function of the batch too)."""

    def __init__(self, collate: Callable[[Any], Any], seeds: _Streamed) -> None:
        self.collate = collate
        self.seeds = seeds

    def __call__(self, data: Any) -> Any:
        if isinstance(data, _Tagged):  # one item, no batching
            with controlled(self.seeds.of("collate", data.tag)):
                return self.collate(data.item)
        if isinstance(data, list) and data and isinstance(data[0], _Tagged):
            with controlled(self.seeds.of("collate", data[0].tag)):
                return self.collate([d.item for d in data])
        return self.collate(data)


def _map_style_loader(source: Any) -> bool:
    """A DataLoader whose iterators read their indices from a sampler we can wrap."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _DatasetKind

    return (
        isinstance(source, DataLoader)
        and getattr(source, "_dataset_kind", None) == _DatasetKind.Map
        and hasattr(source, "_auto_collation")
    )


def _generator_seed(generator: torch.Generator) -> int:
    digest = hashlib.sha256(bytes(generator.get_state().tolist())).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Batches:
    """An iterator over the items of ``source`` (a DataLoader or any iterable: endless, one
    epoch after another, ``set_epoch`` called on its sampler; an iterator or generator: once
    through) whose position travels with the state.

    ``resume_from``, in a replacement, waits for the state the replacement pulls and returns
    this stream's part of it and the step it resumes at; ``mismatch`` reports, once, a
    position that is not the failed rank's.
    """

    def __init__(
        self,
        source: Iterable[Any],
        *,
        name: str,
        seed: int,
        rank: int,
        resume_from: Callable[[], Resume] | None = None,
        mismatch: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(source, Iterable):
            raise XmigError(f"session.batches() needs an iterable, got {type(source).__name__}")
        self.name = name
        self._source = source
        self._once = isinstance(source, Iterator)  # a generator cannot be started again
        self._seed = seed
        self._rank = rank
        self._resume_from = resume_from
        self._mismatch = mismatch
        self._it: Iterator[Any] | None = None
        self.position = 0  # of the next item, counted from the stream's start
        self.epoch = 0
        self._epoch_starts: dict[int, int] = {0: 0}
        self._drawn = 0  # items this process drew (a replacement skips the rest)
        self.pre_loop: int | None = None  # items drawn before this process's first boundary
        self._boundaries: dict[int, int] = {}  # step -> position at its start
        self._target: int | None = None  # where the next draw must start
        self._expected: tuple[int, int] | None = None  # (step, position) to check there
        # a once-through source: the items since the last boundary but one, to go back to
        self._kept: collections.deque[tuple[int, Any]] = collections.deque()
        self._fast = not self._once and _map_style_loader(source)
        # the position and its records, read by a recovery while the script may be drawing
        self._lock = threading.Lock()
        self._generators = self._own_generators()

    # ---- iterating ---------------------------------------------------------------------------
    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self._resume_from is not None:  # a replacement: go where the failed rank was
            resume_from, self._resume_from = self._resume_from, None
            state, step = resume_from()
            self.resume(state, step, fresh=True)
        if self._target is not None:
            self._seek(self._target)
        return self._draw()

    def _draw(self, skipping: bool = False) -> Any:
        """The next item; ``skipping``: one the script does not see (not counted as drawn)."""
        if self._kept and self._kept[-1][0] >= self.position:  # gone back: from what was kept
            item = next(item for pos, item in self._kept if pos == self.position)
            with self._lock:
                self.position += 1
            return item
        while True:
            if self._it is None:
                self._open(self.epoch)
            assert self._it is not None
            try:
                with controlled(derived_seed(self._seed, self._rank, self.name, self.position)):
                    item = next(self._it)
            except StopIteration:
                if self._once or self.position == self._epoch_starts.get(self.epoch):
                    self._it = None
                    raise  # a generator's end, or an epoch with nothing in it
                self._new_epoch()
                continue
            break
        with self._lock:
            if self._once and not skipping:
                self._kept.append((self.position, item))
            self.position += 1
            if not skipping:
                self._drawn += 1
        return item

    def _new_epoch(self) -> None:
        with self._lock:
            self.epoch += 1
            self._epoch_starts[self.epoch] = self.position
            for old in [e for e in self._epoch_starts if e <= self.epoch - KEPT_EPOCHS]:
                del self._epoch_starts[old]
        self._it = None

    def _open(self, epoch: int, skip: int = 0) -> None:
        """Make the iterator of ``epoch``, its first ``skip`` items left out (without loading
        them where the source allows)."""
        if self._once:
            self._it = iter(self._source)
            return
        for sampler in self._samplers():
            sampler.set_epoch(epoch)
        with controlled(derived_seed(self._seed, self._rank, self.name, "epoch", epoch)):
            for generator, first in self._generators:
                generator.manual_seed(derived_seed(first, 0, self.name, "epoch", epoch))
            if self._fast:
                self._it = self._open_loader(epoch, skip)
                return
            self._it = iter(self._source)
        for _ in range(skip):  # under each one's own seed, as it was drawn the first time
            self._draw(skipping=True)

    def _open_loader(self, epoch: int, skip: int) -> Iterator[Any]:
        loader: Any = self._source
        existing = getattr(loader, "_iterator", None)  # persistent workers keep theirs
        seed = derived_seed(self._seed, self._rank, self.name, "indices", epoch)
        if existing is not None and isinstance(existing._index_sampler, _TaggedIndices):
            indices = existing._index_sampler
            indices.epoch, indices.seed, indices.skip = epoch, seed, skip
            try:
                return iter(loader)  # its workers have the seeded dataset already
            finally:
                indices.skip = 0
        if existing is not None:  # persistent workers started before the stream had them
            loader._iterator = None
        batched = loader._auto_collation
        attribute = "batch_sampler" if batched else "sampler"
        seeds = _Streamed(self._seed, self._rank, self.name)
        indices = _TaggedIndices(getattr(loader, attribute), batched)
        indices.epoch, indices.seed, indices.skip = epoch, seed, skip
        originals = {attribute: getattr(loader, attribute), "dataset": loader.dataset,
                     "collate_fn": loader.collate_fn}  # fmt: skip
        wrapped = {attribute: indices, "dataset": _SeededItems(loader.dataset, seeds),
                   "collate_fn": _SeededCollate(loader.collate_fn, seeds)}  # fmt: skip
        # DataLoader refuses to have some of these set once made: only its iterators read
        # them, so they are the stream's while one is made (a persistent one keeps them)
        for name, value in wrapped.items():
            object.__setattr__(loader, name, value)
        try:
            return iter(loader)
        finally:
            for name, value in originals.items():
                object.__setattr__(loader, name, value)
            indices.skip = 0

    def _samplers(self) -> list[Any]:
        found: list[Any] = []
        batch_sampler = getattr(self._source, "batch_sampler", None)
        for sampler in (getattr(self._source, "sampler", None),
                        getattr(batch_sampler, "sampler", None)):  # fmt: skip
            if hasattr(sampler, "set_epoch") and not any(sampler is s for s in found):
                found.append(sampler)
        return found

    def _own_generators(self) -> list[tuple[torch.Generator, int]]:
        """The generators of the source and its samplers, with a seed from their first state:
        each epoch reseeds them from it (the same on every rank where it was the same)."""
        if self._once:
            return []
        found: list[torch.Generator] = []
        batch_sampler = getattr(self._source, "batch_sampler", None)
        for holder in (self._source, getattr(self._source, "sampler", None),
                       getattr(batch_sampler, "sampler", None)):  # fmt: skip
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and not any(generator is g for g in found):
                found.append(generator)
        return [(g, _generator_seed(g)) for g in found]

    # ---- boundaries --------------------------------------------------------------------------
    @property
    def _next(self) -> int:
        """The position of the next item the script gets (where a pending move goes)."""
        return self._target if self._target is not None else self.position

    def at_boundary(self, step: int) -> None:
        """The step loop is at the start of ``step``."""
        with self._lock:
            if self.pre_loop is None:
                self.pre_loop = self._drawn
            self._boundaries[step] = self._next
            for old in [s for s in self._boundaries if s <= step - KEPT_BOUNDARIES]:
                del self._boundaries[old]
            if self._once:
                keep_from = self._boundaries.get(step - 1, self.position)
                while self._kept and self._kept[0][0] < keep_from:
                    self._kept.popleft()
        if self._expected is not None and self._expected[0] == step:
            expected, self._expected = self._expected[1], None
            if expected != self._next and self._mismatch is not None:
                self._mismatch(
                    f"the replacement's data stream {self.name!r} is at batch {self._next} "
                    f"at the start of step {step}, its peers' at batch {expected}: the script "
                    "does not draw the same number of batches before its loop in every process"
                )

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: the next batch's position, the positions at the last step
        boundaries, the starts of the last epochs, and how many batches the script draws
        before its loop."""
        with self._lock:
            return {
                "position": self._next,
                "epoch": self.epoch,
                "epoch_starts": {str(e): p for e, p in sorted(self._epoch_starts.items())},
                "boundaries": {str(s): p for s, p in sorted(self._boundaries.items())},
                "pre_loop": self.pre_loop if self.pre_loop is not None else self._drawn,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from where ``state_dict`` was taken (a script's own checkpoint)."""
        self._take_epochs(state)
        self._target = int(state["position"])

    def resume(self, state: dict[str, Any], step: int, *, fresh: bool) -> None:
        """Go to where the stream of ``state`` was at the start of ``step``. A ``fresh``
        process (a replacement) has yet to run what the script draws before its loop."""
        self._resume_from = None  # this is the resumption
        self._take_epochs(state)
        at_step = state["boundaries"].get(str(step))
        if at_step is None:  # the peer was between its optimizer step and this boundary
            at_step = state["position"]
        at_step = int(at_step)
        # what the script draws before its loop is still to come in a fresh process
        to_come = int(state["pre_loop"]) - self._drawn if fresh else 0
        if to_come < 0 or at_step - to_come < 0:
            raise DataPositionError(
                f"data stream {self.name!r}: this process drew {self._drawn} batches before "
                f"its loop, more than its peer's {state['pre_loop']}"
            )
        self._target = at_step - to_come
        if fresh:
            self._expected = (step, at_step)

    def rewind(self, step: int) -> None:
        """Go back to where the stream was at the start of ``step`` (a step redone)."""
        if step not in self._boundaries:
            raise DataPositionError(f"data stream {self.name!r} has no position for step {step}")
        self._target = self._boundaries[step]

    def _take_epochs(self, state: dict[str, Any]) -> None:
        with self._lock:
            for epoch, start in state.get("epoch_starts", {}).items():
                self._epoch_starts.setdefault(int(epoch), int(start))

    def _seek(self, target: int) -> None:
        self._target = None
        if target == self.position and (self._it is not None or self.position == 0):
            return
        if self._once:
            if target < self.position:
                if not self._kept or self._kept[0][0] > target:
                    raise DataPositionError(
                        f"data stream {self.name!r} cannot go back to batch {target}: it is "
                        "an iterator that cannot be started again, and only the batches of "
                        "the last two steps are kept"
                    )
                with self._lock:
                    self.position = target
                return
            if self._it is None:
                self._open(0)
            while self.position < target:
                self._skip_one()
            return
        with self._lock:
            epoch = max(e for e, start in self._epoch_starts.items() if start <= target)
            self._epoch_starts = {e: p for e, p in self._epoch_starts.items() if e <= epoch}
            self.epoch = epoch
            self.position = self._epoch_starts[epoch]
        skip = target - self.position
        logger.info("data stream %r: to batch %d (epoch %d, %d in)", self.name, target, epoch,
                    skip)  # fmt: skip
        self._open(epoch, skip)  # a loader skips without loading; anything else draws
        if self._fast:
            with self._lock:
                self.position = target

    def _skip_one(self) -> None:
        with contextlib.suppress(StopIteration):
            self._draw(skipping=True)
            return
        raise DataPositionError(f"data stream {self.name!r} ended before the failed rank's "
                                f"position {self.position}")  # fmt: skip
