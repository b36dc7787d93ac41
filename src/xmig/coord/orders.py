"""What the coordinator's state machines decide: orders the ``Coordinator`` carries out, and
the events it feeds them besides the catalogue's messages. Nothing here touches a socket."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from xmig.protocol import Message
from xmig.state.checkpoint import Manifest


# ---- events that are not messages ----------------------------------------------------------
@dataclass(frozen=True)
class Tick:
    """Time passed (deadlines are checked against the ``now`` every event carries)."""


@dataclass(frozen=True)
class AgentLost:
    """A node's agent is gone: its connection closed, or it fell silent."""

    node: int


# ---- orders --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToAll:
    """Push ``msg`` to every live agent."""

    msg: Message


@dataclass(frozen=True)
class ToNode:
    """Push ``msg`` to one node's agent."""

    node: int
    msg: Message


@dataclass(frozen=True)
class Say:
    """A line for the user (the coordinator's log)."""

    text: str
    level: int = logging.INFO


@dataclass(frozen=True)
class Note:
    """An entry for the job's event log."""

    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """The answer to the request being handled."""

    value: dict[str, Any]


@dataclass(frozen=True)
class Finish:
    """The job has its outcome: tell the launchers, shut the agents down."""

    summary: dict[str, Any]


@dataclass(frozen=True)
class Seal:
    """Put the checkpoint's manifest into ``partial`` and rename it to ``final``; the
    coordinator reports back with ``checkpoint.Sealed``."""

    generation: int
    partial: str
    final: str
    manifest: Manifest


# ---- what a recovery, migration or checkpoint tells the job --------------------------------
@dataclass(frozen=True)
class GiveUp:
    """The recovery or migration cannot finish; the job stops with ``reason``."""

    what: str
    reason: str


@dataclass(frozen=True)
class Settled:
    """The recovery or migration finished; ``record`` is what it leaves behind."""

    record: dict[str, Any]
    line: str


@dataclass(frozen=True)
class Renumber:
    """The world changes size now: the job renumbers its ranks by ``ranks`` (old -> new;
    an old rank not in it has left) and counts ``world_size`` of them."""

    ranks: dict[int, int]
    world_size: int


@dataclass(frozen=True)
class StartRanks:
    """The world grows: start each new rank of ``added`` (rank -> node) for ``generation``,
    in a world of ``world_size`` ranks (the job numbers its processes' attempts)."""

    generation: int
    added: dict[int, int]
    world_size: int


@dataclass(frozen=True)
class DropRanks:
    """A grow given up before its new ranks joined the new world: the job ends their
    processes and forgets them, and resumes the paused ranks of ``generation`` at the old
    size (on communicators of a later generation than the one the new ranks meet under)."""

    generation: int
    ranks: list[int]
    why: str
    resume: bool = True  # False: the job finished before the pause (nobody is paused)


@dataclass(frozen=True)
class ToLaunchers:
    """Push ``msg`` to every launcher that waits for the job's outcome."""

    msg: Message


@dataclass(frozen=True)
class Retry:
    """The recovery failed in a way that a rollback of the step can serve: start it over
    as one (``why``: what made the replay impossible)."""

    why: str


@dataclass(frozen=True)
class Saved:
    """The just-in-time checkpoint is written (``record["path"]``) or could not be; the job
    stops."""

    record: dict[str, Any]


class Refused(ValueError):
    """A request the job cannot carry out now; the message says why."""


Order = (
    ToAll
    | ToNode
    | Say
    | Note
    | Reply
    | Finish
    | Seal
    | GiveUp
    | Settled
    | Saved
    | Retry
    | Renumber
    | StartRanks
    | DropRanks
    | ToLaunchers
)
