"""Worker script: the proxy's steady-state cost, measured step by step against plain DDP.

    xmig run --nproc-per-node 2 bench/proxy_overhead.py --steps 40 --out result.json

Each rank builds the demo GPT twice (same weights): one DDP over a plain gloo group, one over
xmig's process group driven by ``session.steps()``. Steps alternate between the two (ABBA, so
neither always goes first), and the drift of a shared machine hits both alike; a step through
xmig includes its step boundary.
Rank 0 writes the per-step wall times of both to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train_gpt  # noqa: E402

import xmig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="then profile this many more steps of each (GPU): where a step's time goes",
    )
    parser.add_argument("--trace", help="a folder for the profiled steps' Chrome traces")
    parser.add_argument(
        "--stack",
        action="store_true",
        help="record Python frames in the traces (bench/trace_gaps.py names what the CPU ran "
        "while the GPU waited; it slows the CPU side)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="(GPU) where the CPU and the GPU stand after DDP's broadcast of its buffers (the "
        "forward's start), the forward, the backward and the optimizer of each step (CUDA "
        "events), and the time xmig's step boundary takes",
    )
    parser.add_argument(
        "--poll-us",
        type=float,
        help="how often the proxy checks whether a GPU op has finished (default: the proxy's)",
    )
    parser.add_argument(
        "--profile-boundary",
        help="a file for cProfile's account of xmig's step boundaries (the step loop's thread)",
    )
    parser.add_argument(
        "--profile-issue",
        help="a file for cProfile's account of the proxy's issue of each op after the warm-up "
        "(on whichever thread issues it: autograd's for DDP's buckets)",
    )
    parser.add_argument(
        "--profile-op",
        help="with --profile-issue: profile only the ops of this kind (e.g. broadcast, DDP's "
        "buffer broadcast at each forward, which the GPU waits for while idle)",
    )
    parser.add_argument(
        "--split-issue",
        action="store_true",
        help="time the parts of the proxy's issue of each op (its own functions, each wrapped "
        "in a wall-clock timer: unlike cProfile, nothing else slows): issue_split_us",
    )
    parser.add_argument(
        "--stacks-after",
        type=float,
        default=900.0,
        help="a hang: print every thread's stack and end after this many seconds (900)",
    )
    args, model_args = parser.parse_known_args()
    if args.stacks_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_after, exit=True)
    if args.poll_us is not None:
        import xmig.proxy.process_group as proxy_module

        proxy_module.GPU_POLL_S = args.poll_us / 1e6
    gpt_args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(gpt_args)

    session = xmig.init(seed=gpt_args.seed)
    device = session.device
    plain_group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(gpt_args.seed)
    model_x = train_gpt.GPT(cfg).to(device)
    model_p = copy.deepcopy(model_x)
    ids = [device.index] if device.type == "cuda" else None
    ddp_x = DistributedDataParallel(model_x, process_group=session.process_group, device_ids=ids,
                                    bucket_cap_mb=gpt_args.bucket_cap_mb)  # fmt: skip
    ddp_p = DistributedDataParallel(model_p, process_group=plain_group, device_ids=ids,
                                    bucket_cap_mb=gpt_args.bucket_cap_mb)  # fmt: skip
    opt_x = torch.optim.AdamW(model_x.parameters(), lr=gpt_args.lr)
    opt_p = torch.optim.AdamW(model_p.parameters(), lr=gpt_args.lr)
    session.register(model=ddp_x, optimizer=opt_x)

    phases: dict[str, list[dict[str, tuple[float, float]]]] = {"plain": [], "xmig": []}
    timed = args.phases and device.type == "cuda"
    # the mark of the step being trained: the module's own forward begins once DDP's forward
    # has broadcast its buffers (through xmig's proxy, waited for on the host)
    marking: list[Any] = [None]

    def broadcast_ended(_module: torch.nn.Module, _inputs: Any) -> None:
        if marking[0] is not None:
            marking[0]("broadcast")

    for ddp in (ddp_x, ddp_p):
        ddp.module.register_forward_pre_hook(broadcast_ended)

    def train(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, step: int,
              name: str | None = None) -> None:  # fmt: skip
        x, y = train_gpt.synthetic_batch(gpt_args.seed, step, session.rank,
                                         gpt_args.batch_size, cfg.block_size, cfg.vocab_size,
                                         device)  # fmt: skip
        marks: list[tuple[str, float, torch.cuda.Event]] = []

        def mark(point: str) -> None:
            if timed and name is not None:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((point, time.perf_counter(), event))

        mark("start")
        marking[0] = mark
        try:
            loss = ddp(x, y)
        finally:
            marking[0] = None
        mark("forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a step's time is its GPU work too
        if marks:
            _, cpu0, gpu0 = marks[0]
            phases[name].append({point: ((cpu - cpu0) * 1000, gpu0.elapsed_time(event))
                                 for point, cpu, event in marks[1:]})  # fmt: skip

    times: dict[str, list[float]] = {"plain": [], "xmig": []}
    profiled = args.profile_steps if device.type == "cuda" else 0
    steps = session.steps(args.steps + profiled)

    boundaries: list[float] = []
    boundary_profile = None
    if args.profile_boundary:
        import cProfile

        boundary_profile = cProfile.Profile()
    issue_times = time_issues(session.proxy)
    issue_split = split_issues(session.proxy) if args.split_issue else None
    issue_profiles = (profile_issues(session.proxy, args.profile_op) if args.profile_issue
                      else None)  # fmt: skip

    def plain_step(i: int) -> None:
        started = time.perf_counter()
        train(ddp_p, opt_p, i, "plain")
        times["plain"].append(time.perf_counter() - started)

    def proxy_counters() -> tuple[float, ...]:
        proxy = session.proxy
        return (proxy.log_copy_seconds, proxy.log_copy_bytes, proxy.issue_seconds,
                proxy.issued, proxy.gate_wait_seconds, proxy.gate_wait_backlog)  # fmt: skip

    # the proxy's counters where the timed steps begin and end: a warm-up's one-off costs
    # (the log's first buffers, pinned ones among them) are not a step's
    counted: list[tuple[float, float, float, float]] = []

    thread_cpu: list[dict[str, float]] = []  # where the timed steps begin and end

    def xmig_step() -> None:
        started = time.perf_counter()
        if len(boundaries) == args.warmup:
            counted.append(proxy_counters())
            thread_cpu.append(threads_cpu_seconds())
        if len(boundaries) == args.warmup:
            issue_times.on = True
            if issue_split is not None:
                issue_split.on = True
        if issue_profiles is not None and len(boundaries) == args.warmup:
            issue_profiles.on = True
        if boundary_profile is not None and len(boundaries) >= args.warmup:
            boundary_profile.enable()
            step = next(steps)
            boundary_profile.disable()
        else:
            step = next(steps)
        boundaries.append(time.perf_counter() - started)
        train(ddp_x, opt_x, step, "xmig")
        times["xmig"].append(time.perf_counter() - started)

    for i in range(args.steps):  # ABBA: which one goes first alternates
        if i % 2 == 0:
            plain_step(i)
            xmig_step()
        else:
            xmig_step()
            plain_step(i)
    counted.append(proxy_counters())
    thread_cpu.append(threads_cpu_seconds())
    timed = max(args.steps - args.warmup, 1)
    copy_s, copy_bytes, issue_s, issued, gate_wait_s, gate_backlog = (
        end - start for start, end in zip(counted[0], counted[-1], strict=True)
    )
    profiles = {}
    if profiled:
        for name, run_one in (("plain", lambda i: train(ddp_p, opt_p, i)),
                              ("xmig", lambda i: train(ddp_x, opt_x, next(steps)))):  # fmt: skip
            trace = Path(args.trace) / f"{name}.json" if args.trace else None
            profiles[name] = profile(
                run_one, args.profile_steps, args.steps, device, trace, args.stack
            )
    next(steps, None)  # the last boundary
    if boundary_profile is not None and session.rank == 0:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(boundary_profile, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(25)
        Path(args.profile_boundary).write_text(text.getvalue())
    if issue_profiles is not None and session.rank == 0:
        issue_profiles.write(Path(args.profile_issue))
    if session.rank == 0:
        kept = {k: v[args.warmup :] for k, v in times.items()}
        result = {
            "step_times": times,
            "median_ms": {k: statistics.median(v) * 1000 for k, v in kept.items()},
            "mean_ms": {k: statistics.mean(v) * 1000 for k, v in kept.items()},
            "paired_ratio_median": statistics.median(
                x / p for x, p in zip(kept["xmig"], kept["plain"], strict=True)
            ),
            "parameters": sum(p.numel() for p in model_x.parameters()),
            # the proxy's own, over the steps after the warm-up
            "log_copy_ms_per_step": copy_s / timed * 1000,
            "log_copy_mb_per_step": copy_bytes / timed / 1e6,
            "issue_ms_per_step": issue_s / timed * 1000,
            "ops_per_step": issued / timed,
            "profile": profiles,
            "boundary_ms": statistics.median(boundaries[args.warmup :]) * 1000,
            # (gate) of the boundary: the wait for the step's gates to open, and the ops the
            # proxy's waiter had yet to complete as it began, a step on average
            "gate_wait_ms_per_step": gate_wait_s / timed * 1000,
            "gate_backlog_per_step": gate_backlog / timed,
            # the proxy's issue of each kind of op, µs an op (the log's copies included)
            "issue_us_by_op": {
                op: seconds / count * 1e6 for op, (count, seconds) in issue_times.by_op.items()
            },  # fmt: skip
            # (--split-issue) µs an op of each timed part of the issue, by kind of op; parts
            # nest (_enqueue holds _launch, which holds _when_done), "issue" is the whole
            # and "rest" what ISSUE_PARTS leave of it
            "issue_split_us": issue_split.per_op() if issue_split is not None else None,
            # the CPU time of each of the process's threads, ms a step through xmig (the
            # main thread's holds a plain step's too): which threads run beside the step
            # loop, and for how long
            "thread_cpu_ms_per_step": cpu_per_step(thread_cpu, timed),
            # per point: the median of the CPU's and of the GPU's time since the step began
            # (ms); the GPU later than the CPU by their difference: the CPU that far ahead
            "phases": {
                name: {
                    point: [
                        statistics.median(s[point][0] for s in steps_[args.warmup :]),
                        statistics.median(s[point][1] for s in steps_[args.warmup :]),
                    ]
                    for point in ("broadcast", "forward", "backward", "optimizer")
                }
                for name, steps_ in phases.items()
                if len(steps_) > args.warmup
            },
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"[rank0] plain {result['median_ms']['plain']:.1f} ms, xmig "
              f"{result['median_ms']['xmig']:.1f} ms, paired ratio "
              f"{result['paired_ratio_median']:.4f}", flush=True)  # fmt: skip


def threads_cpu_seconds() -> dict[str, float]:
    """The CPU time (user and system) each thread of this process has used, by name: Python's
    name for a Python thread, the kernel's for the others (summed where names repeat)."""
    import os
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            used = _sched_runtime(task)
        except OSError:  # ended meanwhile
            continue
        kernel_name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if used is None:  # whole clock ticks (10 ms) where the kernel keeps no finer count
            fields = stat[stat.rindex(")") + 2 :].split()
            used = (int(fields[11]) + int(fields[12])) / tick
        tid = int(task.name)
        name = names.get(tid, "MainThread" if tid == os.getpid() else kernel_name)
        seconds[name] = seconds.get(name, 0.0) + used
    return seconds


