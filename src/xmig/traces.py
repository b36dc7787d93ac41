"""The trace file's format, shared by the worker that writes it (``xmig.worker.trace``) and
``xmig check`` that reads it; it loads no torch, so the CLI stays quick to start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def trace_name(rank: int, attempt: int, pid: int) -> str:
    return f"rank{rank}-attempt{attempt}-pid{pid}.jsonl"


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A trace's header and its entries (a torn last line, from a killed process, is left out)."""
    header: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("kind") == "header":
            header = entry
        else:
            entries.append(entry)
    return header, entries
