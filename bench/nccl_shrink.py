"""NCCL's own shrink (``ncclCommShrink``, through ``ProcessGroupNCCL.shrink``) against what
xmig does when the world shrinks: a new communicator of the smaller size, built through the
store. Each measured from the moment the ranks that stay decide, to the first all-reduce on
the new communicator done; paired in one run (ABBA), fresh processes each time.

- ``planned``: every rank healthy, the last one leaves (it takes no part).
- ``lost``: the last rank's process is killed first; the shrink asks NCCL to abort what the
  old communicator had in flight (``SHRINK_ABORT``); the rebuild aborts the old one.

On a machine with fewer GPUs than ranks, ranks share a GPU: each gets an ``NCCL_HOSTID`` of
its own, so that NCCL takes them for ranks of different hosts (talking over sockets, as
xmig's simulated hosts do), which it refuses on one host. What it measures then is NCCL's
setup, not the link's speed.

    NCCL_NVLS_ENABLE=0 python bench/nccl_shrink.py --world 3 --rounds 2 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank: int, world: int, port: int, how: str, case: str, out: Any) -> None:
    try:
        _measure(rank, world, port, how, case, out)
    except Exception as exc:  # the report says where it broke (an API this torch lacks)
        _report_and_exit(out, rank, {"error": f"{type(exc).__name__}: {exc}"[:300]}, 1)


def _report_and_exit(out: Any, rank: int, result: Any, code: int) -> None:
    """Put the result and end at once (NCCL's teardown is not measured): the queue's feeder
    thread must have flushed it first, or ``os._exit`` loses it."""
    out.put((rank, result))
    out.close()
    out.join_thread()
    os._exit(code)


def _measure(rank: int, world: int, port: int, how: str, case: str, out: Any) -> None:
    os.environ["NCCL_HOSTID"] = f"xmig-bench-host{rank}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("old", store), rank, world, options)
    pg.bound_device_id = device  # eager: the communicator is made at once, shrinkable
    probe = torch.ones(1 << 20, device=device)
    for _ in range(3):
        pg.allreduce([probe]).wait()
    torch.cuda.synchronize(device)
    store.set(f"ready{rank}", "1")
    store.wait([f"ready{r}" for r in range(world)])
    if rank == world - 1:  # the rank that leaves
        if case == "lost":
            os._exit(9)  # gone without a word
        if how == "rebuild":
            pg.shutdown()  # as every rank does at xmig's pause
        else:
            store.wait(["done0"])  # a shrink's excluded rank takes no part
        _report_and_exit(out, rank, None, 0)
    if case == "lost":
        time.sleep(0.5)  # its process is gone by now
    probe.fill_(1.0)
    result: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        if how == "shrink":
            flags = dist.distributed_c10d.SHRINK_ABORT if case == "lost" else 0
            new = pg.shrink([world - 1], flags, None)
        else:
            if case == "lost":
                pg.abort()
            else:
                pg.shutdown()
            new = dist.ProcessGroupNCCL(dist.PrefixStore("new", store), rank, world - 1, options)
            new.bound_device_id = device
        made = time.perf_counter()
        new.allreduce([probe]).wait()
        torch.cuda.synchronize(device)
        result = {"made_s": made - started, "total_s": time.perf_counter() - started,
                  "sum_ok": bool(probe[0].item() == world - 1)}  # fmt: skip
    except Exception as exc:  # the report says what NCCL or torch refused
        result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if rank == 0:
        store.set("done0", "1")
    _report_and_exit(out, rank, result, 0)


def once(world: int, how: str, case: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, how, case, out))
             for r in range(world)]  # fmt: skip
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 120
    expected = world - 1 if case == "lost" else world
    while len(results) < expected and time.monotonic() < deadline:
        try:
            rank, result = out.get(timeout=1.0)
        except Exception:
            if all(not p.is_alive() for p in procs):
                break
            continue
        results[rank] = result
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    staying = [results.get(r) for r in range(world - 1)]
    errors = [r["error"] for r in staying if r and "error" in r]
    if errors or any(r is None for r in staying):
        return {"error": errors[0] if errors else "a rank did not report within 120 s"}
    return {"made_s": max(r["made_s"] for r in staying),
            "total_s": max(r["total_s"] for r in staying),
            "sums_ok": all(r["sum_ok"] for r in staying)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    report: dict[str, Any] = {"world": args.world, "torch": torch.__version__,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "gpus": torch.cuda.device_count(), "runs": []}  # fmt: skip
    for case in ("planned", "lost"):
        for _ in range(args.rounds):
            for how in ("shrink", "rebuild", "rebuild", "shrink"):
                result = {"case": case, "how": how, **once(args.world, how, case)}
                report["runs"].append(result)
                print(json.dumps(result), flush=True)
    for case in ("planned", "lost"):
        for how in ("shrink", "rebuild"):
            times = [r["total_s"] for r in report["runs"]
                     if r["case"] == case and r["how"] == how and "total_s" in r]  # fmt: skip
            if times:
                report[f"{case}_{how}_median_s"] = statistics.median(times)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
