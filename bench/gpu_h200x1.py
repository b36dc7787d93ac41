"""What one GPU can show of the NCCL path (the 2-GPU machine was not lent).

    NCCL_NVLS_ENABLE=0 python bench/gpu_h200x1.py --out bench/results/gpu-h200x1.md

On one H200, with the demo GPT at ~350 M parameters and one rank over NCCL: determinism
(xmig twice and plain DDP once, same final hash?), the proxy's steady-state cost (paired ABBA
steps, ``bench/proxy_overhead.py``), an in-place retry after an injected communication error
(NCCL communicator aborted and rebuilt, step replayed, hash compared), and how long a cold
start of a CUDA-ready interpreter takes (what a hot spare saves).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_cpu import DEMO, bounded, free_port, machine, paired, write_report

MODEL = ["--preset", "gpt350m", "--batch-size", "8"]
STEPS = 12


def xmig_run(work: Path, name: str, flags: list[str]) -> dict:
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", "1", "--summary",
           str(summary), *flags, str(DEMO), *MODEL, "--steps", str(STEPS), "--quiet"]  # fmt: skip
    bounded(cmd, work / f"{name}.log")
    return json.loads(summary.read_text())


def plain_hash(work: Path) -> str | None:
    log = work / "plain.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-port", str(free_port()), str(DEMO), *MODEL, "--steps", str(STEPS),
           "--quiet", "--plain"]  # fmt: skip
    bounded(cmd, log)
    for line in log.read_text().splitlines():
        if "final params sha256" in line:
            return line.rsplit(" ", 1)[1]
    return None


def cold_start_s() -> float:
    code = ("import torch; torch.cuda.init(); torch.zeros(1, device='cuda'); "
            "torch.optim.AdamW([torch.zeros(1, device='cuda', requires_grad=True)])")  # fmt: skip
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="xmig-gpu-"))
    gpu = torch.cuda.get_device_name(0)
    first = xmig_run(work, "first", ["--hot-spares", "0"])
    second = xmig_run(work, "second", ["--hot-spares", "0"])
    plain = plain_hash(work)
    retry = xmig_run(work, "retry", ["--hot-spares", "0", "--inject",
                                     "raise:rank=0:step=6:at=backward"])  # fmt: skip
    overhead = paired(work, "overhead", 30, MODEL, nproc=1)
    cold = [cold_start_s() for _ in range(3)]
    same = first["final_params_sha256"] == second["final_params_sha256"]
    record = retry["recoveries"][0] if retry["recoveries"] else None
    ms = overhead["median_ms"]
    timing = "-"
    if record:
        phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items())
        timing = f"{record['total_s']:.3f} s ({phases})"
    lines = [
        "# One H200: the NCCL path as far as one GPU shows it",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with "
        "`NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 "
        "python bench/gpu_h200x1.py` on the device machine kind `nvidia-h200` "
        f"({gpu}; {machine()}; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}).",
        "",
        f"The demo GPT `{' '.join(MODEL)}` ({overhead['parameters'] / 1e6:.0f} M parameters), "
        f"one rank, DDP over NCCL, `torch.use_deterministic_algorithms(True)`, {STEPS} steps. "
        "The 2-GPU machine the GPU issue needs was not lent, so nothing here involves a "
        "second rank: no respawn, no state pull between GPUs.",
        "",
        "| check | result |",
        "|---|---|",
        f"| xmig run twice: same final parameters | {'yes' if same else 'NO'} "
        f"(`{str(first['final_params_sha256'])[:16]}…`) |",
        f"| plain DDP (torchrun, no xmig): same as xmig | "
        f"{'yes' if plain == first['final_params_sha256'] else 'NO'} |",
        f"| injected communication error at step 6 (backward): recovered by | "
        f"{record['mode'] if record else 'not recovered: ' + retry['message']} |",
        f"| ... its total time, fault to parked collective done | {timing} |",
        f"| ... final parameters equal to the fault-free run | "
        f"{'yes' if retry['final_params_sha256'] == first['final_params_sha256'] else 'NO'} |",
        f"| steady state, paired ABBA: plain DDP | {ms['plain']:.1f} ms/step |",
        f"| steady state, paired ABBA: through xmig | {ms['xmig']:.1f} ms/step |",
        f"| ratio (median of pair ratios) | **{overhead['paired_ratio_median']:.4f}** |",
        f"| replay log: host time to issue its device-to-device copies | "
        f"{overhead['log_copy_ms_per_step']:.2f} ms for {overhead['log_copy_mb_per_step']:.0f} "
        "MB |",
        f"| cold start to a CUDA-ready interpreter with an optimizer (what a hot spare has "
        f"done ahead) | {', '.join(f'{c:.2f}' for c in cold)} s |",
        "",
    ]
    write_report(args.out, lines, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
