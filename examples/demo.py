"""``make demo``: the demo GPT on 2 CPU ranks, once without a fault and once with one.

Prints what xmig saw and did (the failed rank, how, at which step, how fast it noticed, how it
recovered) and whether both runs ended with the same parameters, bit for bit; the exit code is
0 when they did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / ".demo"
STEPS = 12
FAULT = "kill:rank=1:step=5:at=backward"
TIMEOUT_S = 300


def xmig_run(name: str, extra: list[str]) -> dict:
    summary = OUT / f"{name}.json"
    summary.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "xmig", "run", "--nproc-per-node", "2", "--summary", str(summary),
        *extra, str(HERE / "train_gpt.py"), "--steps", str(STEPS),
    ]  # fmt: skip
    print(f"\n$ xmig run --nproc-per-node 2 {' '.join(extra)} examples/train_gpt.py "
          f"--steps {STEPS}", flush=True)  # fmt: skip
    subprocess.run(cmd, timeout=TIMEOUT_S, check=False)
    return json.loads(summary.read_text())


def main() -> int:
    OUT.mkdir(exist_ok=True)
    clean = xmig_run("fault-free", [])
    faulty = xmig_run("faulty", ["--inject", FAULT])
    print("\n==== outcome ====")
    print(f"fault-free run: {clean['status']}, {clean['steps']} steps, "
          f"params sha256 {str(clean['final_params_sha256'])[:16]}…")  # fmt: skip
    if not faulty["faults"] or not faulty["recoveries"]:
        print(f"faulty run:     {faulty['message']}")
        return 1
    fault, record = faulty["faults"][0], faulty["recoveries"][0]
    latency_ms = fault["detected_after_s"] * 1000
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in record["phases"].items())
    print(f"faulty run:     injected {FAULT}")
    print(f"  detected:     rank {fault['rank']}, {fault['kind']} ({fault['detail']}), "
          f"step {fault['step']}, {latency_ms:.1f} ms after the fault")  # fmt: skip
    print(f"  recovered:    by {record['mode']} in {record['total_s']:.2f} s ({phases})")
    survivors = [r for r, pids in faulty["worker_pids"].items() if len(pids) == 1]
    print(f"  survivors:    rank(s) {', '.join(survivors)} kept their processes; "
          f"rank {fault['rank']} PIDs {faulty['worker_pids'][str(fault['rank'])]}")  # fmt: skip
    print(f"  finished:     {faulty['status']}, {faulty['steps']} steps, "
          f"params sha256 {str(faulty['final_params_sha256'])[:16]}…")  # fmt: skip
    identical = (
        clean["final_params_sha256"] is not None
        and clean["final_params_sha256"] == faulty["final_params_sha256"]
        and clean["steps"] == faulty["steps"] == STEPS
    )
    print(f"bit-identical:  {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
