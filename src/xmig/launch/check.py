"""``xmig check``: before any fault, whether a script recovers bit-identically.

It runs the script under ``xmig run`` a few times, each rank writing down what it issues
(``--trace-dir``): twice without a fault (the script must be deterministic at all), then once per
check with one rank killed at the start of a chosen step, so that a replacement recomputes that
step from the state it pulls. The replacement's forwards (their inputs: the batch) and
collectives (their inputs) from that step on must be the original rank's, and the run must end
with the same parameters. Each check gets a verdict in a line that names the first difference
and its likely cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmig.bitwise import README_SECTION
from xmig.traces import read_trace

log = logging.getLogger(__name__)

DEFAULT_STEP = 3  # a step after DDP's bucket rebuild (step 1) with steps before it
OWN_OPTIONS = ("--inject", "--summary", "--trace-dir")


class CheckError(Exception):
    """Bad input for ``xmig check``: one line, exit code 2."""


@dataclass
class Run:
    """One ``xmig run`` of the check: its summary and every process's trace."""

    name: str
    folder: Path
    code: int
    summary: dict[str, Any] | None

    def traces(self) -> dict[tuple[int, int], list[dict[str, Any]]]:
        """(rank, attempt) -> its trace (the latest process of that attempt)."""
        found: dict[tuple[int, int], tuple[int, list[dict[str, Any]]]] = {}
        for path in sorted((self.folder / "trace").glob("*.jsonl")):
            header, entries = read_trace(path)
            key = (int(header.get("rank", -1)), int(header.get("attempt", 0)))
            found[key] = (int(header.get("pid", 0)), entries)
        return {key: entries for key, (_, entries) in found.items()}

    @property
    def message(self) -> str:
        if self.summary is None:
            return f"no summary (exit code {self.code}; see {self.folder / 'output.log'})"
        return str(self.summary.get("message"))


def by_step(entries: list[dict[str, Any]], kind: str) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = {}
    for entry in entries:
        if entry.get("kind") == kind:
            steps.setdefault(int(entry["step"]), []).append(entry)
    return steps


def first_difference(reference: list[dict[str, Any]], other: list[dict[str, Any]],
                     from_step: int) -> str | None:  # fmt: skip
    """Where ``other`` (a process's trace) first differs from ``reference`` from ``from_step``
    on, and the likely cause; None when it does not."""
    forwards, ops = by_step(reference, "forward"), by_step(reference, "op")
    their_forwards, their_ops = by_step(other, "forward"), by_step(other, "op")
    steps = sorted(s for s in set(forwards) | set(ops) if s >= from_step)
    for step in steps:
        mine, theirs = forwards.get(step, []), their_forwards.get(step, [])
        for n, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a["in"] != b["in"]:
                return (f"differs at forward {n} of step {step}: the batch is not a function "
                        "of the step (draw it through session.batches(), or compute it from "
                        f"the step; {README_SECTION})")  # fmt: skip
        if len(mine) != len(theirs):
            return (f"runs {len(theirs)} forwards in step {step}, the original rank "
                    f"{len(mine)}")  # fmt: skip
        mine, theirs = ops.get(step, []), their_ops.get(step, [])
        for a, b in zip(mine, theirs, strict=False):
            if a["sig"] != b["sig"]:
                return (f"issues other collectives in step {step}: op {a['index']} is "
                        f"{b['sig']}, the original rank's {a['sig']}")  # fmt: skip
            if a["in"] != b["in"]:
                return (f"differs at collective {a['index']} of step {step} ({a['op']}): its "
                        "batches are the original rank's, so random numbers or other state "
                        "differ (a generator of its own, or state changed in the loop and not "
                        f"registered; {README_SECTION})")  # fmt: skip
        if len(mine) != len(theirs):
            return (f"issues {len(theirs)} collectives in step {step}, the original rank "
                    f"{len(mine)}")  # fmt: skip
    return None


def final_of(entries: list[dict[str, Any]]) -> str | None:
    return next((e.get("params") for e in reversed(entries) if e.get("kind") == "final"), None)


def ddp_rebuilds(trace: list[dict[str, Any]]) -> bool:
    """Whether DDP rebuilt its buckets in the script's second step (int32 broadcasts)."""
    return any(e.get("op") == "broadcast" and "torch.int32" in e.get("sig", "")
               for e in by_step(trace, "op").get(1, []))  # fmt: skip


