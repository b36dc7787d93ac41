"""What a moving worker leaves in its process's host memory for CRIU, and how it makes that less.

CRIU copies every page of anonymous memory the process has touched, twice (into the image,
and back into the restored process), at 1.2-1.8 GB/s on our GPU machine. Memory the process
no longer uses but still holds costs as much as memory it does: the C library's free heap
(large CPU tensors freed after a model was built on the CPU and moved to the GPU), and the
pinned host blocks PyTorch's allocator keeps for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def anonymous_bytes() -> int | None:
    """This process's anonymous resident memory (what CRIU's image carries), or None where
    the kernel does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def largest_anonymous_mappings(count: int) -> list[tuple[int, str]]:
    """This process's ``count`` mappings with the most anonymous memory, largest first: bytes,
    and the file mapped just before each (a library's own heap follows the library)."""
    found: list[tuple[int, str]] = []
    previous, current = "", ""
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split()
                if not fields:
                    continue
                if "-" in fields[0] and not fields[0].endswith(":"):
                    path = fields[5] if len(fields) > 5 else ""
                    current = path or f"anonymous, after {previous or '(nothing)'}"
                    if path.startswith("/"):
                        previous = Path(path).name
                elif fields[0] == "Anonymous:" and int(fields[1]):
                    found.append((int(fields[1]) * 1024, current))
    except (OSError, ValueError, IndexError):
        return []
    return sorted(found, reverse=True)[:count]


def trim_host_memory() -> None:
    """Give back the host memory this process holds but does not use: PyTorch's cached pinned
    blocks and the C library's free heap, so that a checkpoint does not carry them."""
    empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
    if empty_host_cache is None:  # torch before 2.12 has only the private name
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is not None and torch.cuda.is_initialized():
        try:
            empty_host_cache()
        except RuntimeError as exc:  # trimming is an optimization: it never stops a move
            logger.debug("emptying the pinned host cache failed: %s", exc)
    try:
        libc().malloc_trim(0)  # glibc: returns free heap pages to the kernel (not in musl)
    except (OSError, AttributeError) as exc:
        logger.debug("malloc_trim is not available: %s", exc)


def libc() -> ctypes.CDLL:
    """The C library (raises OSError where there is none to load)."""
    name = ctypes.util.find_library("c")
    if name is None:
        raise OSError("no C library found")
    return ctypes.CDLL(name, use_errno=True)
