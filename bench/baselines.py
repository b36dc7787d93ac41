"""What users run today, driven the same way as xmig in the benchmarks.

``torchrun_restart``: the demo under ``torchrun --max-restarts 1``, saving a checkpoint to
local disk every K steps and reloading it when torchrun restarts every worker after one dies
(SIGKILL mid-backward, from inside the script, first attempt only).

``step_events`` / ``time_to_step``: every rank appends a JSON line per finished step
(``--events-file``); from those, the time from the kill to a given step having finished on
every rank, for xmig and the baseline alike.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from recovery_cpu import DEMO, bounded, free_port


def step_events(path: Path) -> tuple[list[dict], float | None]:
    """The step records and the kill's wall-clock time (None when nothing was killed)."""
    steps, killed = [], None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "kill" in record:
            killed = record["t"]
        else:
            steps.append(record)
    return steps, killed


def time_to_step(steps: list[dict], since: float, step: int, world_size: int) -> float | None:
    """Seconds from ``since`` until ``step`` had finished on every rank after that moment."""
    done = {}
    for record in steps:
        if record["step"] == step and record["t"] >= since:
            done.setdefault(record["rank"], record["t"])
    if len(done) < world_size:
        return None
    return max(done.values()) - since


def torchrun_restart(
    work: Path,
    name: str,
    model: list[str],
    steps: int,
    fault: tuple[int, int],
    every: int,
    script_flags: list[str],
    nproc: int = 2,
) -> dict:
    """Run the baseline with a kill of rank ``fault[0]`` at step ``fault[1]``."""
    directory = work / f"{name}-checkpoints"
    events = work / f"{name}-events.jsonl"
    events.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--max-restarts", "1", "--monitor-interval", "0.1", "--master-port", str(free_port()),
        str(DEMO), "--plain", *model, "--steps", str(steps), "--quiet", *script_flags,
        "--checkpoint-dir", str(directory), "--checkpoint-every", str(every),
        "--die-at", f"{fault[0]}:{fault[1]}", "--events-file", str(events),
    ]  # fmt: skip
    log = work / f"{name}.log"
    code = bounded(cmd, log)
    found = re.findall(r"final params sha256 ([0-9a-f]{64})", log.read_text())
    records, killed = step_events(events)
    recovered = time_to_step(records, killed, fault[1], nproc) if killed else None
    restarted = [r for r in records if r["attempt"] > 0]
    first_redone = min((r["step"] for r in restarted), default=None)
    saved = directory / "saves.jsonl"
    lines = saved.read_text().splitlines() if saved.exists() else []
    saves = [json.loads(line)["seconds"] for line in lines]
    return {
        "exit_code": code,
        "final_params_sha256": found[-1] if found else None,
        "kill_to_step_done_s": recovered,
        "steps_redone": None if first_redone is None else fault[1] - first_redone,
        "checkpoint_save_s": max(saves) if saves else None,
        "checkpoint_every": every,
        "log": str(log),
    }