def _sched_runtime(task: Path) -> float | None:
    """A thread's time on a CPU in seconds, to the ns, from the scheduler's own account
    (``/proc/…/sched``, where the kernel has it)."""
    try:
        for line in (task / "sched").read_text().splitlines():
            if line.startswith("se.sum_exec_runtime"):
                return float(line.split(":")[1]) / 1000
    except OSError:  # no such file, or not ours to read: the caller counts clock ticks
        return None
    return None


def cpu_per_step(marks: list[dict[str, float]], steps: int) -> dict[str, float]:
    """ms a step of each thread's CPU time between the first and the last of ``marks``
    (those that used any)."""
    if len(marks) < 2 or steps < 1:
        return {}
    first, last = marks[0], marks[-1]
    used = {name: (last[name] - first.get(name, 0.0)) / steps * 1000 for name in last}
    return dict(sorted(((n, ms) for n, ms in used.items() if ms > 0), key=lambda kv: -kv[1]))


class IssueProfiles:
    """cProfile around each op the proxy issues once ``on``: one profile per issuing thread
    (a profile records only the thread that enabled it), merged when written."""

    def __init__(self, only: str | None = None) -> None:
        self.on = False
        self.only = only
        self.ops = 0
        self.seconds = 0.0
        self._by_thread: dict[int, object] = {}

    def around(self, issue):  # noqa: ANN001, ANN201 - the proxy's own ``_issue``
        import cProfile
        import threading

        def profiled(op, op_args):  # noqa: ANN001, ANN202
            if not self.on or (self.only is not None and op != self.only):
                return issue(op, op_args)
            profiler = self._by_thread.setdefault(threading.get_ident(), cProfile.Profile())
            started = time.perf_counter()
            profiler.enable()
            try:
                return issue(op, op_args)
            finally:
                profiler.disable()
                self.seconds += time.perf_counter() - started
                self.ops += 1

        return profiled

    def write(self, path: Path) -> None:
        import io
        import pstats

        text = io.StringIO()
        each = self.seconds * 1e6 / max(self.ops, 1)
        kind = f" {self.only}" if self.only else ""
        text.write(f"{self.ops}{kind} ops issued under the profiler, {each:.0f} us an op on "
                   f"average ({len(self._by_thread)} issuing threads)\n")  # fmt: skip
        if self._by_thread:
            stats = pstats.Stats(*self._by_thread.values(), stream=text)
            stats.sort_stats("cumulative").print_stats(50)
            stats.sort_stats("tottime").print_stats(30)
        path.write_text(text.getvalue())


