"""The worker's phases and the transitions between them, in one table."""

from __future__ import annotations

import enum
import threading


class WorkerPhase(enum.Enum):
    STARTING = "starting"  # xmig.init() done, the step loop not begun
    JOINING = "joining"  # a replacement taking its state from a peer
    TRAINING = "training"  # in the step loop
    PARKED = "parked"  # a recovery holds the state (this rank survived a peer's fault)
    PAUSED = "paused"  # at a step boundary, for a migration
    MOVING = "moving"  # being checkpointed and restored on another node
    FINISHED = "finished"  # the steps are done; the rank stays until every rank is


_P = WorkerPhase
# a survivor parks wherever its script is (a peer can fail before this rank's loop begins, or
# after it ends: it serves from its state all the same) and goes back there; a rank paused at
# a boundary parks to save its state when a fault ends the migration or resize it waits for
TRANSITIONS: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    _P.STARTING: frozenset({_P.JOINING, _P.TRAINING, _P.PARKED}),
    _P.JOINING: frozenset({_P.TRAINING}),
    _P.TRAINING: frozenset({_P.PARKED, _P.PAUSED, _P.FINISHED}),
    _P.PARKED: frozenset({_P.STARTING, _P.TRAINING, _P.FINISHED}),
    _P.PAUSED: frozenset({_P.TRAINING, _P.MOVING, _P.PARKED}),
    _P.MOVING: frozenset({_P.PAUSED}),
    _P.FINISHED: frozenset({_P.PARKED}),
}


class IllegalTransition(RuntimeError):
    """A move between two phases that TRANSITIONS does not allow."""


class Phase:
    """The worker's current phase; ``move`` is the only way to change it."""

    def __init__(self, initial: WorkerPhase = WorkerPhase.STARTING) -> None:
        self._current = initial
        self._lock = threading.Lock()

    @property
    def current(self) -> WorkerPhase:
        return self._current

    def move(self, to: WorkerPhase) -> WorkerPhase:
        """Enter ``to``; returns the phase left. IllegalTransition if the table forbids it."""
        with self._lock:
            left = self._current
            if to not in TRANSITIONS[left]:
                raise IllegalTransition(f"a worker cannot go from {left.value} to {to.value}")
            self._current = to
            return left
