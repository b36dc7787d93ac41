"""A gate on the GPU: the framework's work that reads a collective's result waits on the GPU,
not on the host, until the proxy knows the collective has ended well.

The proxy completes a gated op's future at once, on a gate stream that waits
(``cuStreamWaitValue32``) until a counter in pinned host memory reaches the op's number; the
number is written once the collective has finished without error (``release``: by the host,
once whatever the releasing thread did to the op's outputs is done). The CPU
runs ahead as with a plain process group; a collective a fault breaks leaves its number
unwritten, and nothing that reads its output runs until a recovery has put the right values
in and released it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

# the ops whose futures go through the gate: DDP's bucket all-reduces. Others (DDP's layout
# broadcasts, read on the host at once; FSDP2's gathers) are completed once the GPU is done.
GATED_OPS = frozenset({"allreduce"})


class GateUnavailable(RuntimeError):
    """The driver API that a gate needs is missing here."""


class StreamGate:
    """One device's gate: a counter the GPU waits on, and the numbers handed out so far.

    ``hold`` and ``release`` are called in the order ops are issued and complete (one
    proxy's ops complete in issue order); the counter only grows, so releasing a number
    opens every gate up to it. The counter is 32 bits: 4 billion ops per proxy."""

    def __init__(self, device: torch.device) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:  # pragma: no cover - cuda-bindings is in the gpu extra
            raise GateUnavailable(f"cuda-bindings is not installed ({exc})") from None
        self._driver = driver
        self.device = device
        with torch.cuda.device(device):
            self._counter = torch.zeros(1, dtype=torch.int32).pin_memory()
            err, self._address = driver.cuMemHostGetDevicePointer(self._counter.data_ptr(), 0)
            _check(driver, err, "cuMemHostGetDevicePointer")
            self._word = ctypes.c_int32.from_address(self._counter.data_ptr())
            self.stream = dedicated_stream(device)
        self._lock = threading.Lock()
        self.issued = 0
        self.released = 0

    def hold(self) -> int:
        """The gate stream waits until the counter reaches the next number: that number."""
        driver = self._driver
        with self._lock:
            self.issued += 1
            number = self.issued
            (err,) = driver.cuStreamWaitValue32(
                driver.CUstream(self.stream.cuda_stream), self._address,
                driver.cuuint32_t(number), driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            )  # fmt: skip
        _check(driver, err, "cuStreamWaitValue32")
        return number

    def release(self, number: int, after: Any = None) -> None:
        """Open the gate up to ``number``, from the host, once the work ``after`` (a stream)
        has queued so far is done: a plain store into the pinned counter, no driver call.
        (A driver call can wait behind the framework's thread: an allocation there, while a
        gate is shut, holds the driver until the GPU's streams drain, and they wait for the
        gate. Measured: the release's ``cuStreamWriteValue32`` and an optimizer's first
        ``zeros_like`` waited for each other for good.)"""
        if after is not None:
            after.synchronize()
        with self._lock:
            self._word.value = max(self._word.value, number)
            self.released = max(self.released, number)

    @property
    def closed(self) -> bool:
        """Whether some number handed out is not released yet."""
        with self._lock:
            return self.released < self.issued


def _check(driver: Any, err: Any, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GateUnavailable(f"{what}: {err}")


def dedicated_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A stream that nothing else uses. Not ``torch.cuda.Stream()``: that hands out the
    streams of a pool of 32 in turn, which NCCL's communicators and the framework draw from
    too; a gate stream that is also the stream its opener writes on, or a communicator's,
    would wait for itself."""
    from cuda.bindings import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.init()
    # the driver API works on the calling thread's current context, and a thread that has
    # made no CUDA call yet (the proxy's waiter, a recovery's) has none: push the device's
    # primary context, the one torch works in, for the call
    err, cu_device = driver.cuDeviceGet(index)
    _check(driver, err, "cuDeviceGet")
    err, context = driver.cuDevicePrimaryCtxRetain(cu_device)
    _check(driver, err, "cuDevicePrimaryCtxRetain")
    (err,) = driver.cuCtxPushCurrent(context)
    _check(driver, err, "cuCtxPushCurrent")
    try:
        err, stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
        _check(driver, err, "cuStreamCreate")
    finally:
        driver.cuCtxPopCurrent()
    _KEPT_STREAMS.append(stream)  # for the process's lifetime: streams are few
    return torch.cuda.ExternalStream(int(stream), device=torch.device("cuda", index))


_KEPT_STREAMS: list[Any] = []
_SIDE_STREAMS: dict[tuple[int, str], torch.cuda.ExternalStream] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(device: torch.device, role: str) -> torch.cuda.ExternalStream:
    """A stream of this process's own for ``role`` (the proxy's waiter, a recovery): work
    outside the framework's step must not queue on the framework's stream, which a closed
    gate may hold."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get((index, role))
        if stream is None:
            stream = _SIDE_STREAMS[(index, role)] = dedicated_stream(torch.device("cuda", index))
        return stream
