"""Where a job keeps its files on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def jobs_dir() -> Path:
    """Where running jobs leave their address and token (readable by their owner only), and
    each job its folder."""
    return Path(os.environ.get("XMIG_JOBS_DIR", Path.home() / ".xmig" / "jobs"))


def job_folder(job_id: str) -> Path:
    """The job's own folder: its event log (``events.jsonl``)."""
    return jobs_dir() / job_id