class IssueTimes:
    """The wall time of the proxy's issue of each op once ``on``, by the op's kind."""

    def __init__(self) -> None:
        self.on = False
        self.by_op: dict[str, tuple[int, float]] = {}

    def around(self, issue):  # noqa: ANN001, ANN201 - the proxy's own ``_issue``
        def timed(op, op_args):  # noqa: ANN001, ANN202
            if not self.on:
                return issue(op, op_args)
            started = time.perf_counter()
            try:
                return issue(op, op_args)
            finally:
                count, seconds = self.by_op.get(op, (0, 0.0))
                self.by_op[op] = (count + 1, seconds + time.perf_counter() - started)

        return timed


class IssueSplit:
    """Wall time of named parts of the proxy's issue, by the kind of op being issued; "rest":
    the issue less its ``top`` parts (what no timer covers)."""

    def __init__(self, top: tuple[str, ...] = ()) -> None:
        import threading

        self.top = top
        self.on = False
        self.current = threading.local()
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, dict[str, float]] = {}

    def around_issue(self, issue):  # noqa: ANN001, ANN201 - the proxy's own ``_issue``
        def timed(op, op_args):  # noqa: ANN001, ANN202
            if not self.on:
                return issue(op, op_args)
            self.current.op = op
            started = time.perf_counter()
            try:
                return issue(op, op_args)
            finally:
                self._add(op, "issue", time.perf_counter() - started)
                self.counts[op] = self.counts.get(op, 0) + 1
                self.current.op = None

        return timed

    def around(self, part: str, call):  # noqa: ANN001, ANN201
        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            op = getattr(self.current, "op", None)
            if op is None:
                return call(*a, **k)
            started = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                self._add(op, part, time.perf_counter() - started)

        return timed

    def _add(self, op: str, part: str, seconds: float) -> None:
        parts = self.seconds.setdefault(op, {})
        parts[part] = parts.get(part, 0.0) + seconds

    def per_op(self) -> dict[str, dict[str, float]]:
        split: dict[str, dict[str, float]] = {}
        for op, parts in self.seconds.items():
            if not self.counts.get(op):
                continue
            us = {part: seconds / self.counts[op] * 1e6 for part, seconds in parts.items()}
            if self.top:
                us["rest"] = us["issue"] - sum(us.get(part, 0.0) for part in self.top)
            split[op] = us
        return split