class Checker:
    """Runs the check's jobs and says what they show."""

    def __init__(self, run_args: list[str], rank: int | None, steps: list[int], folder: Path,
                 run_timeout: float, kept: bool = False) -> None:  # fmt: skip
        self.kept = kept  # the runs' files stay in ``folder``
        self.run_args = run_args
        self.rank = rank
        self.steps = steps
        self.folder = folder
        self.run_timeout = run_timeout
        self.runs = 0

    def say(self, text: str) -> None:
        print(f"xmig check: {text}", flush=True)

    def launch(self, name: str, inject: list[str]) -> Run:
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        summary = folder / "summary.json"
        cmd = [sys.executable, "-m", "xmig", "run", "--summary", str(summary),
               "--trace-dir", str(folder / "trace")]  # fmt: skip
        for spec in inject:
            cmd += ["--inject", spec]
        cmd += self.run_args
        self.runs += 1
        started = time.monotonic()
        with (folder / "output.log").open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                code = proc.wait(timeout=self.run_timeout)
            except subprocess.TimeoutExpired:
                code = -1
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
        data = json.loads(summary.read_text()) if summary.is_file() else None
        run = Run(name, folder, code, data)
        if code == -1:
            run.summary = None
        log.debug("%s: exit %d in %.1f s", name, code, time.monotonic() - started)
        return run

    def check(self) -> int:
        """Run every check; 0 when all hold, 1 when one does not."""
        self.say("run 1: the script without a fault")
        first = self.launch("reference", [])
        if first.code == -1:
            self.say(f"the run without a fault took longer than {self.run_timeout:.0f} s: "
                     "give the script arguments that make it short (a few steps)")  # fmt: skip
            return 1
        if first.code != 0 or first.summary is None:
            self.say(f"the script does not complete without a fault: {first.message}")
            return 1
        world = int(first.summary["world_size"])
        total = int(first.summary["steps"])
        traces = first.traces()
        if world < 2:
            raise CheckError("a job of one rank has no peer to recover from: run it on 2 or more")
        rank = world - 1 if self.rank is None else self.rank
        if not 0 <= rank < world:
            raise CheckError(f"--rank {rank} does not exist (world size {world})")
        if (rank, 0) not in traces or not traces[(rank, 0)]:
            self.say("the script issued nothing xmig saw (does it call xmig.init() and run its "
                     "steps through session.steps()?)")  # fmt: skip
            return 1
        steps = self.steps or self._default_steps(total, traces.get((0, 0), []))
        late = [s for s in steps if not 0 <= s < total]
        if late:
            raise CheckError(f"--step {late[0]}: the script runs steps 0..{total - 1}")
        verdicts = [self._determinism(first, world)]
        if verdicts[0]:
            for step in steps:
                verdicts.append(self._replaced(first, rank, step))
        passed = sum(verdicts)
        planned = 1 + len(steps)
        if not verdicts[0]:
            self.say(f"the replacement checks were not run: they cannot pass ({planned - 1})")
        where = f"; their files are in {self.folder}" if self.kept else ""
        self.say(f"{passed} of {planned} checks hold ({self.runs} runs{where})")
        return 0 if passed == planned else 1

    @staticmethod
    def _default_steps(total: int, rank0: list[dict[str, Any]]) -> list[int]:
        chosen = {0, min(DEFAULT_STEP, total - 1)}
        if ddp_rebuilds(rank0) and total > 2:
            chosen.add(2)  # the first step after DDP's bucket rebuild
        return sorted(chosen)

    def _determinism(self, first: Run, world: int) -> bool:
        self.say("run 2: the script without a fault, again")
        second = self.launch("reference-again", [])
        if second.code != 0 or second.summary is None:
            self.say(f"without a fault, again: FAILED: {second.message}")
            return False
        mine, theirs = first.traces(), second.traces()
        for rank in range(world):
            where = first_difference(mine.get((rank, 0), []), theirs.get((rank, 0), []), 0)
            if where is not None:
                self.say(f"two runs without a fault: rank {rank} {where.split(':')[0]}: the "
                         "script is not deterministic (time, unseeded or global state), so "
                         "no recovery of it can be bit-identical")  # fmt: skip
                return False
        if first.summary.get("final_params_sha256") != second.summary.get("final_params_sha256"):
            self.say("two runs without a fault end with different parameters: the script is "
                     "not deterministic, so no recovery of it can be bit-identical")  # fmt: skip
            return False
        self.say("two runs without a fault: identical")
        return True

    def _replaced(self, reference: Run, rank: int, step: int) -> bool:
        what = f"rank {rank} replaced at step {step}"
        self.say(f"run {self.runs + 1}: the script with rank {rank} killed at step {step}")
        run = self.launch(f"replaced-rank{rank}-step{step}",
                          [f"kill:rank={rank}:step={step}:at=boundary"])  # fmt: skip
        if run.code != 0 or run.summary is None:
            reason = run.message.removeprefix("failed: ")
            hint = ""
            if "parameters differ" in reason:
                hint = (": state that changes in the loop is not registered (an LR scheduler, "
                        f"a grad scaler?; {README_SECTION})")  # fmt: skip
            self.say(f"{what}: the recovery failed: {reason}{hint}")
            return False
        replaced = [v for (r, attempt), v in run.traces().items() if r == rank and attempt > 0]
        original = reference.traces().get((rank, 0), [])
        if not replaced:
            self.say(f"{what}: no trace of the replacement (was it recovered?): {run.message}")
            return False
        where = first_difference(original, replaced[-1], step)
        if where is not None:
            self.say(f"{what}: {where}")
            return False
        expected = reference.summary.get("final_params_sha256") if reference.summary else None
        if run.summary.get("final_params_sha256") != expected or final_of(replaced[-1]) != (
            final_of(original)
        ):
            self.say(f"{what}: inputs identical, result differs: state that changes in the "
                     f"loop is not registered (an LR scheduler, a grad scaler?; "
                     f"{README_SECTION})")  # fmt: skip
            return False
        self.say(f"{what}: inputs identical, result identical")
        return True


def run_check(run_args: list[str], rank: int | None, steps: list[int], keep: Path | None,
              run_timeout: float) -> int:  # fmt: skip
    """``xmig check``: the exit code (2 for bad input is the caller's ``CheckError``)."""
    if not run_args:
        raise CheckError("give the run's options and the script: xmig check [OPTIONS] SCRIPT ...")
    script_at = next((i for i, a in enumerate(run_args) if Path(a).is_file()), len(run_args))
    own = [a for a in run_args[:script_at] if a.split("=")[0] in OWN_OPTIONS]
    if own:
        raise CheckError(f"{own[0].split('=')[0]} is xmig check's own: leave it out")
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return Checker(run_args, rank, steps, keep, run_timeout, kept=True).check()
    with tempfile.TemporaryDirectory(prefix="xmig-check-") as folder:
        return Checker(run_args, rank, steps, Path(folder), run_timeout).check()
