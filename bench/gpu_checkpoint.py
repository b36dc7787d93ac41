"""The CUDA driver's checkpoint API alone: bandwidth against GPU memory held, and remapping.

    NCCL_NVLS_ENABLE=0 python bench/gpu_checkpoint.py [--sizes-gib 1 4 16] [--json OUT]

A child process fills GPU memory on GPU 0 with a known pattern; this process locks it,
checkpoints its GPU memory into its host memory, restores it and unlocks it; the child then
checks its data and nvidia-smi says on which GPU its memory now lies. First, at 1 GiB, the
ways of moving it to the last GPU (``CUcheckpointRestoreArgs``' UUID pairs: the child seeing
one GPU or all, one pair or one for each GPU); then each size by the first way that worked
(on the same GPU if none did). This is
the "measured checkpoint bandwidth" of a migration's downtime goal. Every child is bounded in
time and killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from xmig.migrate import cuda

CHILD = r"""
import sys, torch
n = int(sys.argv[1]) // 4
x = torch.arange(n, dtype=torch.int32, device="cuda:0") * 7 + 3
expected = int(x.sum(dtype=torch.int64))
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
y = x * 1  # a kernel on the restored context
got = int(x.sum(dtype=torch.int64))
print("ok" if got == expected and bool((y == x).all()) else f"CORRUPT {got} {expected}",
      flush=True)
sys.stdin.readline()
"""
TIMEOUT_S = 120


def gpu_uuids() -> list[str]:
    """The machine's GPUs in CUDA's order (nvidia-smi's, for identical GPUs)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def gpu_of(pid: int) -> str | None:
    """The UUID of the GPU on which nvidia-smi sees ``pid``'s memory."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return parts[1]
    return None


def one(size: int, child_gpus: str | None, remap: dict[str, str], goal: str) -> dict:
    """Fill ``size`` bytes on the child's first GPU, checkpoint, restore with ``remap``."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if child_gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = child_gpus
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(size)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        assert child.stdout is not None and child.stdin is not None
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        output = child.stdout

        def pump() -> None:
            for text in output:
                lines.put(text)

        threading.Thread(target=pump, daemon=True).start()

        def line() -> str:
            """The child's next line, or an error at the time bound (it is killed below)."""
            try:
                return lines.get(timeout=max(0.1, deadline - time.monotonic())).strip()
            except queue.Empty:
                raise RuntimeError(f"the child said nothing within {TIMEOUT_S} s") from None

        if line() != "ready":
            raise RuntimeError("the child did not start")
        before = gpu_of(child.pid)
        checkpoint = cuda.GpuCheckpoint(child.pid)
        checkpoint.save()
        held_after_checkpoint = gpu_of(child.pid)
        checkpoint.load(remap)
        child.stdin.write("\n")
        child.stdin.flush()
        verdict = line()
        after = gpu_of(child.pid)
        if time.monotonic() > deadline:
            raise RuntimeError("over the time bound")
        t = checkpoint.times
        return {
            "bytes": size, "child_gpus": child_gpus, "pairs": len(remap), "from": before,
            "to": after, "expected": goal, "moved_as_asked": after == goal, "data": verdict,
            "gpu_memory_after_checkpoint": held_after_checkpoint,
            **{f"{k}_s": round(v, 4) for k, v in t.items()},
            "checkpoint_gb_per_s": round(size / t["checkpoint"] / 1e9, 2),
            "restore_gb_per_s": round(size / t["restore"] / 1e9, 2),
        }  # fmt: skip
    finally:
        child.kill()
        child.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    uuids = gpu_uuids()
    first, last = uuids[0], uuids[-1]
    swap = {u: u for u in uuids} | {first: last, last: first}
    variants = [  # name, child's CUDA_VISIBLE_DEVICES, remap, where its memory should end
        ("same GPU", "0", {}, first),
        ("one GPU seen, moved to the last", "0", {first: last}, last),
        ("all GPUs seen, one pair", None, {first: last}, last),
        ("all GPUs seen, a pair for each", None, swap, last),
    ]
    rows = []

    def attempt(name: str, size: int, child_gpus: str | None, remap: dict, goal: str) -> dict:
        try:
            row = one(size, child_gpus, remap, goal)
        except Exception as exc:  # reported; the next one is tried
            row = {"bytes": size, "error": f"{type(exc).__name__}: {exc}"}
        row["variant"] = name
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    works = {name: "error" not in attempt(name, 2**30, gpus, remap, goal)
             for name, gpus, remap, goal in variants[1:] if len(uuids) > 1}  # fmt: skip
    moving = next((v for v in variants[1:] if works.get(v[0])), variants[0])
    for gib in args.sizes_gib:
        attempt(moving[0], int(gib * 2**30), *moving[1:])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    sized = rows[len(works) :]
    return 0 if all("error" not in r and r["data"] == "ok" for r in sized) else 1


if __name__ == "__main__":
    sys.exit(main())
