"""How long closing a healthy NCCL communicator takes: ``ProcessGroupNCCL.shutdown()`` (what a
rank does at a migration's pause) and ``abort()``, for a communicator of one rank, each in a
fresh process (``--rounds`` per way), with the environment given on the command line.

    NCCL_NVLS_ENABLE=0 python bench/nccl_close.py --rounds 6 [--env NCCL_CUMEM_ENABLE=0] \
        [--idle-s 0.3] [--wake] --out FILE.json

``--idle-s``: how long the communicator idles after its last op before it is closed.
``--wake``: each way also with xmig's waking of NCCL's socket service threads during the
close (``xmig.ccl.wake``, what xmig's own closes do), in ABBA order against without.

A close's time that spreads evenly between a few milliseconds and half a second points at a
thread that looks for its stop flag every 500 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child(how: str, port: int, idle_s: float) -> None:
    import torch
    import torch.distributed as dist

    from xmig.ccl.wake import woken

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    options = dist.ProcessGroupNCCL.Options()
    pg = dist.ProcessGroupNCCL(store, 0, 1, options)
    pg.bound_device_id = device
    probe = torch.ones(1 << 20, device=device)
    for _ in range(3):
        pg.allreduce([probe]).wait()
    torch.cuda.synchronize(device)
    time.sleep(idle_s)
    started = time.perf_counter()
    with woken(how.endswith("+wake")) as waker:
        pg.shutdown() if how.startswith("shutdown") else pg.abort()
    took = time.perf_counter() - started
    found = waker.found if waker is not None else 0
    sent = waker.sent if waker is not None else 0
    print(json.dumps({"how": how, "s": took, "sockets": found, "sent": sent}), flush=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the children")
    parser.add_argument("--idle-s", type=float, default=0.05,
                        help="how long the communicator idles after its last op")  # fmt: skip
    parser.add_argument(
        "--wake",
        action="store_true",
        help="each way also with NCCL's service threads woken (xmig's way)",
    )
    parser.add_argument("--out")
    parser.add_argument("--child", choices=["shutdown", "abort", "shutdown+wake", "abort+wake"])
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.port, args.idle_s)
        return
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.update(item.split("=", 1) for item in args.env)
    ways = ["shutdown", "abort"]
    if args.wake:
        ways = ["shutdown", "shutdown+wake", "abort+wake", "abort"]
    times: dict[str, list[float]] = {how: [] for how in ways}
    for i in range(args.rounds):
        for how in ways if i % 2 == 0 else ways[::-1]:
            done = subprocess.run([sys.executable, __file__, "--child", how, "--port",
                                   str(_free_port()), "--idle-s", str(args.idle_s)], env=env,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(f"{how}: no result (rc {done.returncode}): {done.stderr[-500:]}")
                continue
            child_result = json.loads(line)
            times[how].append(child_result["s"])
            print(json.dumps(child_result), flush=True)
    summary = {how: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                     "all_s": [round(x, 4) for x in v]}
               for how, v in times.items() if v}  # fmt: skip
    result = {"env": args.env, "idle_s": args.idle_s, "wake": args.wake, "summary": summary}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
