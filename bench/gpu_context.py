"""What a training process leaves on its GPU once its tensors are gone, and what the driver's
checkpoint of it costs: the base of every GPU migration (about 1.0 GB at every model size).

    NCCL_NVLS_ENABLE=0 python bench/gpu_context.py [--preset small] [--json OUT]

A child process goes through stages, each adding what a training rank holds: the CUDA
context, cuBLAS's handles (a matmul in bf16 and in fp32), an NCCL communicator of one rank
(made, used, then shut down), a model trained three steps and deleted, then what could be
given back before a checkpoint: cuBLAS's workspaces, and the context's local memory (its
stack size set to another value and back, so the driver sizes it anew). After each stage
this process reads the child's GPU memory (NVML) and its anonymous host memory, then locks
it, checkpoints its GPU state into its host memory (the bytes the driver moved are the
growth of its anonymous memory), restores and unlocks it. At the end the child checks a
tensor it kept through every trip. Bounded in time; the child is killed at the end.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from xmig.migrate import cuda  # noqa: E402

TIMEOUT_S = 240
STAGES = ["cublas", "nccl", "nccl_down", "train", "workspaces", "stack_anew"]
LIMITS = ["stack_16", "heap_0", "printf_0", "launches_0"]

CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
stages = sys.argv[2].split(",")
model_args = sys.argv[3:]
import torch

device = torch.device("cuda", 0)
kept = torch.arange(1 << 20, dtype=torch.int64, device=device)
expected = int(kept.sum())


def report(stage):
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    print(json.dumps({"stage": stage, "used": total - free,
                      "reserved": torch.cuda.memory_reserved(device),
                      "allocated": torch.cuda.memory_allocated(device),
                      "stack_size": limit("STACK_SIZE")}), flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)


def limit(name, value=None):
    from cuda.bindings import driver
    which = getattr(driver.CUlimit, "CU_LIMIT_" + name)
    if value is not None:
        (err,) = driver.cuCtxSetLimit(which, value)
        if int(err) != 0:
            return f"refused: {err}"
    err, got = driver.cuCtxGetLimit(which)
    return int(got) if int(err) == 0 else f"unreadable: {err}"


def cublas():
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(4096, 4096, device=device, dtype=dtype)
        (a @ a).sum().item()
        del a
    torch.cuda.empty_cache()
    return "cuBLAS used"


def nccl():
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    x = torch.ones(16 << 20, device=device)
    dist.all_reduce(x)
    del x
    torch.cuda.empty_cache()
    return "NCCL communicator"


def nccl_down():
    import torch.distributed as dist
    dist.destroy_process_group()
    torch.cuda.empty_cache()
    return "NCCL shut down"


def train():
    import train_gpt
    args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(args)
    torch.manual_seed(args.seed)
    model = train_gpt.GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(3):
        xb, yb = train_gpt.synthetic_batch(args.seed, step, 0, args.batch_size,
                                           cfg.block_size, cfg.vocab_size, device)
        loss = model(xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    del model, optimizer, xb, yb, loss
    torch.cuda.empty_cache()
    return "trained, tensors deleted"


def workspaces():
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return "cuBLAS workspaces cleared"


def stack_anew():
    stack = limit("STACK_SIZE")
    limit("STACK_SIZE", stack + 1024)
    limit("STACK_SIZE", stack)
    return f"stack size set anew ({stack} B)"


def setter(name, value):
    def apply():
        was = limit(name)
        now = limit(name, value)
        return f"{name} {was} -> {now}"
    return apply


steps = {"cublas": cublas, "nccl": nccl, "nccl_down": nccl_down, "train": train,
         "workspaces": workspaces, "stack_anew": stack_anew,
         "stack_16": setter("STACK_SIZE", 16), "heap_0": setter("MALLOC_HEAP_SIZE", 0),
         "printf_0": setter("PRINTF_FIFO_SIZE", 0),
         "launches_0": setter("DEV_RUNTIME_PENDING_LAUNCH_COUNT", 0)}
report("context")
for name in stages:
    report(steps[name]())
print("ok" if int(kept.sum()) == expected else "CORRUPT", flush=True)
"""


def anonymous_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Anonymous line for PID {pid}")


def unlock(pid: int) -> None:
    """A locked process whose checkpoint failed goes on."""
    from cuda.bindings import driver

    (err,) = driver.cuCheckpointProcessUnlock(pid, None)
    if int(err) != 0:
        raise RuntimeError(f"PID {pid} stays locked: {err}")


def run(stages: list[str], model_args: list[str]) -> tuple[list[dict], str]:
    gpu = cuda.device_uuid(0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(HERE.parent / "examples"), ",".join(stages), *model_args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    output = child.stdout
    deadline = time.monotonic() + TIMEOUT_S

    def pump() -> None:
        for text in output:
            lines.put(text)
        lines.put("")

    def line() -> str:
        try:
            return lines.get(timeout=max(0.1, deadline - time.monotonic())).strip()
        except queue.Empty:
            raise RuntimeError(f"the child said nothing within {TIMEOUT_S} s") from None

    threading.Thread(target=pump, daemon=True).start()
    rows = []
    try:
        while True:
            text = line()
            if not text.startswith("{"):
                return rows, text or f"the child ended with {child.wait(timeout=30)}"
            row = json.loads(text)
            row["nvml"] = cuda.process_gpu_bytes(child.pid, gpu)
            before = anonymous_bytes(child.pid)
            checkpoint = cuda.GpuCheckpoint(child.pid)
            try:
                checkpoint.save()
            except cuda.GpuCheckpointError as exc:  # e.g. a live communicator's memory
                row["error"] = str(exc)
                if "lock" in checkpoint.times:
                    unlock(child.pid)
                rows.append(row)
                print(f"{row['stage']:<36} used {row['used'] / 1e9:6.3f} GB  {exc}", flush=True)
                child.stdin.write("go\n")
                child.stdin.flush()
                continue
            row["moved"] = anonymous_bytes(child.pid) - before
            row["nvml_checkpointed"] = cuda.process_gpu_bytes(child.pid, gpu)
            checkpoint.load()
            row.update({f"{k}_s": round(v, 4) for k, v in checkpoint.times.items()})
            rows.append(row)
            print(
                f"{row['stage']:<36} used {row['used'] / 1e9:6.3f} GB  NVML "
                f"{(row['nvml'] or 0) / 1e9:6.3f} GB  reserved {row['reserved'] / 1e9:6.3f} GB  "
                f"moved {row['moved'] / 1e9:6.3f} GB  checkpoint {row['checkpoint_s']:.3f} s  "
                f"restore {row['restore_s']:.3f} s  stack {row['stack_size']}",
                flush=True,
            )
            child.stdin.write("go\n")
            child.stdin.flush()
    finally:
        child.kill()
        child.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="after the context, in order (comma-separated): "
                        + ", ".join(STAGES + LIMITS))  # fmt: skip
    args, model_args = parser.parse_known_args()
    if not model_args:
        model_args = ["--preset", "small"]
    rows, verdict = run(args.stages.split(","), model_args)
    print(f"kept tensor after {len(rows)} trips: {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "verdict": verdict,
                                         "env": {k: v for k, v in os.environ.items()
                                                 if k.startswith(("NCCL_", "CUDA_"))}},
                                        indent=1))  # fmt: skip
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
