"""``make demo``: the demo GPT on 2 CPU ranks, once without a fault and once with one.

Prints what xmig saw (the failed rank, how, at which step, how fast it noticed) and checks the
outcome; the exit code is 0 when everything behaved as it should.
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
    ok = clean["status"] == "completed" and clean["steps"] == STEPS
    print(f"fault-free run: {clean['status']}, {clean['steps']} steps, "
          f"params sha256 {str(clean['final_params_sha256'])[:16]}…")  # fmt: skip
    if not faulty["faults"]:
        print("faulty run: no fault was recorded")
        return 1
    fault = faulty["faults"][0]
    print(f"faulty run:     injected {FAULT}")
    latency_ms = fault["detected_after_s"] * 1000
    print(f"  detected:     rank {fault['rank']}, {fault['kind']} ({fault['detail']}), "
          f"step {fault['step']}, {latency_ms:.1f} ms after the fault")  # fmt: skip
    print(f"  then:         the job was stopped cleanly in {faulty['stop_s']:.2f} s, "
          f"exit code {faulty['exit_code']}")  # fmt: skip
    ok &= fault["rank"] == 1 and fault["kind"] == "signal" and fault["step"] == 5
    ok &= faulty["status"] == "failed"
    print("as expected:  ", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
