"""The one consumer of the coordinator's orders.

The link's reader hands every decoded order to ``Orders.put``, which dispatches it by its type
(``Orders.table``) on that thread, in the order the orders came: every handler only hands the
order on, never waits, so no thread of its own stands between an order and its handler (on a
loaded machine each hand-over between threads costs about a millisecond of a recovery). An
order that a thread must wait for (the survivor's recovery plan, a paused step loop's next
move, the digest of pulled state) goes to that thread's ``Inbox``, which drops what belongs to
another generation. Orders that come before the worker's parts exist wait for ``start``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from xmig import protocol
from xmig.worker.errors import RecoveryFailed

logger = logging.getLogger(__name__)

Handler = Callable[[Any], None]


class Superseded(RecoveryFailed):
    """A later park came while this rank waited for the plan of an earlier one."""


class Inbox:
    """Orders handed by the consumer to one waiting thread. ``supersede``: an order of a
    later generation than the one a thread waits for ends that wait (``Superseded``) and is
    kept for the wait of its own generation: a recovery given up for a later one may still
    be waiting when the later one's plan comes, and must not take it."""

    def __init__(self, name: str, supersede: bool = False) -> None:
        self.name = name
        self.supersede = supersede
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def hand(self, order: Any) -> None:
        self._queue.put(order)

    def clear(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def next(self, generation: int, timeout: float) -> Any | None:
        """The next order of ``generation`` (None after ``timeout`` seconds). An ``Abort``
        raises RecoveryFailed, and so does the ``Park`` of a later generation (the
        coordinator gave this one up); an order of another generation is stale and dropped."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                order = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if isinstance(order, protocol.Abort):
                raise RecoveryFailed(order.reason)
            if isinstance(order, protocol.SaveState):
                raise Superseded("the coordinator was lost")
            if isinstance(order, protocol.Park):
                if order.generation > generation:
                    raise Superseded(f"generation {generation} was given up for "
                                     f"{order.generation}")  # fmt: skip
                continue  # the park that started this wait
            later = getattr(order, "generation", None)
            if later == generation:
                return order
            if self.supersede and isinstance(later, int) and later > generation:
                self._queue.put(order)  # for the wait of its own generation
                raise Superseded(f"generation {generation} was given up for {later}")
            logger.debug("%s: dropped a stale %s", self.name, type(order).__name__)


class Orders:
    """Takes every order from the link and dispatches it by its type, one at a time."""

    def __init__(self, rank: int, on_park: Handler, on_pause: Handler,
                 on_save: Handler | None = None, on_store: Handler | None = None,
                 on_prepare: Handler | None = None) -> None:  # fmt: skip
        self.rank = rank
        # a survivor's Rebuild (or Abort), after its Park
        self.plans = Inbox("recovery", supersede=True)
        # a step loop paused at a boundary: Dump, Resume, Resize
        self.boundary = Inbox("boundary")
        self.digests = Inbox("digests")  # what the peer serving this rank's state sent
        self.released = threading.Event()  # every rank has finished: a finished one may go
        self._on_park = on_park
        self._on_save = on_save
        self._lock = threading.Lock()
        self._early: list[protocol.Message] | None = []  # None once started
        self.table: Mapping[type[protocol.Message], Handler] = {
            protocol.Park: self._park,
            protocol.Rebuild: self.plans.hand,
            protocol.WriteCheckpoint: self.plans.hand,
            protocol.Shrink: self.plans.hand,
            protocol.Abort: self._abort,
            protocol.Pause: on_pause,
            protocol.Dump: self.boundary.hand,
            protocol.Resume: self.boundary.hand,
            protocol.Resize: self.boundary.hand,
            protocol.Release: lambda _order: self.released.set(),
            protocol.StateAnnounced: self._announced,
            protocol.SaveState: self._save,
        }
        if on_prepare is not None:
            self.table = {**self.table, protocol.Prepare: on_prepare}
        if on_store is not None:  # connecting to the store takes a millisecond: done here
            self.table = {**self.table, protocol.StoreRestarted: on_store}

    def start(self) -> None:
        """The worker's parts exist: dispatch what came before, and from now on at once."""
        with self._lock:
            early, self._early = self._early or [], None
            for order in early:
                self._dispatch_logged(order)

    def put(self, order: protocol.Message) -> None:
        """From the link's reader thread: dispatched now (or at ``start``); never waits on
        anything but another dispatch."""
        with self._lock:
            if self._early is not None:
                self._early.append(order)
                return
            self._dispatch_logged(order)

    def dispatch(self, order: protocol.Message) -> None:
        handler = self.table.get(type(order))
        if handler is None:
            logger.warning("rank %d: no use for the order %r", self.rank, order.OP)
            return
        handler(order)

    def _dispatch_logged(self, order: protocol.Message) -> None:
        try:
            self.dispatch(order)
        except Exception:
            logger.exception("rank %d: handling the order %r failed", self.rank, order.OP)

    def _park(self, order: protocol.Park) -> None:
        if self.rank in order.replaced:
            # a process the coordinator no longer counts on (a replacement of a recovery
            # given up): it has no state to save, and the job's stop ends it
            logger.info("rank %d: not parking for generation %d, which replaces this rank",
                        self.rank, order.generation)  # fmt: skip
            return
        # what came before the Park belonged to no recovery of this rank's; a recovery
        # still waiting for its plan learns that it was given up
        self.plans.clear()
        self.plans.hand(order)
        self._on_park(order)

    def _save(self, order: protocol.SaveState) -> None:
        # a recovery waiting for its plan will get none: it stops waiting, and the state is
        # saved from where it parked
        self.plans.hand(order)
        if self._on_save is not None:
            self._on_save(order)

    def _abort(self, order: protocol.Abort) -> None:
        self.plans.hand(order)
        self.boundary.hand(order)

    def _announced(self, order: protocol.StateAnnounced) -> None:
        if order.rank == self.rank:
            self.digests.hand(order)
