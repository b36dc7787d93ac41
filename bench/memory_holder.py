"""A process that holds MIB MiB of memory for a checkpoint benchmark:

    python bench/memory_holder.py WORK MIB

It fills its memory, writes its PID to ``WORK/ready``, waits for ``WORK/go`` (dumped and
restored meanwhile), then reads all its memory again and writes ``WORK/done``: whether the
memory's digest is unchanged, and the seconds that read took (``True 0.123``).
"""

import hashlib
import os
import sys
import time


def main() -> None:
    work, size = sys.argv[1], int(sys.argv[2]) << 20
    memory = bytearray(os.urandom(1 << 20)) * (size >> 20)
    digest = hashlib.sha256(memory).hexdigest()
    with open(f"{work}/ready.tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(f"{work}/ready.tmp", f"{work}/ready")
    while not os.path.exists(f"{work}/go"):
        time.sleep(0.005)
    started = time.monotonic()
    same = hashlib.sha256(memory).hexdigest() == digest
    with open(f"{work}/done.tmp", "w") as out:
        out.write(f"{same} {time.monotonic() - started:.3f}")
    os.rename(f"{work}/done.tmp", f"{work}/done")


if __name__ == "__main__":
    main()
