"""The line every results file gives for the machine it was measured on (no torch import: the
control plane's stubs run without it)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    system = f"{os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB, Linux {platform.release()}"
    return f"{cpu}, {system}, Python {platform.python_version()}, torch {torch}"
