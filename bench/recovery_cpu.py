"""CPU benchmark: plain DDP vs DDP through xmig's proxy, and recovery time by fault point.

    python bench/recovery_cpu.py [--out bench/results/recovery-cpu.md] [--baseline SRC]
                                 [--repeat N]
    python bench/recovery_cpu.py --parallel ddp,ddp-subgroup,hsdp,tp-dp [--repeat N]
                                 [--out bench/results/recovery-layouts.md]

With ``--baseline SRC`` (the ``src`` folder of another checkout of xmig, e.g. a ``git
worktree`` of an earlier commit) every measurement runs for both versions in the same run,
alternating their order, and the report compares them (before = SRC, after = this checkout).
``--repeat N`` takes every measurement N times (medians and their range are reported): on a
shared 2-core machine one run of each is not enough to tell 2 % apart.

Runs the demo GPT on 2 ranks (gloo). Steady state: plain DDP and DDP through xmig in the same
processes, steps alternating (``bench/proxy_overhead.py``), at two sizes.
Recovery: a SIGKILL of rank 1 at each point of a step, each compared bit for bit with the
fault-free run. Every run is bounded in time and its process group killed if it overruns.

``--parallel LAYOUTS`` measures recovery per parallel layout instead, on 4 ranks: the demo GPT
under DDP, HSDP (2 × 2) and TP × DP (2 × 2), and DDP over the dp groups of a (stage, dp) mesh
(``tests/scripts/groups.py``); the same kills, each against its layout's fault-free run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from machine_info import machine  # (the other benches take it from here too)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "train_gpt.py"
OVERHEAD = REPO / "bench" / "proxy_overhead.py"
MODEL = ["--preset", "small", "--batch-size", "8"]
SIZES = {  # name: (model flags, steps)
    "small, 512 tokens/rank/step": (MODEL, 60),
    "small, 2048 tokens/rank/step": ([*MODEL, "--block-size", "256"], 30),
}
WARMUP_STEPS = 5
RUN_TIMEOUT_S = 600
POINTS = ["forward", "backward", "optimizer", "boundary"]
SLOW = ["--step-sleep", "0.3"]
FAULT_STEP = 10
LAYOUT_RANKS = 4
# layout: (script, its flags besides --steps and the step's sleep)
LAYOUTS = {
    "ddp": (DEMO, [*MODEL, "--quiet", "--parallel", "ddp"]),
    "ddp-subgroup": (REPO / "tests" / "scripts" / "groups.py", ["--groups", "mesh"]),
    "hsdp": (DEMO, [*MODEL, "--quiet", "--parallel", "hsdp", "--replicas", "2"]),
    "tp-dp": (DEMO, [*MODEL, "--quiet", "--parallel", "tp-dp", "--replicas", "2"]),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bounded(cmd: list[str], log: Path, timeout: float = RUN_TIMEOUT_S,
            env: dict[str, str] | None = None) -> int:  # fmt: skip
    """Run ``cmd`` in its own process group; kill the group if it overruns (or when the
    caller is interrupted while it waits)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise RuntimeError(f"{' '.join(cmd)} overran {timeout:.0f} s; see {log}") from None
        except BaseException:
            kill_tree(proc)
            raise


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group and every process descended from it (torchrun starts
    its workers in sessions of their own), then reap ``proc``."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.wait()


def version_env(src: Path | None) -> dict[str, str] | None:
    """The environment that runs the xmig in ``src`` (None: this checkout's)."""
    if src is None:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    return env