# the parts ``_issue_op`` is made of, in order: what they leave of the issue is "rest"
ISSUE_PARTS = ("_new_record", "_before_op", "_check_expected", "_apply_override", "on_issue",
               "_track", "_serve_locally", "_log_inputs", "_mark_logged", "_enqueue",
               "_complete_behind_gate", "_create_work_from_future")  # fmt: skip


def split_issues(proxy) -> IssueSplit:  # noqa: ANN001 - xmig's ProxyProcessGroup
    """Time the parts of ``proxy``'s issue: its methods and the module's functions it calls
    (wrapped where the issue looks them up), from when the returned object is on."""
    import xmig.proxy.process_group as module
    from xmig.proxy.gate import StreamGate

    split = IssueSplit(top=ISSUE_PARTS)
    for name in ("signature_of", "_create_work_from_future", "_when_done", "_end_of",
                 "_as_async", "_on_stream"):  # fmt: skip
        setattr(module, name, split.around(name, getattr(module, name)))
    for name in ("_new_record", "_before_op", "_check_expected", "_apply_override", "_track",
                 "_serve_locally", "_log_inputs", "_mark_logged", "_enqueue",
                 "_complete_behind_gate", "_launch", "_gate_of"):  # fmt: skip
        setattr(proxy, name, split.around(name, getattr(proxy, name)))
    for name in ("before_op", "on_issue"):
        if getattr(proxy, name) is not None:
            setattr(proxy, name, split.around(name, getattr(proxy, name)))
    proxy.sequence.take = split.around("sequence.take", proxy.sequence.take)
    StreamGate.hold = split.around("gate.hold", StreamGate.hold)
    proxy._issue = split.around_issue(proxy._issue)
    return split


