"""The proxy's steady-state cost on one GPU with the GPU gate and without it, in one session.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python bench/gpu_gate_steady.py --rounds 1 --steps 40 --out FILE.md

Each run is ``bench/proxy_overhead.py`` under ``xmig run`` (one rank, DDP over NCCL, the
replay log on): plain DDP and DDP through xmig in the same process, steps alternating. Runs
alternate between the gate (``--gpu-gate``), ``--no-gpu-gate`` (the future completed on
the host once the GPU is done, xmig's default) and, if asked, the gate without
the replay log, in the order A B … B A per round. Ratio: the median of the per-step
xmig/plain ratios after the warm-up, with its quartiles.
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

import torch
from recovery_cpu import OVERHEAD, WARMUP_STEPS, bounded, machine, write_report

MODEL = ["--preset", "gpt350m", "--batch-size", "8"]
# "nolog": the gate without the replay log, what the log's copies cost (not a mode to run:
# without the log a fault in a collective cannot be replayed). "host-eager": the default with
# every CUDA module loaded at start (what gated workers get), to tell its cost from the gate's
VARIANTS = {
    "gate": ["--gpu-gate"],
    "host": ["--no-gpu-gate"],
    "nolog": ["--gpu-gate", "--no-replay-log"],
    "host-eager": ["--no-gpu-gate"],
}
ENVIRONMENTS = {"host-eager": {"CUDA_MODULE_LOADING": "EAGER"}}


def one_run(work: Path, name: str, variant: str, steps: int, timeout: float,
            profile: bool = False) -> dict:  # fmt: skip
    out = work / f"{name}.json"
    extra = ["--profile-boundary", str(work / f"{name}.boundary.txt")] if profile else []
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", "1", "--hot-spares", "0",
           *VARIANTS[variant], str(OVERHEAD), "--steps", str(steps), "--warmup",
           str(WARMUP_STEPS), "--out", str(out), "--phases", "--stacks-after",
           str(timeout - 20), *extra, *MODEL]  # fmt: skip
    env = {**os.environ, **ENVIRONMENTS.get(variant, {})}
    code = bounded(cmd, work / f"{name}.log", timeout=timeout, env=env)
    if code != 0:
        raise RuntimeError(f"run {name} failed with exit code {code}; see {work}")
    result = json.loads(out.read_text())
    times = result["step_times"]
    ratios = sorted(x / p for x, p in zip(times["xmig"][WARMUP_STEPS:],
                                          times["plain"][WARMUP_STEPS:], strict=True))  # fmt: skip
    result["ratio_q1"] = ratios[len(ratios) // 4]
    result["ratio_q3"] = ratios[(3 * len(ratios)) // 4]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of A B … B A")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["gate", "host"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--work", type=Path, help="where the runs' logs go (default: a temp dir)")
    parser.add_argument(
        "--profile-boundary",
        action="store_true",
        help="cProfile xmig's step boundaries: a file per run in --work",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this bench needs a GPU", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="xmig-gate-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows, by_variant = [], {name: [] for name in args.variants}
    order = [*args.variants, *reversed(args.variants)] * args.rounds
    for i, variant in enumerate(order):
        try:
            result = one_run(work, f"{i}-{variant}", variant, args.steps, args.run_timeout,
                             args.profile_boundary)  # fmt: skip
        except RuntimeError as exc:
            rows.append(f"| {i + 1} | {variant} | failed: {exc} | | | |")
            print(rows[-1], flush=True)
            continue
        ms = result["median_ms"]
        ratio = result["paired_ratio_median"]
        by_variant[variant].append(ratio)
        spread = f"{result['ratio_q1']:.4f} – {result['ratio_q3']:.4f}"
        rows.append(f"| {i + 1} | {variant} | {ms['plain']:.1f} | {ms['xmig']:.1f} | "
                    f"**{ratio:.4f}** | {spread} |")  # fmt: skip
        print(
            rows[-1],
            json.dumps({k: result[k] for k in ("boundary_ms", "phases", "issue_ms_per_step")}),
            flush=True,
        )
    lines = [
        "## Steady state: the GPU gate against completion on the host (one session, ABBA)",
        "",
        f"Measured {started} with `python bench/gpu_gate_steady.py --rounds {args.rounds} "
        f"--steps {args.steps} --variants {' '.join(args.variants)}` on "
        f"{torch.cuda.get_device_name(0)} ({machine()}; NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))}): `{' '.join(MODEL)}`, one rank, "
        "DDP over NCCL, the replay log on (but in nolog); per run, plain DDP and DDP "
        "through xmig in one process, steps alternating.",
        "",
        "| run | completion | plain ms/step | xmig ms/step | ratio | q1 – q3 |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Median ratio by completion: "
        + ", ".join(
            f"{name} {statistics.median(values):.4f} (runs: "
            f"{', '.join(f'{v:.4f}' for v in values)})"
            for name, values in by_variant.items()
            if values
        )
        + ".",  # fmt: skip
        "",
    ]
    write_report(args.out, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
