"""FSDP2 through xmig on one GPU (NCCL, one rank): determinism, and how many collectives it
issues (none on a mesh of one rank: the cost against plain FSDP2, ``bench/fsdp_overhead.py``,
and a communication error retried in place need 2 GPUs).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/fsdp_h200x1.py --out bench/results/fsdp-h200x1.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_cpu import bounded

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "fsdp.py"
TIMEOUT_S = 400


def xmig(work: Path, name: str, args: list[str]) -> dict:
    summary = work / f"{name}.json"
    cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", "1", "--hot-spares", "0",
           "--summary", str(summary), *args]  # fmt: skip
    bounded(cmd, work / f"{name}.log", TIMEOUT_S)  # overrun: its whole tree is killed
    if not summary.exists():
        raise SystemExit(f"{name}: no summary; see {work / (name + '.log')}")
    return json.loads(summary.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fsdp-h200x1.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="xmig-fsdp-"))
    layout = [str(SCRIPT), "--layout", "fsdp", "--steps", "8"]
    first, second = xmig(work, "once", layout), xmig(work, "twice", layout)
    # FSDP2 on a mesh of one rank issues no collective (the trace of tests/scripts/fsdp.py
    # shows none): nothing to retry or to measure against plain FSDP2 on one GPU
    traced = work / "trace"
    xmig(work, "traced", ["--trace-dir", str(traced), *layout])
    ops = sum(1 for f in traced.glob("*.jsonl") for line in f.read_text().splitlines()
              if json.loads(line).get("kind") == "op")  # fmt: skip
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        "# FSDP2 through xmig on one GPU",
        "",
        f"`{' '.join(['python', 'bench/fsdp_h200x1.py', *sys.argv[1:]])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {gpu}, torch "
        f"{torch.__version__}, Python {platform.python_version()}; one rank over NCCL.",
        "",
        f"- Determinism (`tests/scripts/fsdp.py --layout fsdp`, 8 steps, twice): "
        f"{first['status']} / {second['status']}, same final parameters: "
        f"{first['final_params_sha256'] == second['final_params_sha256']}.",
        f"- Collectives an 8-step run issues through xmig: {ops}. FSDP2 on a mesh of one rank "
        "communicates nothing, so a communication error cannot be injected into one and the "
        "steady-state cost against plain FSDP2 is not measurable on one GPU: both need 2 GPUs "
        "(`bench/fsdp_overhead.py` is the paired measurement for then).",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