def time_issues(proxy) -> IssueTimes:  # noqa: ANN001 - xmig's ProxyProcessGroup
    """Time ``proxy``'s issue of each op, by kind, from when the returned object is on."""
    times = IssueTimes()
    proxy._issue = times.around(proxy._issue)
    return times


def profile_issues(proxy, only: str | None = None) -> IssueProfiles:  # noqa: ANN001
    """Profile ``proxy``'s (xmig's ProxyProcessGroup) issue of each op, or of each ``only``
    op, from when the returned object is turned on."""
    profiles = IssueProfiles(only)
    proxy._issue = profiles.around(proxy._issue)
    return profiles


def profile(run_one, count: int, first: int, device: torch.device,
            trace: Path | None, stack: bool = False) -> dict:  # fmt: skip
    """``count`` steps under torch.profiler: per step, the wall time, the GPU's busy time
    (the union of its kernels and copies), its idle time, and the busy time by kind."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize(device)
    with torch_profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=stack
    ) as prof:
        started = time.perf_counter()
        for i in range(count):
            run_one(first + i)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    spans: list[tuple[float, float, str]] = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = ("nccl" if "nccl" in name else "copy" if "memcpy" in name or "copy" in name
                else "compute")  # fmt: skip
        spans.append((event.time_range.start, event.time_range.end, kind))
    spans.sort()
    busy, by_kind, end = 0.0, {"nccl": 0.0, "copy": 0.0, "compute": 0.0}, None
    for start, stop, kind in spans:
        by_kind[kind] += stop - start
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    per_step_ms = 1 / count / 1000  # the profiler's microseconds, in all -> milliseconds a step
    return {
        "wall_ms": wall * 1000 / count,
        "gpu_busy_ms": busy * per_step_ms,
        "gpu_idle_ms": wall * 1000 / count - busy * per_step_ms,
        "by_kind_ms": {k: v * per_step_ms for k, v in by_kind.items()},
        "kernels_per_step": len(spans) / count,
    }


if __name__ == "__main__":
    main()
