"""The CUDA driver's process checkpoint API, through ``cuda-bindings``.

Before CRIU dumps a process that holds GPU state, its agent locks the process's CUDA calls
and checkpoints its GPU memory into the process's host memory (the process keeps its
mappings; its GPU memory is released); after CRIU restores it, the target node's agent
restores the GPU state (onto another GPU when the UUIDs differ) and unlocks it. The API needs
CUDA 12.8 (driver branch r570) or newer and is called from another process than the one
checkpointed (here: the agents).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_TIMEOUT_MS = 10_000
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")  # there when the NVIDIA driver is loaded


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
    # the checkpointing process sees every GPU of the machine (a restore names the GPU the
    # process left and the one it goes to); CUDA reads the variable once, in cuInit
    hidden = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        (err,) = driver.cuInit(0)
    finally:
        if hidden is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden
    _check(driver, err, "cuInit")
    return driver


def _check(driver: Any, err: Any, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GpuCheckpointError(f"{what} failed: {getattr(err, 'name', err)}")


def _uuid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(text.strip().replace("-", "").removeprefix("GPU"))
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {text!r}")
    return raw


def canonical_uuid(text: str) -> str:
    """A GPU UUID as nvidia-smi writes it (``GPU-xxxxxxxx-…``), from that form or PyTorch's."""
    raw = _uuid_bytes(text).hex()
    return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def _set_uuid(driver: Any, struct: Any, name: str, text: str) -> None:
    """``struct.name = CUuuid(text)``: a CUuuid's bytes cannot be assigned, so it is made over
    a buffer holding them; the assignment copies them into ``struct``."""
    raw = _uuid_bytes(text)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    setattr(struct, name, driver.CUuuid(ctypes.addressof(buffer)))
    if bytes(getattr(struct, name).bytes)[: len(raw)] != raw:
        raise GpuCheckpointError(f"could not pass GPU UUID {text} to the driver")


def device_uuid(ordinal: int) -> str:
    """The UUID (``GPU-xxxxxxxx-…``) of CUDA device ``ordinal`` as a process started with this
    process's ``CUDA_VISIBLE_DEVICES`` numbers its devices (an entry may be a UUID)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        if not 0 <= ordinal < len(visible):
            raise GpuCheckpointError(f"no CUDA device {ordinal} in CUDA_VISIBLE_DEVICES="
                                     f"{os.environ['CUDA_VISIBLE_DEVICES']!r}")  # fmt: skip
        if visible[ordinal].upper().startswith("GPU-"):
            return canonical_uuid(visible[ordinal][4:])
        ordinal = int(visible[ordinal])
    with _as_checkpoint_error("reading the UUID of"):
        driver = _driver()
        err, device = driver.cuDeviceGet(ordinal)
        _check(driver, err, f"cuDeviceGet({ordinal})")
        err, uuid = driver.cuDeviceGetUuid(device)
        _check(driver, err, "cuDeviceGetUuid")
        return canonical_uuid(bytes(uuid.bytes).hex())


def stack_size() -> int:
    """The per-thread stack size (bytes) of the calling thread's current CUDA context: what
    the context's local memory is sized by (2048 threads an SM times this)."""
    with _as_checkpoint_error("reading the stack size of"):
        driver = _driver()
        err, size = driver.cuCtxGetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE)
        _check(driver, err, "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)")
        return int(size)


def set_stack_size(size: int) -> None:
    """Size the calling thread's current context's local memory anew for ``size`` bytes a
    thread (the driver grows it again for a kernel that needs more)."""
    with _as_checkpoint_error("setting the stack size of"):
        driver = _driver()
        (err,) = driver.cuCtxSetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE, size)
        _check(driver, err, f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {size})")


def machine_gpus() -> list[str]:
    """The UUIDs of every GPU of this machine, in CUDA's order."""
    with _as_checkpoint_error("listing the GPUs for"):
        driver = _driver()
        err, count = driver.cuDeviceGetCount()
        _check(driver, err, "cuDeviceGetCount")
        uuids = []
        for ordinal in range(count):
            err, device = driver.cuDeviceGet(ordinal)
            _check(driver, err, f"cuDeviceGet({ordinal})")
            err, uuid = driver.cuDeviceGetUuid(device)
            _check(driver, err, "cuDeviceGetUuid")
            uuids.append(canonical_uuid(bytes(uuid.bytes).hex()))
        return uuids


def node_gpus() -> list[str]:
    """The UUIDs of the GPUs this node's workers see (``CUDA_VISIBLE_DEVICES``, in its order);
    empty on a machine without NVIDIA GPUs or without cuda-bindings."""
    if not NVIDIA_GPUS_DIR.is_dir():
        return []
    try:
        every = machine_gpus()
    except GpuCheckpointError:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return every
    gpus = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.upper().startswith("GPU-"):
            gpus.append(canonical_uuid(entry[4:]))
        elif entry.isdigit() and int(entry) < len(every):
            gpus.append(every[int(entry)])
        else:
            break  # CUDA stops at the first entry it cannot use
    return gpus


