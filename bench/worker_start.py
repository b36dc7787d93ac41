"""Workers forked from the node's zygote against fresh interpreters, paired (ABBA).

    python bench/worker_start.py [--rounds 2] [--gpu] [--out FILE.md]

Each run is ``xmig run --hot-spares 0 --inject kill:rank=1:step=5:at=backward
examples/train_gpt.py --preset small --steps 10`` on 2 ranks (``--gpu``: 2 simulated hosts,
root, both ranks on GPU 0 over NCCL; else 2 CPU ranks over gloo), with the zygote
(``XMIG_ZYGOTE=1``, the default) and without (``0``) in the order A B B A per round. Per run:
seconds from the launch to the first step on every rank, the recovery of the killed rank
(its phases: the replacement's start is ``respawn``; ``pull`` and ``replay`` include the
replacement building its model and DDP), the launcher's whole run, and the final
parameters, which must be the same in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from baselines import step_events, time_to_step  # noqa: E402
from recovery_cpu import DEMO, bounded, machine, write_report  # noqa: E402

RUN_TIMEOUT_S = 180.0
FAULT = "kill:rank=1:step=5:at=backward"
STEPS = 10
KINDS = {"1": "forked (zygote)", "0": "fresh interpreters"}


def one_run(work: Path, name: str, zygote: str, gpu: bool) -> dict:
    summary, events = work / f"{name}.json", work / f"{name}.events"
    layout = (["--simulate-hosts", "--nnodes", "2", "--nproc-per-node", "1"] if gpu
              else ["--nproc-per-node", "2"])  # fmt: skip
    cmd = [sys.executable, "-m", "xmig", "run", *layout, "--hot-spares", "0",
           "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--inject", FAULT,
           "--summary", str(summary), str(DEMO), "--preset", "small", "--steps", str(STEPS),
           "--quiet", "--events-file", str(events)]  # fmt: skip
    env = {**os.environ, "XMIG_ZYGOTE": zygote}
    started = time.time()
    code = bounded(cmd, work / f"{name}.log", RUN_TIMEOUT_S, env=env)
    elapsed = time.time() - started
    if code != 0:
        tail = (work / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"run {name} failed with exit code {code}:\n" + "\n".join(tail))
    result = json.loads(summary.read_text())
    steps, _ = step_events(events)
    record = result["recoveries"][0]
    return {
        "name": name,
        "zygote": zygote,
        "first_step": time_to_step(steps, started, 0, 2),
        "recovery": record["total_s"],
        "phases": record["phases"],
        "run": elapsed,
        "sha": result["final_params_sha256"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="ranks on GPU 0 (root: simulated hosts)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="xmig-worker-start-") as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for i, zygote in enumerate(("1", "0", "0", "1")):
                run = one_run(work, f"r{r}-{i}-z{zygote}", zygote, args.gpu)
                runs.append(run)
                print(json.dumps(run), flush=True)
    shas = {run["sha"] for run in runs}
    lines = [
        "# Workers forked from the zygote against fresh interpreters",
        "",
        f"Command: `python bench/worker_start.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {machine()}",
        "",
        "| run | workers | first step (s) | recovery (s) | respawn | pull | replay | run (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        p = run["phases"]
        first = f"{run['first_step']:.2f}" if run["first_step"] is not None else "?"
        lines.append(f"| {run['name']} | {KINDS[run['zygote']]} | {first} | "
                     f"{run['recovery']:.2f} | {p.get('respawn', 0):.3f} | "
                     f"{p.get('pull', 0):.3f} | {p.get('replay', 0):.3f} | "
                     f"{run['run']:.2f} |")  # fmt: skip
    lines.append("")
    for zygote, kind in KINDS.items():
        mine = [run for run in runs if run["zygote"] == zygote]
        for key in ("first_step", "recovery", "run"):
            values = [run[key] for run in mine if run[key] is not None]
            if values:
                lines.append(f"- {kind}, {key.replace('_', ' ')}: median "
                             f"{statistics.median(values):.2f} s "
                             f"({min(values):.2f}–{max(values):.2f})")  # fmt: skip
    pairs = []
    for a, b in zip(runs[0::2], runs[1::2], strict=True):
        forked, fresh = (a, b) if a["zygote"] == "1" else (b, a)
        pairs.append(fresh["recovery"] / forked["recovery"])
    lines.append(f"- recovery, fresh / forked in each adjacent pair: "
                 f"{', '.join(f'{x:.2f}' for x in pairs)}")  # fmt: skip
    same = "the same in every run" if len(shas) == 1 else f"DIFFERENT: {sorted(shas)}"
    lines.append(f"- final parameters: {same} (`{next(iter(shas))[:16]}…`)")
    text = "\n".join(lines) + "\n"
    if args.out:
        write_report(args.out, lines)
    print(text)
    return 0 if len(shas) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
