"""Where the proxy's steady-state cost on a GPU comes from, and what a GPU-side gate would buy.

    NCCL_NVLS_ENABLE=0 python bench/gpu_gate.py --preset gpt350m --batch-size 8 --steps 30

One process, one GPU, the demo GPT under DDP over a plain NCCL group of one rank, trained
with one DDP communication hook per variant, steps alternating between the variants (ABBA
order rotated) on identical copies of the model:

- ``plain``: DDP's own all-reduce (no hook).
- ``host``: what xmig's proxy does today: each bucket copied into a log, then all-reduced;
  the hook's future is completed by a polling thread once the GPU has finished the
  all-reduce. DDP's finalize, and so the optimizer, wait on the host: the CPU can no longer
  run ahead of the GPU, and the optimizer's own Python (before its first kernel) runs while
  the GPU is idle.
- ``gate``: the same log copy, but the future is completed at once, its completion event
  recorded on a gate stream held by ``cuStreamWaitValue32`` until a counter in pinned host
  memory reaches the op's number; the polling thread writes that counter once the
  all-reduce has finished without error. The CPU runs ahead as with plain DDP; the GPU
  waits only for the polling thread's latency. A fault would leave the counter unwritten:
  nothing that reads the bucket runs until a recovery has put the right values in.

Prints the median step time of each and the ratio to ``plain`` (median of paired ratios).
A prototype that measures the route, not xmig's code path.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train_gpt  # noqa: E402
from rotation import train_in_rotation  # noqa: E402

POLL_S = 20e-6


class Gate:
    """A counter in pinned host memory that streams wait on (``cuStreamWaitValue32``)."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.counter = torch.zeros(1, dtype=torch.int32).pin_memory()
        err, self.address = driver.cuMemHostGetDevicePointer(self.counter.data_ptr(), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemHostGetDevicePointer: {err}")
        self.stream = torch.cuda.Stream(device)
        self.issued = 0

    def hold(self) -> int:
        """Make the gate stream wait until the counter reaches the next number; that number."""
        self.issued += 1
        (err,) = self.driver.cuStreamWaitValue32(
            self.driver.CUstream(self.stream.cuda_stream),
            self.address,
            self.driver.cuuint32_t(self.issued),
            self.driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
        )
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWaitValue32: {err}")
        return self.issued

    def release(self, number: int) -> None:
        self.counter[0] = number


class Poller:
    """One thread that completes ops in order once their GPU work has finished."""

    def __init__(self) -> None:
        self.queue: deque = deque()
        self.cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def put(self, work: dist.Work, done) -> None:
        with self.cv:
            self.queue.append((work, done))
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                work, done = self.queue[0]
            while not work.is_completed():
                time.sleep(POLL_S)
            with self.cv:
                self.queue.popleft()
            done()


def log_copy(pool: dict, bucket_index: int, tensor: torch.Tensor) -> None:
    saved = pool.get(bucket_index)
    if saved is None or saved.shape != tensor.shape:
        pool[bucket_index] = tensor.detach().clone()
    else:
        saved.copy_(tensor)


def host_hook(state, bucket):
    """xmig's path today: log, launch, complete once the GPU is done."""
    pool, poller, group, device = state
    tensor = bucket.buffer()
    log_copy(pool, bucket.index(), tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    future = torch.futures.Future(devices=[device])
    poller.put(work, lambda: future.set_result(tensor))
    return future


def gate_hook(state, bucket):
    """Log, launch, complete at once behind the gate."""
    pool, poller, group, device, gate = state
    tensor = bucket.buffer()
    log_copy(pool, bucket.index(), tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    number = gate.hold()
    future = torch.futures.Future(devices=[device])
    with torch.cuda.stream(gate.stream):
        future.set_result(tensor)
    poller.put(work, lambda: gate.release(number))
    return future


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args, model_args = parser.parse_known_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    gpt_args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(gpt_args)
    torch.manual_seed(gpt_args.seed)
    base = train_gpt.GPT(cfg).to(device)
    poller, gate = Poller(), Gate(device)
    variants = {}
    for name in ("plain", "host", "gate"):
        group = dist.new_group(backend="nccl")
        ddp = DistributedDataParallel(copy.deepcopy(base), process_group=group, device_ids=[0],
                                      bucket_cap_mb=gpt_args.bucket_cap_mb)  # fmt: skip
        if name == "host":
            ddp.register_comm_hook(({}, poller, group, device), host_hook)
        elif name == "gate":
            ddp.register_comm_hook(({}, poller, group, device, gate), gate_hook)
        variants[name] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=gpt_args.lr))
    names = list(variants)
    times = train_in_rotation(variants, args.steps, gpt_args, cfg, device)

    def differ(a: str, b: str) -> float:
        pairs = zip(variants[a][0].parameters(), variants[b][0].parameters(), strict=True)
        return max(float((x.detach() - y.detach()).abs().max()) for x, y in pairs)

    kept = {k: v[args.warmup :] for k, v in times.items()}
    for name in names:
        ratios = sorted(x / p for x, p in zip(kept[name], kept["plain"], strict=True))
        print(f"{name:6s} median {statistics.median(kept[name]) * 1000:8.2f} ms  ratio to plain "
              f"{statistics.median(ratios):.4f} (q1 {ratios[len(ratios) // 4]:.4f}, q3 "
              f"{ratios[3 * len(ratios) // 4]:.4f})")  # fmt: skip
    for a, b in (("host", "plain"), ("gate", "host"), ("gate", "plain")):
        print(f"after {args.steps} steps, largest difference {a} - {b}: {differ(a, b):.3g}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
