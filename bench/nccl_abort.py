"""How long taking down a healthy NCCL communicator takes, by way: ``abort()`` (what a
pausing rank does today) against ``shutdown()`` (a graceful end), on one GPU.

    NCCL_NVLS_ENABLE=0 python bench/nccl_abort.py --rounds 2

Each run is a fresh process with a one-rank ``ProcessGroupNCCL`` that has done a few
all-reduces; the ways alternate A B B A per round. Per run: the call's time and the GPU memory
it gave back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

WAYS = ("abort", "shutdown")


def child(way: str, store_file: str) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.FileStore(store_file, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device,
                            timeout=timedelta(seconds=60))  # fmt: skip
    tensor = torch.ones(64 * 2**20, device=device)
    for _ in range(3):
        dist.all_reduce(tensor)
    torch.cuda.synchronize(device)
    backend = dist.group.WORLD._get_backend(device)
    free_before, _ = torch.cuda.mem_get_info(device)
    started = time.perf_counter()
    getattr(backend, way)()
    took = time.perf_counter() - started
    free_after, _ = torch.cuda.mem_get_info(device)
    return {"way": way, "seconds": took, "freed_gb": (free_after - free_before) / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.store)), flush=True)
        os._exit(0)  # the process group's teardown at exit is not what is measured
    results: dict[str, list[float]] = {way: [] for way in WAYS}
    for way in [*WAYS, *reversed(WAYS)] * args.rounds:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--child", way, "--store", f"{tmp}/store"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SystemExit(f"{way} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results[way].append(result["seconds"])
        print(f"{way}: {result['seconds']:.3f} s, {result['freed_gb']:.2f} GB given back",
              flush=True)  # fmt: skip
    for way, times in results.items():
        print(f"{way}: median {statistics.median(times):.3f} s over {len(times)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
