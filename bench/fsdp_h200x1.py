"""FSDP2 through xmig on one GPU (NCCL, one rank): determinism, a communication error retried
in place, and the steady-state cost against plain FSDP2, paired in one process (ABBA).

On a mesh of one rank FSDP2 issues no collective of its own; a script that logs its loss over
the world (``--log-loss``) issues one per step, and that op is where the error is injected.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/fsdp_h200x1.py --out bench/results/fsdp-h200x1.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_cpu import bounded

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "fsdp.py"
OVERHEAD = REPO / "bench" / "fsdp_overhead.py"
TIMEOUT_S = 400
FAULT = "raise:rank=0:step=4:at=collective=0"
STEADY = ["--width", "4096", "--depth", "8", "--batch", "16", "--steps", "64", "--warmup", "8"]
# --quick: a check of this script itself, e.g. on a CPU (the numbers mean nothing)
QUICK = ["--width", "256", "--depth", "2", "--batch", "4", "--steps", "8", "--warmup", "2"]


def xmig(work: Path, name: str, args: list[str]) -> dict:
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", "1", "--hot-spares", "0",
           "--summary", str(summary), *args]  # fmt: skip
    bounded(cmd, work / f"{name}.log", TIMEOUT_S)  # overrun: its whole tree is killed
    if not summary.exists():
        raise SystemExit(f"{name}: no summary; see {work / (name + '.log')}")
    return json.loads(summary.read_text())


def paired(work: Path, name: str, flags: list[str], script_flags: list[str]) -> dict:
    """Plain FSDP2 and FSDP2 through xmig in one process, steps alternating."""
    out = work / f"{name}.result.json"
    xmig(work, name, [*flags, str(OVERHEAD), *script_flags, "--out", str(out)])
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp-h200x1.md")
    parser.add_argument("--quick", action="store_true", help="a small model, a few steps")
    args = parser.parse_args()
    size = QUICK if args.quick else STEADY
    work = Path(tempfile.mkdtemp(prefix="xmig-fsdp-"))
    layout = [str(SCRIPT), "--layout", "fsdp", "--steps", "8"]
    first, second = xmig(work, "once", layout), xmig(work, "twice", layout)
    traced = work / "trace"
    xmig(work, "traced", ["--trace-dir", str(traced), *layout])
    ops = sum(1 for f in traced.glob("*.jsonl") for line in f.read_text().splitlines()
              if json.loads(line).get("kind") == "op")  # fmt: skip
    logged = [*layout, "--log-loss"]
    reference = xmig(work, "logged", logged)
    faulty = xmig(work, "raised", ["--inject", FAULT, *logged])
    record = faulty["recoveries"][0] if faulty["recoveries"] else None
    same = faulty["final_params_sha256"] == reference["final_params_sha256"]
    steady = [
        ("replay log on, 1", [], ["--log-loss"]),
        ("replay log on, 2", [], ["--log-loss"]),
        ("`--no-replay-log`", ["--no-replay-log"], ["--log-loss"]),
        ("no loss logged (no op through xmig)", [], []),
    ]
    rows = []
    for label, flags, script_flags in steady:
        result = paired(work, f"steady-{len(rows)}", flags, [*size, *script_flags])
        low, high = result["paired_ratio_iqr"]
        rows.append(
            f"| {label} | {result['median_ms']['plain']:.2f} | {result['median_ms']['xmig']:.2f} "
            f"| **{result['paired_ratio_median']:.4f}** | {low:.4f}–{high:.4f} |"
        )
        print(rows[-1], flush=True)
    params = result["parameters"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    if record is not None:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items() if v)
        retried = (f"{record['mode']} in {record['total_s']:.3f} s ({phases}); verified: "
                   f"{record['verified']}; final parameters equal to the fault-free run's: "
                   f"{same}")  # fmt: skip
    else:
        retried = f"not recovered: {faulty['message']}"
    ratios = [float(r.split("**")[1]) for r in rows[:2]]
    lines = [
        "# FSDP2 through xmig on one GPU",
        "",
        f"`{' '.join(['python', 'bench/fsdp_h200x1.py', *sys.argv[1:]])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {gpu}, torch "
        f"{torch.__version__}, Python {platform.python_version()}; one rank over "
        f"{'NCCL' if torch.cuda.is_available() else 'gloo'}.",
        "",
        f"- Determinism (`tests/scripts/fsdp.py --layout fsdp`, 8 steps, twice): "
        f"{first['status']} / {second['status']}, same final parameters: "
        f"{first['final_params_sha256'] == second['final_params_sha256']}.",
        f"- Collectives FSDP2 itself issues through xmig in those 8 steps: {ops} (a mesh of one "
        "rank communicates nothing).",
        f"- With the loss logged over the world each step (`--log-loss`, one all-reduce a "
        f"step), `{FAULT}` (an NCCL error surfacing in that op): {retried}.",
        "",
        "## Steady state against plain FSDP2",
        "",
        f"`xmig run --nproc-per-node 1 --hot-spares 0 [--no-replay-log] bench/fsdp_overhead.py "
        f"{' '.join(size)} [--log-loss]`: an MLP of {params / 1e6:.0f} M parameters, AdamW, "
        "FSDP2 on a mesh of the one rank, once over a plain NCCL group and once over xmig's, "
        "steps alternating ABBA in the same process, both synchronized; the paired ratio's "
        "median over the steps after the warm-up, with its interquartile range.",
        "",
        "| run | plain FSDP2 (ms) | through xmig (ms) | paired ratio | IQR |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Through xmig, FSDP2 on one GPU costs {statistics.mean(ratios):.4f} of plain FSDP2 "
        "with the replay log (two runs). With more than one rank FSDP2's all-gathers and "
        "reduce-scatters go through the proxy too; that needs 2 GPUs "
        "(`bench/results/fsdp-cpu.md` has it on CPU).",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
