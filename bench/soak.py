"""Reliability soak: hundreds of faults, each run checked bit for bit, and goodput.

    python bench/soak.py [--cases N] [--seed S] [--out bench/results/reliability.md]
                         [--layout-cases N] [--goodput-steps N] [--every K] [--step-sleep S]

1. The fault matrix: ``--cases`` random jobs of the demo GPT on 2-4 ranks, each with one or
   two faults: kill, exit, raise or hang at a point of a step (forward, backward, optimizer,
   boundary, a collective), a node loss, and faults of a survivor in each phase of a recovery
   (park, rebuild, pull, replay) and of a writer of a just-in-time checkpoint; with and
   without a hot spare. Each run must end bit-identical to the fault-free run of its size, or
   stop cleanly with a checkpoint whose resume is bit-identical, or stop cleanly with nothing
   left to save (no rank that holds the state alive).
   With ``--layout-cases``, as many more of FSDP2's HSDP (a 2 x 2 mesh) and of tensor
   parallel by data parallel (2 x 2), in turn, on 4 ranks: the same faults but node losses.
2. xmig's own processes: the coordinator SIGKILLed mid-run and mid-recovery (started again
   by its launcher), and for good (``--coordinator-restarts 0``), an agent SIGKILLed, the
   launcher SIGKILLed, a hot spare SIGKILLed before it is used; each checked the same way,
   and for no process of the job left behind.
3. Goodput: one long run with a kill every ``--every`` steps against the same run without
   faults (the fault-free time over the faulty one, a resume's time included).

Every run is bounded in time and its whole process tree is killed if it overruns. Writes the
counts and times to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from recovery_cpu import bounded, kill_tree, machine

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "train_gpt.py"
STEPS = 8
JOB = [str(DEMO), "--preset", "tiny", "--steps", str(STEPS), "--quiet"]
# the layouts of ``--layout-cases``: the tests' FSDP2 script on a mesh of 4 ranks
MESH_SCRIPT = REPO / "tests" / "scripts" / "fsdp.py"
MESH_STEPS = 6
MESH_LAYOUTS = ("hsdp", "tp-dp")
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
STEP_POINTS = ("forward", "backward", "optimizer", "boundary", "collective=0", "collective=1")
RECOVERY_POINTS = ("park", "rebuild", "pull", "replay", "checkpoint")
RUN_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    case: str
    kind: str  # bit-identical, resumed, nothing to save, or FAILED: why
    seconds: float
    recoveries: int = 0
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.kind.startswith("FAILED")


def xmig_run(
    work: Path, name: str, args: list[str], env: dict | None = None
) -> tuple[dict | None, str, float]:
    """``xmig run --summary … ARGS``; its summary (None without one), output and seconds."""
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    summary = folder / "summary.json"
    log = folder / "output.log"
    started = time.monotonic()
    full_env = {**os.environ, "XMIG_JOBS_DIR": str(folder / "jobs"), **(env or {})}
    try:
        bounded(
            [sys.executable, "-m", "xmig", "run", "--summary", str(summary), *args],
            log,
            RUN_TIMEOUT_S,
            env=full_env,
        )
    except RuntimeError as exc:  # overran: its tree was killed
        return None, f"{exc}\n{log.read_text()}", time.monotonic() - started
    seconds = time.monotonic() - started
    data = json.loads(summary.read_text()) if summary.exists() else None
    return data, log.read_text(), seconds


def leftovers(job_id: str | None) -> list[int]:
    """Processes of the job still alive (by the job id in their environment)."""
    if not job_id:
        return []
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get("XMIG_JOB_ID") == job_id
            ):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class Soak:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.references: dict[tuple, str] = {}
        self.outcomes: list[Outcome] = []
        self.count = 0

    def reference(self, layout: list[str], job: list[str]) -> str:
        key = (*layout, *job)
        if key not in self.references:
            summary, output, _ = xmig_run(
                self.work, f"reference-{len(self.references)}", [*layout, *FAST, *job]
            )
            if summary is None or summary["status"] != "completed":
                raise SystemExit(f"the fault-free run {key} failed:\n{output[-2000:]}")
            self.references[key] = summary["final_params_sha256"]
        return self.references[key]

    def judge(
        self,
        case: str,
        layout: list[str],
        job: list[str],
        summary: dict | None,
        output: str,
        seconds: float,
    ) -> Outcome:
        """Bit-identical, or a clean stop whose checkpoint resumes bit-identical, or a clean
        stop with nothing to save; anything else is a failure."""
        expected = self.reference(layout, job)
        if summary is None:
            return Outcome(
                case,
                "FAILED: no summary (overran or crashed)",
                seconds,
                detail={"output": output[-1500:]},
            )
        left = leftovers(summary.get("job_id"))
        if left:
            return Outcome(case, f"FAILED: processes left behind {left}", seconds)
        recoveries = len(summary.get("recoveries") or [])
        if summary["status"] == "completed":
            if summary["final_params_sha256"] != expected:
                return Outcome(case, "FAILED: completed but not bit-identical", seconds, recoveries)
            return Outcome(case, "bit-identical", seconds, recoveries)
        saved = summary.get("jit_checkpoint") or {}
        if not saved.get("path"):
            why = saved.get("why") or summary["message"]
            if "no rank that holds the state is left" in str(why):
                return Outcome(case, "nothing to save", seconds, recoveries)
            return Outcome(
                case, f"FAILED: stopped without a checkpoint: {why}", seconds, recoveries
            )
        if not saved.get("complete"):
            return Outcome(case, "incomplete checkpoint (a shard lost)", seconds, recoveries)
        lines = [x for x in output.splitlines() if x.startswith("xmig: resume with: ")]
        if not lines:
            return Outcome(case, "FAILED: no resume command", seconds, recoveries)
        command = shlex.split(lines[-1].removeprefix("xmig: resume with: "))[2:]
        if "--summary" in command:
            where = command.index("--summary")
            del command[where : where + 2]
        self.count += 1
        resumed, resumed_output, resume_s = xmig_run(self.work, f"resume-{self.count}", command)
        total = seconds + resume_s
        if resumed is None or resumed["status"] != "completed":
            return Outcome(
                case,
                "FAILED: the resume did not complete",
                total,
                recoveries,
                {"output": resumed_output[-1500:]},
            )
        if resumed["final_params_sha256"] != expected:
            return Outcome(case, "FAILED: the resume is not bit-identical", total, recoveries)
        return Outcome(case, "resumed", total, recoveries, {"resume_s": resume_s})

    def faults(self, rng: random.Random) -> tuple[list[str], list[str], str]:
        """A random job: its layout, its --inject flags, and a name."""
        ranks = rng.randint(2, 4)
        layout = ["--nproc-per-node", str(ranks), "--hot-spares", str(rng.choice((0, 1)))]
        step = rng.randint(1, STEPS - 2)
        kind = rng.choice(("kill", "kill", "exit", "raise", "hang", "node"))
        point = rng.choice(STEP_POINTS)
        if kind == "raise" and point in ("forward", "optimizer", "boundary"):
            point = "backward"
        first = rng.randrange(ranks)
        faults = [f"{kind}:rank={first}:step={step}:at={point}"]
        if kind == "node":
            layout = [
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(max(1, ranks // 2)),
                "--spare-nodes",
                str(rng.choice((0, 1))),
                layout[-2],
                layout[-1],
            ]
            first = min(first, 2 * max(1, ranks // 2) - 1)
            faults = [f"node:rank={first}:step={step}:at={point}"]
        world = 2 * max(1, ranks // 2) if kind == "node" else ranks
        second = self.second_fault(rng, world, first, step, STEPS)
        faults += [second] if second else []
        return layout, faults, " ".join([*layout, *faults])

    @staticmethod
    def second_fault(rng: random.Random, world: int, first: int, step: int,
                     steps: int) -> str | None:  # fmt: skip
        """Half the time a second fault: a kill of another rank than ``first`` in a phase
        of the recovery, or a kill or exit of any rank at ``step`` or later."""
        if rng.random() >= 0.5:
            return None
        rank = rng.randrange(world)
        if rank != first and rng.random() < 0.6:
            return f"kill:rank={rank}:step={step}:at={rng.choice(RECOVERY_POINTS)}"
        later = rng.randint(step, steps - 1)
        kind = rng.choice(("kill", "exit"))
        return f"{kind}:rank={rank}:step={later}:at={rng.choice(STEP_POINTS)}"

    @staticmethod
    def step_faults(rng: random.Random, world: int, steps: int) -> list[str]:
        """One fault at a point of a step, and half the time a second (``second_fault``)."""
        step = rng.randint(1, steps - 2)
        kind = rng.choice(("kill", "kill", "exit", "raise", "hang"))
        point = rng.choice(STEP_POINTS)
        if kind == "raise" and point in ("forward", "optimizer", "boundary"):
            point = "backward"
        first = rng.randrange(world)
        second = Soak.second_fault(rng, world, first, step, steps)
        return [f"{kind}:rank={first}:step={step}:at={point}", *([second] if second else [])]

    def layout_case(self, rng: random.Random, mesh: str) -> Outcome:
        """A random faulty job of the FSDP2 script on ``mesh`` (4 ranks)."""
        layout = ["--nproc-per-node", "4", "--hot-spares", str(rng.choice((0, 1)))]
        job = [str(MESH_SCRIPT), "--layout", mesh, "--steps", str(MESH_STEPS)]
        faults = self.step_faults(rng, 4, MESH_STEPS)
        self.count += 1
        injected = [x for f in faults for x in ("--inject", f)]
        summary, output, seconds = xmig_run(
            self.work, f"case-{self.count}", [*layout, *FAST, *injected, *job]
        )
        name = " ".join([mesh, *layout, *faults])
        outcome = self.judge(name, layout, job, summary, output, seconds)
        outcome.detail["faults"] = len(faults)
        outcome.detail["mesh"] = mesh
        return outcome

    def matrix_case(self, rng: random.Random) -> Outcome:
        layout, faults, name = self.faults(rng)
        self.count += 1
        injected = [x for f in faults for x in ("--inject", f)]
        summary, output, seconds = xmig_run(
            self.work, f"case-{self.count}", [*layout, *FAST, *injected, *JOB]
        )
        outcome = self.judge(name, layout, JOB, summary, output, seconds)
        outcome.detail["faults"] = len(faults)
        return outcome

    # ---- xmig's own processes -----------------------------------------------------------
    def process_case(self, what: str) -> Outcome:
        """Kill one of xmig's own processes of a running job; judged like any fault."""
        slow = [str(DEMO), "--preset", "tiny", "--steps", "10", "--step-sleep", "0.3"]
        layout = ["--nproc-per-node", "2", "--hot-spares", "1"]
        extra: list[str] = []
        if what == "agent":
            layout = ["--nnodes", "2", "--nproc-per-node", "1", "--hot-spares", "0"]
        if what == "coordinator mid-recovery":
            extra = ["--inject", "kill:rank=1:step=4:at=backward"]
            layout = ["--nproc-per-node", "2", "--hot-spares", "0"]
        if what == "coordinator for good":
            layout = [*layout, "--coordinator-restarts", "0"]
        self.count += 1
        folder = self.work / f"process-{self.count}"
        folder.mkdir()
        summary_path = folder / "summary.json"
        log = (folder / "output.log").open("w")
        env = {**os.environ, "XMIG_JOBS_DIR": str(folder / "jobs"), "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "xmig",
                "run",
                "--summary",
                str(summary_path),
                *layout,
                *FAST,
                *extra,
                *slow,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        output, job_id = "", None
        want = (
            "recovery to generation 1"
            if extra
            else ("spare(s) ready" if what == "hot spare" else "step 3 loss")
        )
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while time.monotonic() < deadline:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    break
                output += line
                log.write(line)
                if job_id is None and line.startswith("xmig: job ") and ":" in line[10:]:
                    job_id = line[10:].split(":", 1)[0]
                if want in line or (what == "hot spare" and "step 3 loss" in line):
                    break
            target = self._target(what, proc, job_id)
            if target is not None:
                target.kill()
            if what == "hot spare":  # then a fault: the recovery must start cold
                subprocess.run(
                    [sys.executable, "-m", "xmig", "inject", "kill:rank=1"],
                    env=env,
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
            rest, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
            output += rest
            log.write(rest)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return Outcome(what, "FAILED: overran", time.monotonic() - started)
        finally:
            log.close()
        seconds = time.monotonic() - started
        if what == "launcher":
            time.sleep(3)
            left = leftovers(job_id)
            kind = f"FAILED: processes left behind {left}" if left else "clean end"
            return Outcome(what, kind, seconds)
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        return self.judge(what, layout, slow, summary, output, seconds)

    @staticmethod
    def _target(what: str, proc: subprocess.Popen, job_id: str | None) -> psutil.Process | None:
        if what == "launcher":
            return psutil.Process(proc.pid)
        family = psutil.Process(proc.pid).children(recursive=True)
        for member in family:
            try:
                line = " ".join(member.cmdline())
            except psutil.NoSuchProcess:
                continue
            if what.startswith("coordinator") and "xmig.coord" in line:
                return member
            if what == "agent" and "xmig.agent" in line and line.endswith("--node-rank 1"):
                return member
            if what == "hot spare" and "xmig.agent.spare" in line:
                return member
        return None

    # ---- goodput ------------------------------------------------------------------------
    def goodput(self, steps: int, every: int, sleep: float, ranks: int) -> dict:
        """A long run with a kill every ``every`` steps, against the same run without."""
        job = [
            str(DEMO),
            "--preset",
            "tiny",
            "--steps",
            str(steps),
            "--quiet",
            "--step-sleep",
            str(sleep),
        ]
        layout = ["--nproc-per-node", str(ranks), "--hot-spares", "1"]
        timing = {name: self.work / f"{name}-steps.json" for name in ("clean", "faulty")}
        clean, _, clean_s = xmig_run(
            self.work,
            "goodput-clean",
            [*layout, *FAST, *job, "--timing-file", str(timing["clean"])],
        )
        faults = [
            f"kill:rank={1 + (i % (ranks - 1))}:step={s}:at=backward"
            for i, s in enumerate(range(every, steps, every))
        ]
        injected = [x for f in faults for x in ("--inject", f)]
        faulty, output, faulty_s = xmig_run(
            self.work,
            "goodput-faulty",
            [
                *layout,
                *FAST,
                "--max-recoveries",
                str(len(faults)),
                *injected,
                *job,
                "--timing-file",
                str(timing["faulty"]),
            ],
        )
        assert clean is not None
        identical = (
            faulty is not None and faulty["final_params_sha256"] == clean["final_params_sha256"]
        )
        recoveries = (faulty or {}).get("recoveries") or []
        # rank 0's steps (every fault hits another rank: its stall is rank 0's step time), the
        # first one left out (the start's warm-up)
        steps_s = {
            name: sum(json.loads(path.read_text())["step_times"][1:]) if path.exists() else None
            for name, path in timing.items()
        }
        return {
            "steps": steps,
            "every": every,
            "sleep": sleep,
            "ranks": ranks,
            "faults": len(faults),
            "clean_s": clean_s,
            "faulty_s": faulty_s,
            "clean_steps_s": steps_s["clean"],
            "faulty_steps_s": steps_s["faulty"],
            "goodput": (steps_s["clean"] / steps_s["faulty"]) if steps_s["faulty"] else 0.0,
            "identical": identical,
            "recovery_s": [r["total_s"] for r in recoveries],
        }


def report(
    outcomes: list[Outcome],
    goodput: dict | None,
    args: argparse.Namespace,
    started: str,
    elapsed: float,
) -> list[str]:
    kinds = collections.Counter(o.kind if o.ok else "FAILED" for o in outcomes)
    matrix = [
        o
        for o in outcomes
        if not o.case.startswith(("coordinator", "agent", "launcher", "hot spare"))
    ]
    own = [o for o in outcomes if o not in matrix]
    meshes = [o for o in matrix if "mesh" in o.detail]
    matrix = [o for o in matrix if "mesh" not in o.detail]
    lines = [
        "# Reliability soak",
        "",
        f"Measured {started} with `python bench/soak.py {' '.join(sys.argv[1:])}` "
        f"({elapsed / 60:.0f} min); machine: {machine()}.",
        "",
        "The demo GPT (`--preset tiny`), 2-4 ranks (gloo)"
        + (
            f"; {args.layout_cases} of the jobs FSDP2's HSDP and TP by DP on 4 ranks "
            "(`tests/scripts/fsdp.py`)"
            if args.layout_cases
            else ""
        )  # fmt: skip
        + ". Each run is judged: bit-identical to "
        "the fault-free run of its size; or a clean stop with a just-in-time checkpoint whose "
        "resume is bit-identical; or a clean stop with nothing left to save (no live rank "
        "holds the state); anything else fails, and so does a process of the job left behind.",
        "",
        f"## Outcomes: {len(outcomes)} runs, {sum(o.ok for o in outcomes)} as they must be",
        "",
        "| outcome | runs |",
        "|---|---|",
        *[f"| {kind} | {n} |" for kind, n in sorted(kinds.items())],
        "",
        f"Fault matrix: {len(matrix)} random jobs (seed {args.seed}), "
        f"{sum(o.detail.get('faults', 0) for o in matrix)} faults drawn in all; "
        f"{sum(o.recoveries for o in matrix)} recoveries. Median time a run: "
        f"{statistics.median(o.seconds for o in matrix):.1f} s."
        if matrix
        else "",
        "",
    ]
    if meshes:
        lines += [
            f"Layouts: {len(meshes)} random jobs of FSDP2's HSDP and TP by DP (seed {args.seed}), "
            f"{sum(o.detail.get('faults', 0) for o in meshes)} faults drawn in all; "
            f"{sum(o.recoveries for o in meshes)} recoveries. Median time a run: "
            f"{statistics.median(o.seconds for o in meshes):.1f} s.",
            "",
        ]
    if own:
        lines += [
            "## xmig's own processes killed",
            "",
            "| killed | outcome | seconds |",
            "|---|---|---|",
            *[f"| {o.case} | {o.kind} | {o.seconds:.1f} |" for o in own],
            "",
        ]
    failed = [o for o in outcomes if not o.ok]
    if failed:
        lines += ["## Failures", ""]
        lines += [f"- `{o.case}`: {o.kind}" for o in failed]
        lines.append("")
    if goodput is not None:
        g = goodput
        times = g["recovery_s"]
        lines += [
            "## Goodput",
            "",
            f"{g['steps']} steps of {g['sleep']} s each (a sleep in the step: the model's own "
            f"compute is milliseconds) on {g['ranks']} ranks with a hot spare, a kill every "
            f"{g['every']} steps ({g['faults']} faults, never rank 0), against the same run "
            f"without faults: rank 0's steps 1-{g['steps'] - 1} took {g['clean_steps_s']:.1f} s "
            f"against {g['faulty_steps_s']:.1f} s (whole runs: {g['clean_s']:.1f} s and "
            f"{g['faulty_s']:.1f} s), goodput **{100 * g['goodput']:.1f} %**, bit-identical: "
            f"{g['identical']}. Recoveries: "
            + (
                f"median {statistics.median(times):.2f} s (range {min(times):.2f}-{max(times):.2f})"
                if times
                else "none"
            )
            + ".",
            "",
        ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100, help="random faulty jobs")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--layout-cases", type=int, default=0,
                        help="faulty jobs of FSDP2's HSDP and TP by DP, in turn")  # fmt: skip
    parser.add_argument(
        "--no-processes", action="store_true", help="leave out the kills of xmig's own processes"
    )
    parser.add_argument("--goodput-steps", type=int, default=200, help="0: no goodput run")
    parser.add_argument("--every", type=int, default=20, help="a kill every N steps")
    parser.add_argument("--step-sleep", type=float, default=0.5)
    parser.add_argument("--goodput-ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "reliability.md")
    args = parser.parse_args()
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.monotonic()
    soak = Soak(Path(tempfile.mkdtemp(prefix="xmig-soak-")))
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # bounded() kills its run's tree
    try:
        for i in range(args.cases):
            outcome = soak.matrix_case(rng)
            soak.outcomes.append(outcome)
            print(
                f"[{i + 1}/{args.cases}] {outcome.case}: {outcome.kind} ({outcome.seconds:.1f} s)",
                flush=True,
            )
        for i in range(args.layout_cases):
            outcome = soak.layout_case(rng, MESH_LAYOUTS[i % len(MESH_LAYOUTS)])
            soak.outcomes.append(outcome)
            print(f"[layouts {i + 1}/{args.layout_cases}] {outcome.case}: {outcome.kind} "
                  f"({outcome.seconds:.1f} s)", flush=True)  # fmt: skip
        if not args.no_processes:
            for what in (
                "coordinator mid-run",
                "coordinator mid-recovery",
                "coordinator for good",
                "agent",
                "launcher",
                "hot spare",
            ):
                outcome = soak.process_case(what)
                soak.outcomes.append(outcome)
                print(f"[{what}] {outcome.kind} ({outcome.seconds:.1f} s)", flush=True)
        goodput = None
        if args.goodput_steps:
            goodput = soak.goodput(
                args.goodput_steps, args.every, args.step_sleep, args.goodput_ranks
            )
            print(f"goodput {100 * goodput['goodput']:.1f} %", flush=True)
    finally:
        lines = report(soak.outcomes, locals().get("goodput"), args, started, time.monotonic() - t0)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    return 0 if all(o.ok for o in soak.outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
