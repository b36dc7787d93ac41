"""The proxy's own cost of issuing one op, alone: one process, no other busy thread but the
proxy's waiter. By default the communicator does nothing (its works are done at once): the
floor of the issue's Python path, which a job's issue (``bench/proxy_overhead.py``'s
``issue_us_by_op``) adds its waits for the interpreter and the CPU to. With ``--real`` it is
a real group of one rank: on a GPU, NCCL on CUDA tensors, the gate and the host route on, as
in a gated job (what the GPU's calls add, without the job's other threads); without one,
gloo on the CPU.

    python bench/issue_alone.py [--steps 200] [--ops 50] [--numel 1024] [--no-log]
                                [--real] [--split] [--primitives]

Each step issues a broadcast and ``--ops`` all-reduces of ``--numel`` float32 each, and waits
for each. Prints µs an op: the proxy's issue (median over the steps, and its least), and the
issue with the wait for the waiter's completion. ``--split``: the issue's parts, as
``proxy_overhead.py --split-issue`` times them. ``--primitives`` (a GPU, with ``--real``):
each GPU call the issue is made of, alone, µs a call."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "src"))

from xmig.proxy.process_group import ProxyProcessGroup, wait_let_go  # noqa: E402

WARMUP_STEPS = 20
PRIMITIVE_CALLS = 2000


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


def real_backend(device: torch.device | None) -> Any:
    """A real group of one rank: NCCL on ``device`` (its communicator made at the first op),
    gloo without one."""
    if device is None:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options())


def measure(steps: int, ops: int, numel: int, keep_log: bool, real: bool = False,
            split: bool = False) -> dict[str, Any]:  # fmt: skip
    device = torch.device("cuda", 0) if real and torch.cuda.is_available() else None
    nccl = device is not None
    backend = real_backend(device) if real else DoesNothing()
    communicator = SimpleNamespace(rank=0, size=1, generation=0, backend=backend,
                                   kind="nccl" if nccl else "gloo")  # fmt: skip
    proxy = ProxyProcessGroup(communicator, keep_log=keep_log, gate=nccl,  # type: ignore[arg-type]
                              log_route="host" if nccl else "inline")  # fmt: skip
    timer = None
    if split:
        sys.path.insert(0, str(BENCH))
        from proxy_overhead import split_issues

        timer = split_issues(proxy)
    buffers = [torch.zeros(64, device=device)]
    bucket = [torch.zeros(numel, device=device)]
    issue_us, whole_us = [], []
    for step in range(WARMUP_STEPS + steps):
        proxy.begin_step(step)
        if timer is not None:
            timer.on = step >= WARMUP_STEPS
        issued_before, seconds_before = proxy.issued, proxy.issue_seconds
        started = time.perf_counter()
        proxy.broadcast(buffers, dist.BroadcastOptions()).wait()
        for _ in range(ops):
            proxy.allreduce(bucket, dist.AllreduceOptions()).wait()
        whole = time.perf_counter() - started
        if nccl:  # the gates open at the step's end, as at a job's boundary
            if not proxy.wait_gates_open(10.0):
                raise RuntimeError(f"a gate of step {step} stayed shut for 10 s")
            torch.cuda.synchronize()
        if step >= WARMUP_STEPS:
            count = proxy.issued - issued_before
            issue_us.append((proxy.issue_seconds - seconds_before) / count * 1e6)
            whole_us.append(whole / count * 1e6)
    proxy.begin_step(WARMUP_STEPS + steps + 1)  # the log handed to the let-go thread
    proxy.begin_step(WARMUP_STEPS + steps + 2)
    wait_let_go(10.0)  # (a work destroyed by a thread the exit kills ends the process)
    result: dict[str, Any] = {
        "issue_us_median": statistics.median(issue_us),
        "issue_us_least": min(issue_us),
        "with_wait_us_median": statistics.median(whole_us),
    }
    if timer is not None:
        result["issue_split_us"] = timer.per_op()
    return result


def _per_call(call: Callable[[], Any], calls: int = PRIMITIVE_CALLS) -> float:
    """µs a call of ``call``: the median of 10 rounds of ``calls // 10``."""
    rounds = []
    for _ in range(10):
        started = time.perf_counter()
        for _ in range(calls // 10):
            call()
        rounds.append((time.perf_counter() - started) / (calls // 10) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def primitives(numel: int) -> dict[str, float]:
    """µs a call of each GPU call a gated issue makes, alone (no proxy, no other thread)."""
    device = torch.device("cuda", 0)
    backend = real_backend(device)
    tensor = torch.zeros(numel, device=device)
    stream = torch.cuda.Stream(device)
    done = torch.futures.Future()
    done.set_result(None)
    backend.allreduce([tensor], dist.AllreduceOptions()).wait()  # the communicator made
    work = backend.allreduce([tensor], dist.AllreduceOptions())
    future = work.get_future()

    def record_event() -> None:
        torch.cuda.Event().record()

    def enter_stream() -> None:
        with torch.cuda.stream(stream):
            pass

    return {
        "Future()": _per_call(torch.futures.Future),
        "Future(devices)": _per_call(lambda: torch.futures.Future(devices=[device])),
        "Event().record()": _per_call(record_event),
        "torch.cuda.stream(s)": _per_call(enter_stream),
        "current_stream": _per_call(lambda: torch.cuda.current_stream(device)),
        "nccl broadcast": _per_call(lambda: backend.broadcast([tensor], dist.BroadcastOptions())),
        "nccl allreduce": _per_call(lambda: backend.allreduce([tensor], dist.AllreduceOptions())),
        "work.get_future()": _per_call(work.get_future),
        "work.is_completed()": _per_call(work.is_completed),
        "future.done()": _per_call(future.done),
        "done.add_done_callback": _per_call(lambda: done.add_done_callback(lambda _f: None)),
        "_create_work_from_future": _per_call(lambda: _create_work_from_future(done)),
        "tensor.copy_ (same size)": _per_call(lambda: tensor.copy_(tensor)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ops", type=int, default=50, help="all-reduces a step")
    parser.add_argument("--numel", type=int, default=1024, help="float32 elements an op")
    parser.add_argument("--no-log", action="store_true", help="the replay log off")
    parser.add_argument(
        "--real",
        action="store_true",
        help="a real group of one rank: NCCL on the GPU (gated, host route), gloo without one",
    )
    parser.add_argument("--split", action="store_true", help="time the issue's parts")
    parser.add_argument(
        "--primitives",
        action="store_true",
        help="(a GPU, with --real) time each GPU call of the issue alone",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.ops < 0 or args.numel < 1:
        parser.error("--steps and --numel must be at least 1, --ops at least 0")
    if args.primitives and not torch.cuda.is_available():
        parser.error("--primitives needs a GPU")
    if args.primitives and not args.real:
        parser.error("--primitives goes with --real")
    result = measure(args.steps, args.ops, args.numel, keep_log=not args.no_log,
                     real=args.real, split=args.split)  # fmt: skip
    if args.primitives:
        result["primitives_us"] = primitives(args.numel)
    if args.json:
        print(json.dumps(result))
        return 0
    median, least = result["issue_us_median"], result["issue_us_least"]
    print(f"issue {median:.1f} µs an op (least {least:.1f}), "
          f"with the wait {result['with_wait_us_median']:.1f} µs")  # fmt: skip
    for op, parts in (result.get("issue_split_us") or {}).items():
        ranked = sorted(parts.items(), key=lambda kv: -kv[1])
        print(f"  {op}: " + ", ".join(f"{part} {us:.0f}" for part, us in ranked))
    for name, us in (result.get("primitives_us") or {}).items():
        print(f"  {name}: {us:.1f} µs")
    return 0


def _exit(code: int) -> None:
    """Exit without tearing a live NCCL group down (one rank: nothing to wait for)."""
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
