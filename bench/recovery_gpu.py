"""GPU benchmark on 2 (or more) GPUs: the proxy's steady-state cost and recovery over NCCL.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python bench/recovery_gpu.py --out bench/results/gpu-h200x2.md
    … python bench/recovery_gpu.py --nproc 4 --kill-rank 2 --error-rank 1 \\
        --out bench/results/gpu-h200x4.md

The demo GPT at ~350 M parameters, DDP, one rank per GPU: plain DDP vs DDP through xmig
(paired ABBA steps in the same processes), a SIGKILL of one rank mid-backward recovered from a
hot spare and from a cold start, an injected communication error on one rank (no respawn),
each compared bit for bit with the fault-free run, with the survivors' PIDs checked; and the
baseline in the same run: torchrun restarting every worker and reloading a checkpoint from
local disk, for the same kill.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from baselines import step_events, time_to_step, torchrun_restart
from gpu_h200x1 import MODEL
from recovery_cpu import machine, paired, write_report, xmig_summary

STEPS = 14
FAULT_STEP = 10
# slow steps (a sleep changes no number) let the hot spare finish its ~10 s warm-up first
SLOW = ["--step-sleep", "1.5"]
# the baseline's best case: its last checkpoint was written just before the faulty step
CHECKPOINT_EVERY = 5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, one per GPU")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--error-rank", type=int, default=1)
    args = parser.parse_args()
    nproc, kill, error = args.nproc, args.kill_rank, args.error_rank
    if nproc < 2 or nproc > torch.cuda.device_count():
        print(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} GPUs",
              file=sys.stderr)  # fmt: skip
        return 2
    if not (0 <= kill < nproc and 0 <= error < nproc):
        print(f"--kill-rank/--error-rank must be ranks of 0..{nproc - 1}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="xmig-gpu2-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    def job(name: str, flags: list[str]) -> dict:
        events = work / f"{name}-events.jsonl"
        summary = xmig_summary(work, name, STEPS, flags, [*SLOW, "--events-file", str(events)],
                               model=MODEL, nproc=nproc)  # fmt: skip
        if summary["faults"]:
            records, _ = step_events(events)
            fault = summary["faults"][0]
            summary["kill_to_step_done_s"] = time_to_step(records, fault["t_fault"], FAULT_STEP,
                                                          nproc)  # fmt: skip
        return summary

    def survivors_kept(summary: dict, faulty: int) -> bool:
        pids = summary.get("worker_pids", {})
        return all(len(pids.get(str(r), [])) == 1 for r in range(nproc) if r != faulty)

    reference = job("reference", ["--hot-spares", "0"])
    spare_case = f"kill rank {kill} mid-backward, hot spare"
    error_case = f"communication error on rank {error} (no respawn)"
    cases = [
        (spare_case, kill, [f"kill:rank={kill}:step={FAULT_STEP}:at=backward"], []),
        (f"kill rank {kill} mid-backward, cold start", kill,
         [f"kill:rank={kill}:step={FAULT_STEP}:at=backward"], ["--hot-spares", "0"]),
        (error_case, error, [f"raise:rank={error}:step={FAULT_STEP}:at=backward"],
         ["--hot-spares", "0"]),
    ]  # fmt: skip
    results = []
    for name, faulty, faults, flags in cases:
        inject = [x for f in faults for x in ("--inject", f)]
        summary = job(name.split(",")[0].replace(" ", "-") + str(len(results)), [*flags, *inject])
        record = summary["recoveries"][0] if summary["recoveries"] else None
        same = summary["final_params_sha256"] == reference["final_params_sha256"]
        summary["survivors_kept_pids"] = survivors_kept(summary, faulty)
        results.append((name, summary, record, same))
        print(name, record["total_s"] if record else summary["message"], same, flush=True)
    baseline = torchrun_restart(work, "torchrun", MODEL, STEPS, (kill, FAULT_STEP),
                                CHECKPOINT_EVERY, SLOW, nproc=nproc)  # fmt: skip
    baseline_same = baseline["final_params_sha256"] == reference["final_params_sha256"]
    print("torchrun", baseline, baseline_same, flush=True)
    overhead = paired(work, "overhead", 30, MODEL, nproc=nproc)

    lines = [
        f"# Recovery on {nproc} × H200 (NCCL)",
        "",
        f"Measured {started} with `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
        f"NVSHMEM_DISABLE_NVLS=1 python bench/recovery_gpu.py {' '.join(sys.argv[1:])}` on the "
        f"device machine kind `nvidia-h200-x{torch.cuda.device_count()}` "
        f"({torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}; {machine()}; NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))}).",
        "",
        f"The demo GPT `{' '.join(MODEL)}` ({overhead['parameters'] / 1e6:.0f} M parameters), "
        "DDP, one rank per GPU, deterministic mode, "
        f"{STEPS} steps with `{' '.join(SLOW)}` in the script (so that a hot spare is warm "
        f"before the fault at step {FAULT_STEP}; it changes no number).",
        "",
        "## Steady state",
        "",
        "| plain DDP (ms/step) | through xmig (ms/step) | ratio (median of ABBA pairs) | IQR |",
        "|---|---|---|---|",
        f"| {overhead['median_ms']['plain']:.1f} | {overhead['median_ms']['xmig']:.1f} | "
        f"**{overhead['paired_ratio_median']:.4f}** | {overhead['ratio_q1']:.3f}-"
        f"{overhead['ratio_q3']:.3f} |",
        "",
        "## Recovery",
        "",
        "Seconds from the fault to the survivor's parked collective completing, by phase "
        "(park: the decision until every survivor has halted its ops and started its NCCL "
        "abort; pull: until the replacement has its state, including its script building the "
        "model; replay: the survivors re-issuing the step's ops while the replacement "
        "recomputes up to them). State pull: the tensors' bytes over their transfer time; "
        "setup: the pair communicator and the structure.",
        "",
        "| fault | mode | total | detect | park | respawn | rebuild | pull | "
        "replay | state pull | bit-identical | survivors' PIDs kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, summary, record, same in results:
        if record is None:
            lines.append(f"| {name} | not recovered: {summary['message']} ||||||||||")
            continue
        p = record["phases"]
        rate = record.get("pull_gb_per_s")
        pulled = (f"{record['pull_bytes'] / 1e9:.2f} GB at {rate:.1f} GB/s (setup "
                  f"{record.get('pull_setup_s', 0):.2f} s)" if rate else "-")  # fmt: skip
        lines.append(
            f"| {name} | {record['mode']} | **{record['total_s']:.2f}** | {p['detect']:.3f} | "
            f"{p['park']:.3f} | {p['respawn']:.2f} | {p['rebuild']:.2f} | {p['pull']:.2f} | "
            f"{p['replay']:.3f} | {pulled} | {'yes' if same else 'NO'} | "
            f"{'yes' if summary['survivors_kept_pids'] else 'NO'} |"
        )
    lines += [
        "",
        "## Against torchrun restart + checkpoint (same run, same kill)",
        "",
        f"Seconds from the kill of rank {kill} mid-backward in step {FAULT_STEP} until step "
        f"{FAULT_STEP} has finished on every rank (the rest of that step, "
        f"`{' '.join(SLOW)}` included, counts for both). The baseline runs the same script "
        f"with `--plain` under `torchrun --max-restarts 1 --monitor-interval 0.1`, saving model "
        f"and optimizer to local disk (`torch.save`, rank 0, then a barrier) after every "
        f"{CHECKPOINT_EVERY}th step and reloading on restart: its last checkpoint is the one "
        "just before the faulty step, its best case.",
        "",
        "| system | kill → step done (s) | finished steps redone | checkpoint save (s) | "
        "bit-identical |",
        "|---|---|---|---|---|",
    ]
    for name, summary, _record, same in results:
        if "kill" in name and summary.get("kill_to_step_done_s") is not None:
            lines.append(f"| xmig, {name.split(', ')[1]} | **{summary['kill_to_step_done_s']:.2f}**"
                         f" | 0 | - | {'yes' if same else 'NO'} |")  # fmt: skip
    done = baseline["kill_to_step_done_s"]
    save = baseline["checkpoint_save_s"]
    lines += [
        f"| torchrun restart + checkpoint | "
        f"{f'**{done:.2f}**' if done is not None else 'did not recover'} | "
        f"{baseline['steps_redone']} | {f'{save:.2f}' if save is not None else '-'} | "
        f"{'yes' if baseline_same else 'NO'} |",
        "",
    ]
    by_name = {name: (record, same) for name, _summary, record, same in results}
    spare, retry = by_name[spare_case], by_name[error_case]
    kept = all(summary["survivors_kept_pids"] for _name, summary, _r, _s in results)

    def verdict(record: dict | None, limit: float) -> str:
        if record is None:
            return "not recovered | no"
        return f"{record['total_s']:.2f} s | {'yes' if record['total_s'] <= limit else 'no'}"

    ratio = overhead["paired_ratio_median"]
    lines += [
        "",
        "## Against the goals",
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        f"| steady state ≤ 1.01 of plain DDP | {ratio:.4f} | {'yes' if ratio <= 1.01 else 'no'} |",
        f"| kill recovered ≤ 3 s with a hot spare | {verdict(spare[0], 3.0)} |",
        f"| communication error recovered ≤ 1 s | {verdict(retry[0], 1.0)} |",
        f"| final parameters equal to the fault-free run's | "
        f"{'all' if all(same for *_x, same in results) else 'NOT all'} | "
        f"{'yes' if all(same for *_x, same in results) else 'no'} |",
        f"| survivors keep their processes (PIDs) | {'all' if kept else 'NOT all'} | "
        f"{'yes' if kept else 'no'} |",
        "",
    ]
    write_report(args.out, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
