"""The proxy's own cost of issuing one op, alone: one process, a communicator that does
nothing (its works are done at once), no other busy thread but the proxy's waiter. This is
the floor of the issue's Python path, which a job's issue (``bench/proxy_overhead.py``'s
``issue_us_by_op``) adds its waits for the interpreter and the CPU to.

    python bench/issue_alone.py [--steps 200] [--ops 50] [--numel 1024] [--no-log]

Each step issues a broadcast and ``--ops`` all-reduces of ``--numel`` float32 each, and waits
for each. Prints µs an op: the proxy's issue (median over the steps, and its least), and the
issue with the wait for the waiter's completion."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from xmig.proxy.process_group import ProxyProcessGroup, wait_let_go  # noqa: E402

WARMUP_STEPS = 20


class DoesNothing:
    """A communicator's backend whose ops are done as they are issued (one rank)."""

    @staticmethod
    def _done(tensors: list[torch.Tensor]) -> dist.Work:
        future = torch.futures.Future()
        future.set_result(tensors)
        return _create_work_from_future(future)

    def broadcast(self, tensors: list[torch.Tensor], _options: object) -> dist.Work:
        return self._done(tensors)

    def allreduce(self, tensors: list[torch.Tensor], _options: object) -> dist.Work:
        return self._done(tensors)


def measure(steps: int, ops: int, numel: int, keep_log: bool) -> dict[str, float]:
    communicator = SimpleNamespace(rank=0, size=1, generation=0, backend=DoesNothing(),
                                   kind="gloo")  # fmt: skip
    proxy = ProxyProcessGroup(communicator, keep_log=keep_log)  # type: ignore[arg-type]
    buffers = [torch.zeros(64)]
    bucket = [torch.zeros(numel)]
    issue_us, whole_us = [], []
    for step in range(WARMUP_STEPS + steps):
        proxy.begin_step(step)
        issued_before, seconds_before = proxy.issued, proxy.issue_seconds
        started = time.perf_counter()
        proxy.broadcast(buffers, dist.BroadcastOptions()).wait()
        for _ in range(ops):
            proxy.allreduce(bucket, dist.AllreduceOptions()).wait()
        whole = time.perf_counter() - started
        if step >= WARMUP_STEPS:
            count = proxy.issued - issued_before
            issue_us.append((proxy.issue_seconds - seconds_before) / count * 1e6)
            whole_us.append(whole / count * 1e6)
    proxy.begin_step(WARMUP_STEPS + steps + 1)  # the log handed to the let-go thread
    proxy.begin_step(WARMUP_STEPS + steps + 2)
    wait_let_go(10.0)  # (a work destroyed by a thread the exit kills ends the process)
    return {
        "issue_us_median": statistics.median(issue_us),
        "issue_us_least": min(issue_us),
        "with_wait_us_median": statistics.median(whole_us),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ops", type=int, default=50, help="all-reduces a step")
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements an op")
    parser.add_argument("--no-log", action="store_true", help="the replay log off")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.ops < 0 or args.numel < 1:
        parser.error("--steps and --numel must be at least 1, --ops at least 0")
    result = measure(args.steps, args.ops, args.numel, keep_log=not args.no_log)
    if args.json:
        print(json.dumps(result))
    else:
        median, least = result["issue_us_median"], result["issue_us_least"]
        print(f"issue {median:.1f} µs an op (least {least:.1f}), "
              f"with the wait {result['with_wait_us_median']:.1f} µs")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
