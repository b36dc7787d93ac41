"""Recovery time per parallel layout on CPU (gloo, 4 ranks): DDP over the dp groups of a
(stage, dp) mesh, HSDP (FSDP2 on a (replicate, shard) mesh), TP x DP. For each: one fault-free
run, then ``--repeat`` kills of rank 1 mid-backward; every recovery must end bit-identical to
the fault-free run. Writes bench/results/recovery-layouts.md (``--out``)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from recovery_cpu import bounded

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
LAYOUTS = {
    "ddp over a sub-group": (SCRIPTS / "groups.py", ["--groups", "mesh"]),
    "hsdp": (SCRIPTS / "fsdp.py", ["--layout", "hsdp"]),
    "tp-dp": (SCRIPTS / "fsdp.py", ["--layout", "tp-dp"]),
}
FAULT = "kill:rank=1:step=3:at=backward"
RUN_TIMEOUT_S = 240.0


def run(work: Path, name: str, script: Path, script_flags: list[str], flags: list[str]) -> dict:
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", "4", "--summary",
           str(summary), *flags, str(script), *script_flags]  # fmt: skip
    # overrun, the launcher's process group and everything descended from it are killed
    bounded(cmd, work / f"{name}.log", RUN_TIMEOUT_S)
    return json.loads(summary.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / "recovery-layouts.md")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hot-spares", type=int, default=1)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="xmig-layouts-"))
    flags = ["--hot-spares", str(args.hot_spares)]
    lines = [
        "# Recovery per parallel layout (CPU)",
        "",
        f"`python bench/recovery_layouts.py {' '.join(sys.argv[1:])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.node()}, "
        f"{platform.processor() or platform.machine()}, 4 ranks (gloo) on this machine's cores. "
        f"Fault: `{FAULT}` (the step takes a few ms: the times are xmig's own). Median of "
        f"{args.repeat} runs, with the range.",
        "",
        "| layout | recovery (s) | park | respawn | rebuild | pull | replay | verified | "
        "bit-identical | groups rebuilt / kept |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, (script, script_flags) in LAYOUTS.items():
        slug = layout.replace(" ", "-")
        reference = run(work, f"{slug}-reference", script, script_flags, flags)
        records, identical, verified = [], [], []
        for i in range(args.repeat):
            summary = run(work, f"{slug}-{i}", script, script_flags,
                          [*flags, "--inject", FAULT])  # fmt: skip
            identical.append(summary["final_params_sha256"] == reference["final_params_sha256"])
            if summary["recoveries"]:
                records.append(summary["recoveries"][0])
                verified.append(str(summary["recoveries"][0]["verified"]))
            print(f"{layout} {i}: {summary['message'][:100]}", flush=True)
        if not records:
            lines.append(f"| {layout} | not recovered | | | | | | | | |")
            continue
        totals = [r["total_s"] for r in records]

        def phase(name: str, found: list[dict] = records) -> str:
            return f"{statistics.median(r['phases'][name] for r in found):.3f}"

        groups = records[0]["groups"]
        lines.append(
            f"| {layout} | {statistics.median(totals):.2f} ({min(totals):.2f}–{max(totals):.2f}) "
            f"| {phase('park')} | {phase('respawn')} | {phase('rebuild')} | {phase('pull')} | "
            f"{phase('replay')} | {', '.join(sorted(set(verified)))} | "
            f"{sum(identical)}/{len(identical)} | {len(groups['rebuilt'])} / "
            f"{len(groups['kept'])} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