def paired(work: Path, name: str, steps: int, model: list[str], nproc: int = 2,
           env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """Plain DDP and DDP through xmig in the same processes, steps alternating (ABBA)."""
    out = work / f"{name}.json"
    cmd = [
        # no hot spare: its warm-up would run beside the measured steps
        sys.executable, "-m", "xmig", "run", "--nproc-per-node", str(nproc), "--hot-spares", "0",
        str(OVERHEAD),
        "--steps", str(steps), "--warmup", str(WARMUP_STEPS), "--out", str(out), *model,
    ]  # fmt: skip
    code = bounded(cmd, work / f"{name}.log", env=env)
    if code != 0:
        raise RuntimeError(f"the paired run {name} failed with exit code {code}; see {work}")
    result = json.loads(out.read_text())
    times = result["step_times"]
    ratios = sorted(x / p for x, p in zip(times["xmig"][WARMUP_STEPS:],
                                          times["plain"][WARMUP_STEPS:], strict=True))  # fmt: skip
    result["ratio_q1"] = ratios[len(ratios) // 4]
    result["ratio_q3"] = ratios[(3 * len(ratios)) // 4]
    return result


def xmig_summary(
    work: Path,
    name: str,
    steps: int,
    flags: list[str],
    script_flags: list[str],
    model: list[str] = MODEL,
    nproc: int = 2,
    timeout: float = RUN_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> dict:
    """``xmig run FLAGS demo SCRIPT_FLAGS`` with a summary; returns the summary."""
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", str(nproc), "--summary",
           str(summary), *flags, str(DEMO), *model, "--steps", str(steps), "--quiet",
           *script_flags]  # fmt: skip
    bounded(cmd, work / f"{name}.log", timeout, env=env)
    return json.loads(summary.read_text())


def write_report(path: Path, lines: list[str], echo: bool = False) -> None:
    """Write a results file (Markdown lines); print it, or where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print("\n".join(lines) if echo else f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recovery-cpu.md")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="the src folder of another xmig to compare with, in the same run",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of every measurement")
    parser.add_argument("--recovery-only", action="store_true",
                        help="leave the steady-state measurement out")  # fmt: skip
    parser.add_argument("--parallel", metavar="LAYOUTS",
                        help=f"recovery per parallel layout instead, comma-separated: "
                             f"{', '.join(LAYOUTS)}")  # fmt: skip
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.parallel is not None:
        layouts = [x.strip() for x in args.parallel.split(",") if x.strip()]
        unknown = [x for x in layouts if x not in LAYOUTS]
        if unknown or not layouts:
            parser.error(f"--parallel: unknown layout(s) {unknown}; choose from "
                         f"{', '.join(LAYOUTS)}")  # fmt: skip
        if args.baseline is not None:
            parser.error("--parallel measures this checkout only (no --baseline)")
        out = args.out
        if out == parser.get_default("out"):
            out = REPO / "bench" / "results" / "recovery-layouts.md"
        write_report(out, layout_report(layouts, args.repeat), echo=True)
        return 0
    command = "python bench/recovery_cpu.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="xmig-bench-"))

    envs = {"before": version_env(args.baseline), "after": None}
    versions = ["before", "after"] if args.baseline else ["after"]

    def in_turn(i: int) -> list[str]:
        """Both versions, their order alternating from one measurement to the next (ABBA)."""
        return versions if i % 2 == 0 else versions[::-1]

    # version -> size -> one result per repeat
    every_overhead: dict[str, dict[str, list[dict]]] = {v: {} for v in versions}
    turn = 0
    for repeat in range(0 if args.recovery_only else args.repeat):
        for name, (model, steps) in SIZES.items():
            for version in in_turn(turn):
                slug = f"{version}-{repeat}-{name.replace(' ', '_').replace('/', '-')}"
                result = paired(work, slug, steps, model, env=envs[version])
                every_overhead[version].setdefault(name, []).append(result)
                print(f"[{version}] {name}: plain {result['median_ms']['plain']:.1f} ms, xmig "
                      f"{result['median_ms']['xmig']:.1f} ms, paired ratio "
                      f"{result['paired_ratio_median']:.4f}", flush=True)  # fmt: skip
            turn += 1

    # slow steps (a sleep, which changes no number) give the hot spare time to warm up first
    fault_steps = 16
    references = {v: xmig_summary(work, f"{v}-reference", fault_steps, [], SLOW, env=envs[v])
                  for v in versions}  # fmt: skip
    reference = references["after"]
    every_recovery: dict[str, list] = {v: [] for v in versions}
    cases = [(point, []) for point in POINTS]
    cases += [(point, ["--hot-spares", "0"]) for point in POINTS]
    runs = [(repeat, case) for repeat in range(args.repeat) for case in cases]
    for i, (repeat, (point, extra)) in enumerate(runs):
        spec = f"kill:rank=1:step={FAULT_STEP}:at={point}"
        for version in in_turn(i):
            name = f"{version}-{repeat}-kill-{point}{'-cold' if extra else ''}"
            summary = xmig_summary(work, name, fault_steps, [*extra, "--inject", spec], SLOW,
                                   env=envs[version])  # fmt: skip
            identical = summary["final_params_sha256"] == reference["final_params_sha256"]
            record = summary["recoveries"][0] if summary["recoveries"] else None
            every_recovery[version].append((spec, summary, record, identical))
            total = f"{record['total_s']:.2f} s" if record else summary["message"]
            print(f"[{version}] {spec}: {total}, bit-identical {identical}", flush=True)
    overhead = {name: median_run(results) for name, results in every_overhead["after"].items()}
    recoveries = every_recovery["after"]
    comparison = []
    if args.baseline:
        comparison = compare_versions(every_overhead, every_recovery, references, args.baseline)

    ratios = [r["paired_ratio_median"] for r in overhead.values()]
    goal = ", ".join(f"{'met' if r <= 1.01 else 'not met'} ({r:.4f}, {n})"
                     for n, r in zip(overhead, ratios, strict=True))  # fmt: skip
    steady_lines = [
        "## Steady state: plain DDP vs DDP through the proxy",
        "",
        "Both in the same two processes, over the same gloo transport: one DDP over a plain "
        "gloo group, one over xmig's process group driven by `session.steps()` (step boundary "
        "included), steps alternating ABBA so the drift of this shared machine hits both "
        f"alike (`bench/proxy_overhead.py`). Medians over steps {WARMUP_STEPS} and later; the "
        "ratio is the median of the per-pair ratios, with its interquartile range"
        + (f"; of {args.repeat} runs, the one with the median ratio" if args.repeat > 1 else "")
        + ".",
        "",
        "| model | parameters | plain DDP (ms) | through xmig (ms) | ratio | IQR |",
        "|---|---|---|---|---|---|",
        *[
            f"| {name} | {r['parameters'] / 1e6:.2f} M | {r['median_ms']['plain']:.1f} | "
            f"{r['median_ms']['xmig']:.1f} | **{r['paired_ratio_median']:.4f}** | "
            f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} |"
            for name, r in overhead.items()
        ],  # fmt: skip
        "",
        f"Goal ≤ 1.01: {goal}.",
        "",
        "What the proxy costs: the replay log copies each collective's input before launch; "
        "measured inside the runs, per step: "
        + "; ".join(
            f"{r['log_copy_ms_per_step']:.2f} ms for {r['log_copy_mb_per_step']:.1f} MB ({n})"
            for n, r in overhead.items()
        )  # fmt: skip
        + ". The rest (a future per op, the step boundary) is below what this shared 2-core "
        "machine resolves: the interquartile ranges of the pair ratios span several percent. "
        "`--no-replay-log` drops the copy (a fault is then rolled back instead of replayed).",
        "",
    ]
    lines = [
        "# Recovery on CPU: steady-state overhead and recovery time",
        "",
        f"Measured {started} with `{command}` (the demo GPT, `{' '.join(MODEL)}`, "
        f"{reference.get('world_size', 2)} ranks, gloo).",
        "",
        f"Machine: {machine()}.",
        "",
    ]
    if overhead:
        lines += steady_lines
    lines += [
        f"## Recovery: SIGKILL of rank 1 at step {FAULT_STEP}",
        "",
        "Seconds from the fault to the survivor's parked collective completing, by phase "
        "(detect: fault → agent notices; park: decision → survivors parked; respawn: decision "
        "→ replacement connected; rebuild: new communicator; pull: state to the replacement, "
        "including waiting for it to reach its step loop; replay: survivors re-issuing the step).",
        "",
        f"The job runs with `{' '.join(SLOW)}` in the script (no effect on any number) so that "
        "the node's hot spare is warm before the fault; the cold rows use `--hot-spares 0`.",
        "",
        "| fault | replacement | mode | total | detect | park | respawn | rebuild | pull | "
        "replay | pulled | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, summary, record, identical in recoveries:
        if record is None:
            lines.append(f"| `{spec}` | | not recovered: {summary['message']} |||||||||")
            continue
        p = record["phases"]
        origin = "hot spare" if all(record.get("from_spare") or [False]) else "cold start"
        lines.append(
            f"| `{spec}` | {origin} | {record['mode']} | {record['total_s']:.2f} | "
            f"{p['detect']:.3f} | {p['park']:.3f} | {p['respawn']:.2f} | {p['rebuild']:.2f} | "
            f"{p['pull']:.2f} | {p['replay']:.3f} | {record['pull_bytes'] / 1e6:.1f} MB | "
            f"{'yes' if identical else 'NO'} |"
        )
    spare = [r for _, _, r, _ in recoveries if r and all(r.get("from_spare") or [False])]
    cold = [r for _, _, r, _ in recoveries if r and not any(r.get("from_spare") or [False])]
    if spare and cold:
        spare_s = statistics.median(r["total_s"] for r in spare)
        cold_s = statistics.median(r["total_s"] for r in cold)
        lines += ["", f"Median total: {spare_s:.2f} s from a hot spare, {cold_s:.2f} s from a "
                  f"cold start ({cold_s / spare_s:.1f}x)."]  # fmt: skip
    lines += [
        "",
        "Where the time goes: from a cold start, `respawn` is mostly `import torch`, and the "
        "`pull` phase is mostly the replacement building its model and optimizer (the first "
        "`torch.optim` optimizer imports torch's compiler stack, about a second here) before "
        "it asks for the state; the transfer itself takes milliseconds. A hot spare has both "
        "done before the fault. `replay` at forward/backward is the survivor waiting while "
        "the replacement recomputes the step up to the parked collective.",
        "",
    ]
    write_report(args.out, [*lines, *comparison])
    return 0


def layout_run(work: Path, name: str, layout: str, flags: list[str]) -> dict:
    """One 4-rank run of ``layout`` with ``flags``; its summary."""
    script, script_flags = LAYOUTS[layout]
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", str(LAYOUT_RANKS),
           "--summary", str(summary), *flags, str(script), *script_flags,
           "--steps", str(16), *SLOW]  # fmt: skip
    bounded(cmd, work / f"{name}.log")
    if not summary.exists():
        raise RuntimeError(f"{name}: no summary; see {work / (name + '.log')}")
    return json.loads(summary.read_text())


def layout_report(layouts: list[str], repeat: int) -> list[str]:
    """Recovery per parallel layout: each layout's fault-free run, then a SIGKILL of rank 1
    at each point of a step (hot spare) and mid-backward from a cold start, ``repeat`` times;
    every recovery compared bit for bit with the fault-free run."""
    command = "python bench/recovery_cpu.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="xmig-layouts-"))
    cases = [(point, []) for point in POINTS] + [("backward", ["--hot-spares", "0"])]
    lines = [
        "# Recovery per parallel layout (CPU)",
        "",
        f"Measured {started} with `{command}`: {LAYOUT_RANKS} ranks (gloo); machine: {machine()}.",
        "",
        "Layouts: `ddp`, `hsdp` (2 × 2) and `tp-dp` (2 × 2) are the demo GPT "
        f"(`{' '.join(MODEL)}`, `--parallel …`); `ddp-subgroup` is `tests/scripts/groups.py` "
        "(DDP over the dp groups of a (stage, dp) mesh, with world and stage-group ops in every "
        f"step). Every run has `{' '.join(SLOW)}` in the script (no effect on any number) so "
        "that the node's hot spare is warm before the fault; `cold` is `--hot-spares 0`. "
        f"Fault: SIGKILL of rank 1 at step {FAULT_STEP}. Seconds, median of {repeat} run(s) "
        "with the range; phases are medians.",
        "",
        "| layout | fault | replacement | total (s) | park | respawn | rebuild | pull | replay "
        "| pulled | verified | bit-identical | groups rebuilt / kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in layouts:
        reference = layout_run(work, f"{layout}-reference", layout, [])
        expected = reference["final_params_sha256"]
        for point, extra in cases:
            spec = f"kill:rank=1:step={FAULT_STEP}:at={point}"
            records, identical, failed = [], [], []
            for i in range(repeat):
                name = f"{layout}-{point}{'-cold' if extra else ''}-{i}"
                summary = layout_run(work, name, layout, [*extra, "--inject", spec])
                identical.append(summary["final_params_sha256"] == expected)
                if summary["recoveries"]:
                    records.append(summary["recoveries"][0])
                else:
                    failed.append(summary["message"])
                print(f"{layout} {spec}{' cold' if extra else ''} #{i}: "
                      f"{summary['message'][:110]}", flush=True)  # fmt: skip
            origin = "cold" if extra else "hot spare"
            if failed:
                lines.append(f"| {layout} | `{point}` | {origin} | not recovered: {failed[0]} "
                             "|||||||||")  # fmt: skip
                continue
            totals = [r["total_s"] for r in records]

            def phase(name: str, found: list[dict] = records) -> str:
                return f"{statistics.median(r['phases'][name] for r in found):.3f}"

            groups = records[0]["groups"]
            verified = ", ".join(sorted({str(r["verified"]) for r in records}))
            pulled = statistics.median(r["pull_bytes"] for r in records) / 1e6
            lines.append(
                f"| {layout} | `{point}` | {origin} | {spread(totals, 2)} | {phase('park')} | "
                f"{phase('respawn')} | {phase('rebuild')} | {phase('pull')} | {phase('replay')} "
                f"| {pulled:.1f} MB | {verified} | {sum(identical)}/{len(identical)} | "
                f"{len(groups['rebuilt'])} / {len(groups['kept'])} |"
            )
    lines += [
        "",
        "Phases as in `recovery-cpu.md`. The hot spare's rows are the ones to compare across "
        "layouts: a cold start is mostly `import torch` and building the model on a 2-core "
        f"machine that runs {LAYOUT_RANKS} ranks. `groups rebuilt / kept`: the groups that "
        "hold rank 1 get new communicators, the others go on untouched.",
        "",
    ]
    return lines


def median_run(results: list[dict]) -> dict:
    """Of several paired runs, the one with the median ratio."""
    ordered = sorted(results, key=lambda r: r["paired_ratio_median"])
    return ordered[(len(ordered) - 1) // 2]


def spread(values: list[float], digits: int) -> str:
    """The median of ``values``, with their range when there are several."""
    middle = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return middle
    return f"{middle} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def describe_source(src: Path) -> str:
    """``src`` and, when it is in a git checkout, that checkout's commit."""
    found = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    commit = found.stdout.strip()
    return f"`{src}` (commit {commit})" if found.returncode == 0 and commit else f"`{src}`"


def compare_versions(overhead: dict, recoveries: dict, references: dict, baseline: Path) -> list:
    """The before/after section: the same measurements of both versions, in one run; with
    repeats, medians of each version's runs and their range."""
    same = references["before"]["final_params_sha256"] == references["after"]["final_params_sha256"]
    lines = [
        "## Before and after, in the same run",
        "",
        f"Before: the xmig in {describe_source(baseline)}; after: this checkout. Every "
        "measurement ran for both, their order alternating from one measurement to the next. "
        f"The fault-free runs of both end with {'the same' if same else 'DIFFERENT'} "
        "parameters. With several runs of a measurement: the median and, in brackets, the "
        "range.",
        "",
        "| measurement | runs | before | after | after / before |",
        "|---|---|---|---|---|",
    ]
    for name, after_runs in overhead["after"].items():
        b = [r["paired_ratio_median"] for r in overhead["before"][name]]
        a = [r["paired_ratio_median"] for r in after_runs]
        lines.append(f"| steady state, {name} (paired ratio to plain DDP) | {len(a)} | "
                     f"{spread(b, 4)} | {spread(a, 4)} | "
                     f"{statistics.median(a) / statistics.median(b):.4f} |")  # fmt: skip
    by_case: dict[tuple[str, str], dict[str, list]] = {}
    for version in ("before", "after"):
        for spec, _, record, identical in recoveries[version]:
            origin = "cold start"
            if record is not None and all(record.get("from_spare") or [False]):
                origin = "hot spare"
            case = by_case.setdefault((spec, origin), {"before": [], "after": []})
            case[version].append((record, identical))
    ratios = []
    for (spec, origin), case in by_case.items():
        totals = {v: [r["total_s"] for r, _ in case[v] if r is not None] for v in case}
        parks = {v: [r["phases"]["park"] * 1000 for r, _ in case[v] if r is not None]
                 for v in case}  # fmt: skip
        identical = {v: all(ok for _, ok in case[v]) for v in case}
        if len(totals["before"]) < len(case["before"]) or len(totals["after"]) < len(case["after"]):
            lines.append(f"| recovery `{spec}`, {origin} | | not every run recovered | | |")
            continue
        if not totals["before"] or not totals["after"]:
            continue  # the versions chose differently between hot spare and cold start
        ratio = statistics.median(totals["after"]) / statistics.median(totals["before"])
        ratios.append(ratio)
        lines.append(
            f"| recovery `{spec}`, {origin} (s; bit-identical "
            f"{identical['before']}/{identical['after']}) | "
            f"{len(totals['before'])}/{len(totals['after'])} | {spread(totals['before'], 2)} | "
            f"{spread(totals['after'], 2)} | {ratio:.3f} |"
        )
        lines.append(f"| of it, park (ms) | | {spread(parks['before'], 1)} | "
                     f"{spread(parks['after'], 1)} | |")  # fmt: skip
    if ratios:
        lines += [
            "",
            f"Recovery time after / before: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} kinds of fault.",
            "",
        ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