def restore_pairs(moving: str, target: str, before: list[str], here: list[str]) -> dict[str, str]:
    """Where each GPU of the machine a process left goes on this machine's: ``moving`` onto
    ``target``, every other one onto a GPU of its own (itself where it is here too). The
    driver restores onto other GPUs only given a pair for every GPU the process knew (all of
    its machine's, whatever ``CUDA_VISIBLE_DEVICES`` said) and, measured, a one-to-one map."""
    moving, target = canonical_uuid(moving), canonical_uuid(target)
    before = [canonical_uuid(u) for u in before] or [moving]
    if moving not in before:
        before = [moving, *before]
    if moving == target:
        return {}
    pairs = {moving: target}
    free = [u for u in here if u != target]
    rest = [u for u in before if u != moving]
    for old in [u for u in rest if u in free]:  # the GPUs both machines have stay put
        pairs[old] = old
        free.remove(old)
    for old in [u for u in rest if u not in pairs]:
        if not free:
            raise GpuCheckpointError(f"this machine has too few GPUs ({len(here)}) for a "
                                     f"process from one with {len(before)}")  # fmt: skip
        pairs[old] = free.pop(0)
    return pairs


_nvml_lock = threading.Lock()
_nvml: Any = None  # pynvml, initialised once for this process's life (None: not yet)


def _nvml_module() -> Any:
    """pynvml, initialised on first use and kept so: initialising and shutting NVML down
    around each query cost a move's downtime about 40 ms of its 50 (one H200)."""
    global _nvml
    with _nvml_lock:
        if _nvml is None:
            import pynvml

            pynvml.nvmlInit()
            _nvml = pynvml
        return _nvml


def process_gpu_bytes(pid: int, gpu: str) -> int | None:
    """GPU memory that process ``pid`` holds on ``gpu`` (NVML, from nvidia-ml-py); None
    where NVML is not at hand."""
    try:
        nvml = _nvml_module()
    except ImportError:
        return None
    except Exception:  # NVMLError: no driver, or NVML unusable here
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(canonical_uuid(gpu))
        for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return 0
    except nvml.NVMLError:
        return None


def warm_nvml() -> None:
    """Initialise NVML ahead of a move (on a machine with NVIDIA GPUs), so the move does not."""
    if NVIDIA_GPUS_DIR.is_dir():
        with contextlib.suppress(Exception):
            _nvml_module()


@contextlib.contextmanager
def _as_checkpoint_error(what: str) -> Iterator[None]:
    """Whatever goes wrong in the bindings is a GpuCheckpointError to the caller."""
    try:
        yield
    except GpuCheckpointError:
        raise
    except Exception as exc:
        raise GpuCheckpointError(f"{what} GPU state: {type(exc).__name__}: {exc}") from exc


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
        with _as_checkpoint_error("checkpointing"):
            return self._save()

    def load(self, remap: dict[str, str] | None = None) -> float:
        """Put the GPU memory back (onto other GPUs where ``remap`` maps old to new UUIDs;
        where one moves, the driver wants a pair for every GPU the process used), then unlock
        the process."""
        with _as_checkpoint_error("restoring"):
            return self._load(remap)

    def _save(self) -> float:
        driver = _driver()
        lock = driver.CUcheckpointLockArgs()
        lock.timeoutMs = LOCK_TIMEOUT_MS
        self._timed("lock", lambda d: d.cuCheckpointProcessLock, lock)
        self._timed("checkpoint", lambda d: d.cuCheckpointProcessCheckpoint, None)
        return self.times["lock"] + self.times["checkpoint"]

    def _load(self, remap: dict[str, str] | None) -> float:
        driver = _driver()
        args = None
        pairs = list((remap or {}).items())
        if any(old != new for old, new in pairs):
            args = driver.CUcheckpointRestoreArgs()
            gpu_pairs = []
            for old, new in pairs:
                pair = driver.CUcheckpointGpuPair()
                _set_uuid(driver, pair, "oldUuid", old)
                _set_uuid(driver, pair, "newUuid", new)
                gpu_pairs.append(pair)
            args.gpuPairs = gpu_pairs
            args.gpuPairsCount = len(gpu_pairs)
        self._timed("restore", lambda d: d.cuCheckpointProcessRestore, args)
        self._timed("unlock", lambda d: d.cuCheckpointProcessUnlock, None)
        return self.times["restore"] + self.times["unlock"]
