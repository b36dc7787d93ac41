"""A stand-in for a cooperating worker (used by ``bench/gpu_shm_criu.sh``).

    python bench/gpu_shm_hold.py GIB SHM_FILE FLAG

Puts GIB GiB of random bytes on the GPU, copies them into SHM_FILE (mapped shared and
registered with CUDA), frees that GPU memory (a small tensor stays, so that the driver's
checkpoint has a context with memory in it), prints ``ready pid P out S``, and waits for
FLAG + ".go" to exist: by then it may have been checkpointed and restored. It then copies the
bytes back onto the GPU and writes to FLAG + ".done" how long that took and whether every
byte came back.
"""

import mmap
import os
import sys
import time

import torch


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 30))
    path, flag = sys.argv[2], sys.argv[3]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    host = torch.frombuffer(mapped, dtype=torch.uint8)
    host.fill_(0)
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister: error {int(err)}")
    gpu = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    digest = int(gpu[:: 1 << 20].to(torch.int64).sum())
    small = torch.ones(1000, device="cuda")
    started = time.perf_counter()
    host.copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    out = time.perf_counter() - started
    del gpu
    torch.cuda.empty_cache()
    print(f"ready pid {os.getpid()} out {out:.3f}", flush=True)
    while not os.path.exists(flag + ".go"):
        time.sleep(0.05)
    started = time.perf_counter()
    back = torch.empty(size, dtype=torch.uint8, device="cuda")
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    copied_in = time.perf_counter() - started
    intact = int(back[:: 1 << 20].to(torch.int64).sum()) == digest and float(small.sum()) == 1000
    with open(flag + ".done", "w") as out_file:
        out_file.write(f"in {copied_in:.3f} intact {intact}\n")


if __name__ == "__main__":
    main()
