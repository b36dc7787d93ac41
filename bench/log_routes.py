"""What the replay log's copy of each gradient bucket costs a GPU step, by the route the copy
takes: a prototype of the routes, not xmig's code path.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/log_routes.py --preset gpt350m \
        --batch-size 8 --steps 30

One process, one GPU, the demo GPT under DDP over a plain NCCL group of one rank, trained with
one DDP communication hook per variant, steps alternating between the variants (the order
rotated and reversed every other step) on identical copies of the model. Every hook launches
the bucket's all-reduce and hands DDP NCCL's own future, as DDP's default hook does; they
differ only in the copy taken before the launch:

- ``plain``: no hook (DDP's own all-reduce), for reference.
- ``nocopy``: the hook without a copy: what the routes below are compared with.
- ``d2d``: into a device buffer on the framework's stream before the launch (xmig's
  ``inline`` route): the copy's kernel runs between the backward's kernels.
- ``d2d_side``: into a device buffer on a stream of its own, the all-reduce launched from it
  (so NCCL waits for the copy, the backward does not): the copy's kernel shares the GPU with
  the backward's.
- ``d2h``: into pinned host memory on a stream of its own, the all-reduce launched from it:
  the copy engines move it, no kernel runs; the last bucket's all-reduce waits for its copy
  at the backward's end.
- ``d2h_last_d2d``: as ``d2h`` but the last bucket (DDP's ``is_last``: the first layers and
  the embeddings, ready as the backward ends) copied as ``d2d`` (xmig's ``host`` route).

With ``--gate gate``, every hook hands DDP a future completed at once behind one gate on the
GPU (``xmig.proxy.gate.StreamGate``, open: its stream waits for NCCL's end, then for the
gate's word), as xmig's proxy does with ``--gpu-gate``; with ``--gate events``, the same
stream waits for NCCL's end only, without the gate's word: which of the two, if any, a copy
on a stream of its own does not get along with.

With ``--pool``, the copies into GPU memory come from xmig's own buffer pool
(``xmig.proxy.oplog.BufferPool``), each held for the step and the one after it as xmig's log
holds them, instead of one buffer a bucket for the whole run: whether xmig's way of finding
memory for the copies is what costs (with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
as xmig's workers run, each stream has segments of its own).

Prints each variant's median step time, its ratio to ``nocopy`` and to ``plain`` (medians of
paired ratios, with the quartiles), and the largest difference of the final parameters
between variants (0: the copies change no number). With ``--device cpu`` (gloo) only the
routes without streams run: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train_gpt  # noqa: E402
from rotation import train_in_rotation  # noqa: E402

from xmig.proxy.gate import StreamGate, dedicated_stream  # noqa: E402
from xmig.proxy.oplog import BufferPool  # noqa: E402

VARIANTS = ("plain", "nocopy", "d2d", "d2d_side", "d2h", "d2h_last_d2d")
CPU_VARIANTS = ("plain", "nocopy", "d2d")


class Log:
    """One variant's copies: a buffer per bucket, reused from step to step, or (``--pool``)
    buffers from xmig's pool, each step's held until the step after it has ended."""

    def __init__(
        self,
        route: str,
        group: dist.ProcessGroup,
        side: Any,
        gate: str = "none",
        device: torch.device | None = None,
        pool: bool = False,
    ) -> None:
        self.route = route
        self.group = group
        self.side = side  # a CUDA stream of the log's own (None on the CPU)
        self.gate = None  # (``--gate``) the gate every future is completed behind
        self.gate_stream = None  # its stream (``--gate events``: a stream alone)
        if gate == "gate":
            self.gate = StreamGate(device)
            self.gate_stream = self.gate.stream
        elif gate == "events":
            self.gate_stream = dedicated_stream(device)
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.copied = 0  # bytes, all steps
        self.pool = BufferPool() if pool else None  # (``--pool``)
        self.held: list[list[torch.Tensor]] = [[]]  # the steps' copies still held, newest last
        self.step_ended = False  # the last bucket of a step was copied

    def device_copy(self, index: int, tensor: torch.Tensor, last: bool) -> torch.Tensor:
        """A copy of ``tensor`` in GPU memory, on the current stream (``last``: the step's
        last bucket)."""
        if self.pool is None:
            return self.buffer(index, tensor, "device").copy_(tensor)
        if self.step_ended:  # a new step's first copy: the step before last is let go
            self.step_ended = False
            if len(self.held) >= 2:
                self.pool.give_back(self.held.pop(0))
            self.pool.new_step()
            self.held.append([])
        copy = self.pool.copy_of(tensor)
        self.held[-1].append(copy)
        self.step_ended = last
        return copy

    def buffer(self, index: int, tensor: torch.Tensor, where: str) -> torch.Tensor:
        saved = self.buffers.get((index, where))
        if saved is None or saved.shape != tensor.shape:
            if where == "host":
                saved = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            else:
                saved = torch.empty_like(tensor)
            self.buffers[(index, where)] = saved
        return saved


def _first(future: torch.futures.Future) -> torch.Tensor:
    return future.value()[0]


def _handed_over(log: Log, work: dist.Work, tensor: torch.Tensor) -> torch.futures.Future:
    """The future DDP gets: NCCL's own, or (``--gate``) one completed at once on the gate's
    stream once that stream waits for NCCL's end (and, ``gate``, for the gate's word)."""
    future = work.get_future()
    if log.gate_stream is None:
        return future.then(_first)
    if log.gate is not None:
        log.gate.hold(future.wait)
    else:
        with torch.cuda.stream(log.gate_stream):
            future.wait()
    handed = torch.futures.Future(devices=[tensor.device])
    with torch.cuda.stream(log.gate_stream):
        handed.set_result(tensor)
    return handed


def log_hook(log, bucket):  # noqa: ANN001, ANN201 - DDP checks the annotations' objects
    tensor = bucket.buffer()
    if log.group.size() > 1:  # (one rank: the mean is the sum, as DDP's own mul by 1.0)
        tensor.div_(log.group.size())
    route = log.route
    if route == "d2h_last_d2d":
        route = "d2d" if bucket.is_last() else "d2h"
    if route == "nocopy":
        work = dist.all_reduce(tensor, group=log.group, async_op=True)
        return _handed_over(log, work, tensor)
    log.copied += tensor.numel() * tensor.element_size()
    if route == "d2d":
        log.device_copy(bucket.index(), tensor, bucket.is_last())
        work = dist.all_reduce(tensor, group=log.group, async_op=True)
        return _handed_over(log, work, tensor)
    # on the log's own stream, after the bucket is ready; NCCL waits for the copy, since
    # it waits for the stream it is launched from
    side = log.side
    side.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(side):
        tensor.record_stream(side)
        if route == "d2d_side":
            log.device_copy(bucket.index(), tensor, bucket.is_last())
        else:
            log.buffer(bucket.index(), tensor, "host").copy_(tensor, non_blocking=True)
        work = dist.all_reduce(tensor, group=log.group, async_op=True)
    return _handed_over(log, work, tensor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        help="which to run (default: all that the device has)")  # fmt: skip
    parser.add_argument("--gate", choices=("none", "gate", "events"), default="none",
                        help="complete each hook's future behind a gate on the GPU, or on a "
                        "stream that waits for NCCL's end (GPU only)")  # fmt: skip
    parser.add_argument("--pool", action="store_true",
                        help="copies into GPU memory from xmig's pool, held two steps")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="seconds after which the run prints its stacks and ends")  # fmt: skip
    args, model_args = parser.parse_known_args()
    faulthandler.dump_traceback_later(args.time_limit, exit=True)  # a hang ends, with its stacks
    on_gpu = args.device == "cuda"
    names = list(args.variants or (VARIANTS if on_gpu else CPU_VARIANTS))
    if not on_gpu and set(names) - set(CPU_VARIANTS):
        parser.error(f"on the CPU only {', '.join(CPU_VARIANTS)} run")
    if not on_gpu and args.gate != "none":
        parser.error("--gate is for the GPU")
    if "nocopy" not in names:
        names.insert(0, "nocopy")
    if "plain" not in names:
        names.insert(0, "plain")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    backend = "nccl" if on_gpu else "gloo"
    # one rank: an in-process store, no port to take
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if on_gpu:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)
    else:
        device = torch.device("cpu")
    gpt_args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(gpt_args)
    torch.manual_seed(gpt_args.seed)
    base = train_gpt.GPT(cfg).to(device)
    variants: dict[str, tuple[DistributedDataParallel, torch.optim.Optimizer, Log | None]] = {}
    for name in names:
        group = dist.new_group(backend=backend)
        ddp = DistributedDataParallel(copy.deepcopy(base), process_group=group,
                                      device_ids=[0] if on_gpu else None,
                                      bucket_cap_mb=gpt_args.bucket_cap_mb)  # fmt: skip
        log = None
        if name != "plain":
            # (not ``torch.cuda.Stream()``: its pool's streams are NCCL's too)
            log = Log(name, group, dedicated_stream(device) if on_gpu else None, args.gate,
                      device, args.pool)  # fmt: skip
            ddp.register_comm_hook(log, log_hook)
        variants[name] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=gpt_args.lr), log)
    del base
    times = train_in_rotation({name: v[:2] for name, v in variants.items()}, args.steps,
                              gpt_args, cfg, device)  # fmt: skip

    kept = {k: v[args.warmup :] for k, v in times.items()}

    def paired(name: str, against: str) -> str:
        ratios = sorted(x / b for x, b in zip(kept[name], kept[against], strict=True))
        return (f"{statistics.median(ratios):.4f} ({ratios[len(ratios) // 4]:.4f}-"
                f"{ratios[3 * len(ratios) // 4]:.4f})")  # fmt: skip

    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"{device_name}; {len(kept['plain'])} steps each after {args.warmup} warm-up; "
          f"ratios: median of paired steps (q1-q3)")  # fmt: skip
    for name in names:
        log = variants[name][2]
        copied = log.copied / max(len(times[name]), 1) / 1e6 if log is not None else 0.0
        print(f"{name:13s} median {statistics.median(kept[name]) * 1000:8.2f} ms  "
              f"/nocopy {paired(name, 'nocopy')}  /plain {paired(name, 'plain')}  "
              f"copied {copied:.0f} MB a step")  # fmt: skip

    def largest_difference(a: str, b: str) -> float:
        pairs = zip(variants[a][0].parameters(), variants[b][0].parameters(), strict=True)
        return max(float((x.detach() - y.detach()).abs().max()) for x, y in pairs)

    worst = max(largest_difference(name, "plain") for name in names)
    print(f"after {args.steps} steps, the largest difference of any variant's parameters "
          f"from plain DDP's: {worst:.3g}")  # fmt: skip
    dist.destroy_process_group()
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
