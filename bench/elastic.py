"""What changing the world size costs: xmig's resize at a step boundary, its shrink when a
lost node has no spare, and its grow back, against a full restart of the job at the new size,
paired in one run (ABBA).

- ``resize``: a job of ``--world`` ranks with ``--inject resize:world=N:step=S``; the time is
  the resize record's downtime (from the pause boundary to every rank of the new world
  resumed) and its total (from the order to the end, the job training on to the pause step
  included).
- ``shrink``: the same job with ``--on-no-spare shrink`` and its last node lost
  (``--inject node:rank=W-1:step=S:at=backward``); the time is the resize record's downtime,
  from the fault to every rank of the new world resumed (the survivors park, roll the step
  back, pause at its start and resize). Each shrink's final parameters are compared with the
  planned resize's at the same step: they must be the same, bit for bit.
- ``grow``: the job resized to N at step S and back to ``--world`` ranks at step S+4; the
  time is the grow's downtime, from the pause boundary to every rank resumed. The new rank's
  process starts on the idle node (``--hot-spares 0``) as the grow is ordered, two steps
  before its pause (so its start overlaps those steps' training), joins, makes the new world
  with the others and pulls the state from one of them. ``grow-spare``: the same with a hot spare on
  every node (``--hot-spares 1``, xmig's default), which the new rank starts from. Both
  jobs idle ``--spare-warmup-s`` after the shrink, outside what is timed, so that the idle
  node's spare is warm (on 2 cores a spare warms up only once the workers are up).
- ``restart``: what a job without resizing does instead: a new job of N ranks is launched;
  the time is from the launch to the start of its first step on its slowest rank (process
  start, imports, the process group, the model and DDP). Loading a checkpoint, which a real
  restart also needs, is not counted: the baseline is a lower bound. ``restart-full``: the
  same at ``--world`` ranks, the baseline of a grow.

The model is an MLP (``--hidden``, ``--layers``) trained on ``session.shards`` (gloo on a CPU
machine, NCCL on a GPU one), one rank per node (``--nnodes W --nproc-per-node 1``). On a
machine with fewer GPUs than ranks, ``--simulate-hosts`` (root) lets ranks share a GPU: each
node is a host of its own to NCCL (its speed then is not a real link's).

    python bench/elastic.py --world 3 --to 2 --rounds 2 --out /tmp/elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import argparse, json, os, time
    import torch
    from torch.nn.parallel import DistributedDataParallel
    import xmig

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--marks")
    parser.add_argument("--idle-at", type=int, default=-1)
    parser.add_argument("--idle-s", type=float, default=0.0)
    args = parser.parse_args()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            return torch.randn(args.hidden), int(i % 8)

    session = xmig.init(seed=0)
    torch.manual_seed(0)  # the same model every run: a shrink's result is checked below
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 8)).to(session.device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    session.register(model=ddp, optimizer=optimizer)
    data = session.shards(Data(), batch=48)
    for step in session.steps(args.steps):
        if step == 0 and args.marks:
            with open(os.path.join(args.marks, f"rank{session.rank}"), "w") as out:
                out.write(str(time.time()))
        if step == args.idle_at:  # (a pause before the measured part: hot spares warm up)
            time.sleep(args.idle_s)
        x, y = (t.to(session.device) for t in next(data))
        loss = torch.nn.functional.cross_entropy(ddp(x), y) * data.weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
""")
FAST = ["--hot-spares", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "5"]


HOSTS: list[str] = []  # ["--simulate-hosts"]: NCCL then takes each node for a host


def xmig_run(folder: Path, world: int, extra: list[str], script_args: list[str]) -> dict:
    summary = folder / "summary.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--summary", str(summary), "--nnodes",
           str(world), "--nproc-per-node", "1", *FAST, *HOSTS, *extra, str(folder / "job.py"),
           *script_args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=folder)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(summary.read_text())


def resize_once(folder: Path, args: argparse.Namespace) -> dict:
    inject = ["--inject", f"resize:world={args.to}:step={args.step}"]
    summary = xmig_run(folder, args.world, inject, script_args(args, args.step + 3))
    (record,) = summary["resizes"]
    return {"downtime_s": record["downtime_s"], "total_s": record["total_s"],
            "phases": record["phases"], "sha256": summary["final_params_sha256"]}  # fmt: skip


def shrink_once(folder: Path, args: argparse.Namespace) -> dict:
    if args.to != args.world - 1:
        raise SystemExit("a shrink loses one node: --to must be --world - 1")
    inject = ["--on-no-spare", "shrink", "--inject",
              f"node:rank={args.world - 1}:step={args.step}:at=backward"]  # fmt: skip
    summary = xmig_run(folder, args.world, inject, script_args(args, args.step + 3))
    (record,) = summary["resizes"]
    return {"downtime_s": record["downtime_s"], "total_s": record["total_s"],
            "phases": record["phases"], "step": record["step"], "pulled": record["pulled"],
            "sha256": summary["final_params_sha256"]}  # fmt: skip


