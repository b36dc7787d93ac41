"""The job's event log: one JSON object a line (every fault, each recovery and migration
phase with its time, generation and state changes), in the job's folder."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path``; a log that cannot be written is reported once, never
    stops the job. Lines reach the file on ``flush`` (the coordinator's decision thread
    flushes whenever it has nothing left to do: a flush per line cost it a third of its
    time in a recovery at 1,024 ranks), at ``close``, or when the buffer fills."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: TextIO | None = None
        self._broken = False

    def write(self, event: str, t: float, fields: dict[str, Any]) -> None:
        if self._broken:
            return
        try:
            if self._out is None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._out = self.path.open("a")
            self._out.write(json.dumps({"t": round(t, 6), "event": event, **fields},
                                       default=str) + "\n")  # fmt: skip
        except OSError as exc:
            self._broken_at(exc)

    def flush(self) -> None:
        if self._out is None or self._broken:
            return
        try:
            self._out.flush()
        except OSError as exc:
            self._broken_at(exc)

    def _broken_at(self, exc: OSError) -> None:
        self._broken = True
        log.warning("warning: cannot write the event log %s: %s", self.path, exc)

    def close(self) -> None:
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.close()
            self._out = None


def read(path: Path) -> list[dict[str, Any]]:
    """The events of a log, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
