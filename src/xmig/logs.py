"""Logging of xmig's processes: one ``logging`` logger per module, under the ``xmig`` logger.

Every process of a job (launcher, coordinator, agent, worker) calls :func:`setup` once with the
job's ``--log-level``; its lines go to stderr as ``xmig: <message>``, as xmig has always
written them. The ``xmig`` logger does not propagate: a script that configures the root logger
itself sees no line twice.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from xmig.jobspec import DEFAULT_LOG_LEVEL, LOG_LEVELS

ROOT = "xmig"
FORMAT = "xmig: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (a test may swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


_handler: logging.Handler | None = None


def setup(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Send the ``xmig`` logger's lines of ``level`` (DEBUG, INFO, WARNING or ERROR) and above
    to stderr as ``xmig: <message>``. Once per process; a later call only changes the level."""
    global _handler
    name = level.upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    logger = logging.getLogger(ROOT)
    if _handler is None:
        _handler = _StderrHandler()
        _handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(_handler)
        logger.propagate = False
    logger.setLevel(name)
