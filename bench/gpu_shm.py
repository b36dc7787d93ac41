"""How fast a process can move its GPU memory out to a shared-memory file and back.

    python bench/gpu_shm.py --sizes-gib 1 4 16

The route to a fast migration (bench/results/gpu-speed.md): the worker copies its tensors into
a file in /dev/shm that it maps and registers with CUDA (pinned, so copies run at DMA speed),
frees its GPU memory, and CRIU then carries only the CPU side (it records a shared file
mapping by reference; it does not copy its pages). For each size: the file's creation and
first touch (paid once, ahead of need), its registration with ``cudaHostRegister``, the
copy from GPU to the file and back (twice: the second time is the one a migration pays),
and whether the bytes came back intact.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import torch


def timed_copy(target: torch.Tensor, source: torch.Tensor) -> float:
    started = time.perf_counter()
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def one(size_gib: float, folder: str) -> dict:
    size = int(size_gib * (1 << 30))
    path = os.path.join(folder, f"xmig-gpu-shm-{os.getpid()}")
    row: dict = {"gib": size_gib}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        host = torch.frombuffer(mapped, dtype=torch.uint8)
        host.fill_(0)  # the first touch: the VM grows its memory now, not in the downtime
        row["create_touch_s"] = time.perf_counter() - started
        cudart = torch.cuda.cudart()
        started = time.perf_counter()
        err = cudart.cudaHostRegister(host.data_ptr(), size, 0)
        row["register_s"] = time.perf_counter() - started
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: error {int(err)}")
        row["pinned"] = bool(host.is_pinned())
        gpu = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        digest = int(gpu[:: 1 << 20].to(torch.int64).sum())
        for label in ("out_first_s", "out_s"):
            row[label] = timed_copy(host, gpu)
        del gpu
        torch.cuda.empty_cache()
        back = torch.empty(size, dtype=torch.uint8, device="cuda")
        for label in ("in_first_s", "in_s"):
            row[label] = timed_copy(back, host)
        row["intact"] = int(back[:: 1 << 20].to(torch.int64).sum()) == digest
        del back
        torch.cuda.empty_cache()
        started = time.perf_counter()
        cudart.cudaHostUnregister(host.data_ptr())
        row["unregister_s"] = time.perf_counter() - started
        del host
        mapped.close()
    finally:
        os.close(fd)
        os.unlink(path)
    row["out_gbps"] = size / row["out_s"] / 1e9
    row["in_gbps"] = size / row["in_s"] / 1e9
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--folder", default="/dev/shm")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, folder {args.folder}")
    print(
        "| GiB | create + first touch s | register s | GPU → file s (first, again) | "
        "file → GPU s (first, again) | GB/s out, in | unregister s | intact |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes_gib:
        r = one(size, args.folder)
        print(f"| {size:g} | {r['create_touch_s']:.2f} | {r['register_s']:.3f} | "
              f"{r['out_first_s']:.3f}, {r['out_s']:.3f} | {r['in_first_s']:.3f}, "
              f"{r['in_s']:.3f} | {r['out_gbps']:.1f}, {r['in_gbps']:.1f} | "
              f"{r['unregister_s']:.3f} | {'yes' if r['intact'] else 'NO'} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