def grow_once(folder: Path, args: argparse.Namespace, spares: int = 0) -> dict:
    back = args.step + 4  # its pause is sent two steps ahead: after the idle step
    inject = ["--hot-spares", str(spares), "--inject", f"resize:world={args.to}:step={args.step}",
              "--inject", f"resize:world={args.world}:step={back}"]  # fmt: skip
    # the job idles a few seconds after the shrink, as a job whose node has been idle a
    # while: a hot spare there is warm by then
    idle = ["--idle-at", str(args.step + 1), "--idle-s", str(args.spare_warmup_s)]
    summary = xmig_run(folder, args.world, inject, [*script_args(args, back + 3), *idle])
    _, record = summary["resizes"]
    if record["step"] != back or record["new_world"] != args.world:
        raise RuntimeError(f"the grow did not happen as asked: {record}")
    return {"downtime_s": record["downtime_s"], "total_s": record["total_s"],
            "phases": record["phases"], "replicas_equal": record.get("replicas_equal"),
            "from_spare": record.get("from_spare"),
            "sha256": summary["final_params_sha256"]}  # fmt: skip


def restart_once(folder: Path, args: argparse.Namespace, world: int | None = None) -> dict:
    marks = folder / "marks"
    marks.mkdir(exist_ok=True)
    for old in marks.iterdir():
        old.unlink()
    launched = time.time()
    xmig_run(folder, world or args.to, [], [*script_args(args, 2), "--marks", str(marks)])
    first = max(float(p.read_text()) for p in marks.iterdir())
    return {"downtime_s": round(first - launched, 4)}


def script_args(args: argparse.Namespace, steps: int) -> list[str]:
    return ["--steps", str(steps), "--hidden", str(args.hidden), "--layers", str(args.layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--to", type=int, default=2)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    parser.add_argument("--kinds", nargs="+", default=None,
                        help="run only these kinds of run")  # fmt: skip
    parser.add_argument(
        "--spare-warmup-s",
        type=float,
        default=8.0,
        help="how long a grow's job idles after its shrink (hot spares warm)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--simulate-hosts", action="store_true",
                        help="each node a simulated host (root): on a GPU machine with fewer "
                        "GPUs than ranks, NCCL then takes ranks that share a GPU for ranks of "
                        "different hosts")  # fmt: skip
    args = parser.parse_args()
    if args.simulate_hosts:
        HOSTS.append("--simulate-hosts")
    runs = {
        "resize": resize_once,
        "shrink": shrink_once,
        "grow": grow_once,
        "grow-spare": lambda folder, args: grow_once(folder, args, spares=1),
        "restart": restart_once,
        "restart-full": lambda folder, args: restart_once(folder, args, world=args.world),
    }
    order = [k for k in runs if args.kinds is None or k in args.kinds]
    results: dict[str, list[dict]] = {kind: [] for kind in order}
    with tempfile.TemporaryDirectory(prefix="xmig-elastic-") as tmp:
        folder = Path(tmp)
        (folder / "job.py").write_text(SCRIPT)
        os.environ.setdefault("XMIG_JOBS_DIR", str(folder / "jobs"))
        for _ in range(args.rounds):
            for kind in [*order, *reversed(order)]:
                result = runs[kind](folder, args)
                results[kind].append(result)
                print(f"{kind}: {result}", flush=True)
    times = {kind: [r["downtime_s"] for r in found] for kind, found in results.items()}

    def ratios(ours: str, baseline: str) -> dict[str, float] | None:
        if ours not in times or baseline not in times:
            return None
        paired = sorted(b / a for a, b in zip(times[ours], times[baseline], strict=True))
        return {"median": statistics.median(paired), "min": paired[0], "max": paired[-1]}

    # a shrink at the planned resize's step must end with its parameters, bit for bit
    planned = {r["sha256"] for r in results.get("resize", [])}
    identical = [r["sha256"] in planned for r in results.get("shrink", [])
                 if r["step"] == args.step]  # fmt: skip
    grows = results.get("grow", []) + results.get("grow-spare", [])
    report = {
        "world": args.world, "to": args.to, "step": args.step,
        "params": args.layers * (args.hidden * args.hidden + args.hidden) + args.hidden * 8 + 8,
        "downtime_s": times,
        "median_s": {kind: statistics.median(found) for kind, found in times.items()},
        "restart_over_resize": ratios("resize", "restart"),
        "restart_over_shrink": ratios("shrink", "restart"),
        "restart_full_over_grow": ratios("grow", "restart-full"),
        "restart_full_over_grow_spare": ratios("grow-spare", "restart-full"),
        "planned_resize_deterministic": len(planned) <= 1,
        "shrinks_bit_identical_to_planned": f"{sum(identical)}/{len(identical)}",
        "grows_deterministic": len({r["sha256"] for r in grows}) <= 1,
        "grows_replicas_equal": all(r["replicas_equal"] is True for r in grows),
        "raw": results,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
