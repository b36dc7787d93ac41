"""A just-in-time checkpoint on one GPU, and goodput through communication errors.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/checkpoint_gpu.py [--out FILE.md]

One rank of the demo GPT (``--preset gpt350m --batch-size 8``, DDP over NCCL):

1. A communication error with ``--max-recoveries 0``: the rank is alive but the fault may not
   be recovered, so it writes its state (parameters and AdamW's state from the GPU) as a
   just-in-time checkpoint; the job is resumed from it, and both runs' final parameters are
   compared with the fault-free run's.
2. Goodput: the same run with a communication error every ``--every`` steps, each retried in
   place, against the fault-free run (a second GPU is needed for a kill: one rank alone has no
   peer to pull from).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_cpu import DEMO, bounded, machine, write_report

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--batch-size", "8"]
TIMEOUT_S = 500


PRESET = ["--preset", "gpt350m"]  # --preset: another (tiny: a check of this script on a CPU)


def xmig(
    work: Path, name: str, flags: list[str], steps: int, script_flags: list[str] | None = None
) -> tuple[dict, str, float]:
    summary = work / f"{name}.json"
    log = work / f"{name}.log"
    started = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "xmig",
        "run",
        "--nproc-per-node",
        "1",
        "--hot-spares",
        "0",
        "--summary",
        str(summary),
        *flags,
        str(DEMO),
        *PRESET,
        *MODEL,
        "--steps",
        str(steps),
        "--quiet",
        *(script_flags or []),
    ]
    bounded(cmd, log, TIMEOUT_S)  # overrun: its whole tree is killed
    seconds = time.monotonic() - started
    if not summary.exists():
        raise SystemExit(f"{name}: no summary; see {log}")
    return json.loads(summary.read_text()), log.read_text(), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "checkpoint-h200x1.md"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--goodput-steps", type=int, default=80)
    parser.add_argument("--preset", default="gpt350m")
    args = parser.parse_args()
    PRESET[1] = args.preset
    work = Path(tempfile.mkdtemp(prefix="xmig-ckpt-"))
    folder = work / "checkpoints"
    clean, _, clean_s = xmig(work, "clean", [], args.steps)
    fault = f"raise:rank=0:step={args.steps // 2}:at=backward"
    stopped, output, stopped_s = xmig(
        work,
        "stopped",
        ["--max-recoveries", "0", "--checkpoint-dir", str(folder), "--inject", fault],
        args.steps,
    )
    saved = stopped.get("jit_checkpoint") or {}
    line = [x for x in output.splitlines() if x.startswith("xmig: resume with: ")]
    resumed_line = "not resumed: no resume command"
    if line and saved.get("path"):
        command = shlex.split(line[-1].removeprefix("xmig: resume with: "))
        flags = command[2 : command.index(str(DEMO))]
        del flags[flags.index("--summary") : flags.index("--summary") + 2]
        resumed, _, resumed_s = xmig(work, "resumed", flags, args.steps)
        same = resumed["final_params_sha256"] == clean["final_params_sha256"]
        resumed_line = (
            f"resumed from it: {resumed['status']} in {resumed_s:.1f} s, final "
            f"parameters equal to the fault-free run's: **{same}**"
        )
    timing = ["--timing-file"]
    long_clean, _, long_clean_s = xmig(
        work, "goodput-clean", [], args.goodput_steps, [*timing, str(work / "clean-steps.json")]
    )
    faults = [
        f"raise:rank=0:step={s}:at=backward"
        for s in range(args.every, args.goodput_steps, args.every)
    ]
    injected = [x for f in faults for x in ("--inject", f)]
    long_faulty, _, long_faulty_s = xmig(
        work,
        "goodput-faulty",
        injected,
        args.goodput_steps,
        [*timing, str(work / "faulty-steps.json")],
    )
    # the steps' own time (a retry stalls the step it hits), not the start, which varies more
    clean_steps = sum(json.loads((work / "clean-steps.json").read_text())["step_times"][1:])
    faulty_steps = sum(json.loads((work / "faulty-steps.json").read_text())["step_times"][1:])
    retries = [r["total_s"] for r in long_faulty["recoveries"]]
    same_long = long_faulty["final_params_sha256"] == long_clean["final_params_sha256"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        "# Just-in-time checkpoint and goodput on one GPU",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with "
        f"`python bench/checkpoint_gpu.py {' '.join(sys.argv[1:])}` on {gpu}; {machine()}.",
        "",
        f"The demo GPT `{' '.join([*PRESET, *MODEL])}`, one rank, DDP over NCCL.",
        "",
        f"- Fault-free, {args.steps} steps: {clean_s:.1f} s (with the start).",
        f"- `{fault}` with `--max-recoveries 0`: {stopped['status']} (exit "
        f"{stopped['exit_code']}) in {stopped_s:.1f} s; just-in-time checkpoint of step "
        f"{saved.get('step')}: {saved.get('bytes', 0) / 2**30:.2f} GiB in "
        f"{saved.get('seconds', 0):.2f} s from the fault's decision to the sealed folder "
        f"({saved.get('shards')} shard(s)).",
        f"- {resumed_line}.",
        f"- Goodput, {args.goodput_steps} steps, a communication error every {args.every} steps "
        f"({len(faults)}), each retried in place: steps 1-{args.goodput_steps - 1} took "
        f"{clean_steps:.2f} s fault-free against {faulty_steps:.2f} s, goodput "
        f"**{100 * clean_steps / faulty_steps:.1f} %** (whole runs, start included: "
        f"{long_clean_s:.1f} s and {long_faulty_s:.1f} s); retries "
        f"{', '.join(f'{t:.2f}' for t in retries)} s; bit-identical: {same_long}.",
    ]
    write_report(args.out, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
