"""The CUDA driver's process checkpoint API, through ``cuda-bindings``.

Before CRIU dumps a process that holds GPU state, its agent locks the process's CUDA calls
and checkpoints its GPU memory into the process's host memory (the process keeps its
mappings; its GPU memory is released); after CRIU restores it, the target node's agent
restores the GPU state (onto another GPU when the UUIDs differ) and unlocks it. The API needs
CUDA 12.8 (driver branch r570) or newer and is called from another process than the one
checkpointed (here: the agents).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

LOCK_TIMEOUT_MS = 10_000


class GpuCheckpointError(RuntimeError):
    """A CUDA checkpoint call failed (or the API is missing here)."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise GpuCheckpointError(
            "cuda-bindings is not installed (pip install cuda-bindings): needed to move a "
            "process that holds GPU state"
        ) from exc
    if not hasattr(driver, "cuCheckpointProcessRestore"):
        raise GpuCheckpointError("this cuda-bindings has no cuCheckpointProcessRestore")
    (err,) = driver.cuInit(0)
    _check(driver, err, "cuInit")
    return driver


def _check(driver: Any, err: Any, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GpuCheckpointError(f"{what} failed: {getattr(err, 'name', err)}")


def _uuid(driver: Any, text: str) -> Any:
    uuid = driver.CUuuid()
    uuid.bytes = bytes.fromhex(text.replace("-", "").removeprefix("GPU"))
    return uuid


def device_uuid(ordinal: int) -> str:
    """The UUID (``GPU-xxxxxxxx-…``) of this process's CUDA device ``ordinal``."""
    driver = _driver()
    err, device = driver.cuDeviceGet(ordinal)
    _check(driver, err, f"cuDeviceGet({ordinal})")
    err, uuid = driver.cuDeviceGetUuid(device)
    _check(driver, err, "cuDeviceGetUuid")
    raw = bytes(uuid.bytes).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


@dataclass
class GpuCheckpoint:
    """Timings of one process's trip through the checkpoint API (seconds)."""

    pid: int
    times: dict[str, float] = field(default_factory=dict)

    def _timed(self, what: str, call: Any, *args: Any) -> None:
        driver = _driver()
        started = time.monotonic()
        (err,) = call(driver)(self.pid, *args)
        _check(driver, err, f"{what} of PID {self.pid}")
        self.times[what] = time.monotonic() - started

    def save(self) -> float:
        """Lock the process's CUDA calls, then move its GPU memory into host memory."""
        driver = _driver()
        lock = driver.CUcheckpointLockArgs()
        lock.timeoutMs = LOCK_TIMEOUT_MS
        self._timed("lock", lambda d: d.cuCheckpointProcessLock, lock)
        self._timed("checkpoint", lambda d: d.cuCheckpointProcessCheckpoint, None)
        return self.times["lock"] + self.times["checkpoint"]

    def load(self, remap: dict[str, str] | None = None) -> float:
        """Put the GPU memory back (onto other GPUs where ``remap`` maps old to new UUIDs),
        then unlock the process."""
        driver = _driver()
        args = None
        pairs = [(old, new) for old, new in (remap or {}).items() if old != new]
        if pairs:
            args = driver.CUcheckpointRestoreArgs()
            gpu_pairs = []
            for old, new in pairs:
                pair = driver.CUcheckpointGpuPair()
                pair.oldUuid, pair.newUuid = _uuid(driver, old), _uuid(driver, new)
                gpu_pairs.append(pair)
            args.gpuPairs = gpu_pairs
            args.gpuPairsCount = len(gpu_pairs)
        self._timed("restore", lambda d: d.cuCheckpointProcessRestore, args)
        self._timed("unlock", lambda d: d.cuCheckpointProcessUnlock, None)
        return self.times["restore"] + self.times["unlock"]
