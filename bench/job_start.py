"""A job's start and end against another version of xmig, paired (ABBA), on this machine.

    python bench/job_start.py --baseline DIR [--rounds 3] [--nproc 3] [--out FILE.md]

DIR holds another tree's ``src/`` (``git archive COMMIT src | tar -x -C DIR``). Each run is
``xmig run --nproc-per-node N examples/train_gpt.py --steps 7`` (the demo GPT, 0.3 s of
training on a CPU), alternately with that tree's and this one's ``src`` on ``PYTHONPATH``, in
the order A B B A per round. Per run: seconds from the launch to the first step's line (the
coordinator, the agent and the workers started, the communicators met) and to the
launcher's exit (the workers, the agent and the coordinator ended).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from recovery_cpu import machine, write_report  # noqa: E402

RUN_TIMEOUT_S = 120.0


def one_run(src: Path, nproc: int) -> tuple[float, float]:
    """(seconds to the first step's line, seconds to the launcher's exit)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", str(nproc),
           str(REPO / "examples" / "train_gpt.py"), "--steps", "7"]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO, start_new_session=True)  # fmt: skip
    first = None
    # a job that hangs silently is ended by this timer (its whole process group, by PID)
    watchdog = threading.Timer(RUN_TIMEOUT_S, os.killpg, (proc.pid, 9))
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if first is None and "step 0 loss" in line:
                first = time.monotonic() - started
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if code != 0 or first is None:
        raise RuntimeError(f"a run with {src} failed (exit {code})")
    return first, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a tree holding src/")
    parser.add_argument("--label", default="baseline", help="the baseline's name in the table")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = args.baseline.resolve() / "src"
    if not (base / "xmig").is_dir():
        parser.error(f"{base} holds no xmig package")
    trees = {args.label: base, "this tree": REPO / "src"}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name in [args.label, "this tree", "this tree", args.label]:
            runs[name].append(one_run(trees[name], args.nproc))
            print(name, [round(x, 2) for x in runs[name][-1]], flush=True)
    pairs = list(zip(runs[args.label], runs["this tree"], strict=True))

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s ({min(values):.2f} – {max(values):.2f})"

    lines = [
        f"## Job start and end: {args.label} against this tree",
        "",
        f"`python bench/job_start.py --baseline DIR --label {args.label} --rounds "
        f"{args.rounds} --nproc {args.nproc}` on {machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {len(pairs)} runs each, "
        "A B B A; medians with the range:",
        "",
        "| code | launch to first step | launch to exit |",
        "|---|---|---|",
    ]
    for name, values in runs.items():
        lines.append(f"| {name} | {spread([v[0] for v in values])} | "
                     f"{spread([v[1] for v in values])} |")  # fmt: skip
    lines += [
        f"| paired difference ({args.label} − this tree) | "
        f"{spread([a[0] - b[0] for a, b in pairs])} | {spread([a[1] - b[1] for a, b in pairs])} |",
        "",
    ]
    if args.out:
        write_report(args.out, lines, echo=True)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
