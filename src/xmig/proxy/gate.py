"""A gate on the GPU: the framework's work that reads a collective's result waits on the GPU,
not on the host, until the collective has ended well.

The proxy completes a gated op's future at once, on a gate stream. There the op's gate is a
wait (``cuStreamWaitValue32``) on a word in pinned host memory:

- **open** (as long as no fault is being handled): the gate stream first waits, on the GPU,
  for the collective's end, and the word (the *limit*) is kept ahead of every number handed
  out, so the framework's work runs as soon as the collective has ended, as with a plain
  process group; no host thread stands between them.
- **closed** (``close``, at a recovery's start, before any communicator is aborted): the
  limit drops to the numbers the host has seen end well (``release``), so an op whose
  collective an abort ends, its output half-written, stays behind its gate until a
  recovery has put the right values in and released it. What the GPU let through before
  the close (``passed``, a word the gate stream writes after each gate) had ended before any
  abort, so well.

An op whose failure is known to come later (an injected fault) is gated on the host's
release alone (``hold(end=None)``). The CPU runs ahead as with a plain process group.
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
# DDP's buffer broadcasts at each forward, gated too, measured no gain on an H100 in two
# sessions (``bench/results/gpu-speed.md``), so they are not.
GATED_OPS = frozenset({"allreduce"})


class GateUnavailable(RuntimeError):
    """The driver API that a gate needs is missing here."""


# how far ahead of the newest number an open gate's limit stands: the wait compares
# cyclically, (int32)(word - number) >= 0, so the limit must stay within 2**31 of the
# numbers still waiting
OPEN_AHEAD = 1 << 29
# after a close, how long the host lets a wait the GPU was already passing write its number
# before it reads ``passed`` (a write that follows a passed wait in the same stream takes
# microseconds)
CLOSE_SETTLE_S = 0.005
_COUNTER, _LIMIT, _PASSED = 0, 1, 2  # the words: the host's releases, the limit, the GPU's


class StreamGate:
    """One device's gate: the words the GPU waits on and writes, and the numbers handed out
    so far.

    ``hold`` and ``release`` are called in the order ops are issued and complete (one
    proxy's ops complete in issue order); the words only grow while open, so releasing a
    number opens every gate up to it. The words are 32 bits: 1.5 billion ops per proxy."""

    def __init__(self, device: torch.device) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:  # pragma: no cover - cuda-bindings is in the gpu extra
            raise GateUnavailable(f"cuda-bindings is not installed ({exc})") from None
        self._driver = driver
        self.device = device
        with torch.cuda.device(device):
            self._memory = torch.zeros(3, dtype=torch.int32).pin_memory()
            err, address = driver.cuMemHostGetDevicePointer(self._memory.data_ptr(), 0)
            _check(driver, err, "cuMemHostGetDevicePointer")
            self._addresses = [driver.CUdeviceptr(int(address) + 4 * i) for i in range(3)]
            self._words = [ctypes.c_int32.from_address(self._memory.data_ptr() + 4 * i)
                           for i in range(3)]  # fmt: skip
            self.stream = dedicated_stream(device)
        self._lock = threading.Lock()
        self.issued = 0
        self.released = 0
        self._open = True
        self._reopen = False

    def hold(self, end: Any = None) -> int:
        """The gate stream waits until the next number may pass: that number. ``end``, made
        to run on the gate stream, makes it wait for the collective's end on the GPU; while
        the gate is open, nothing else is waited for. Without ``end``, or closed, the number
        passes once the host has released it."""
        driver = self._driver
        stream = driver.CUstream(self.stream.cuda_stream)
        with self._lock:
            self.issued += 1
            number = self.issued
            if not self._open and self._reopen and self.released == number - 1:
                self._open, self._reopen = True, False
            on_gpu = self._open and end is not None
            if on_gpu:
                self._words[_LIMIT].value = number + OPEN_AHEAD
                with self._on_gate_stream():
                    end()
            word = _LIMIT if on_gpu else _COUNTER
            (err,) = driver.cuStreamWaitValue32(
                stream, self._addresses[word], driver.cuuint32_t(number),
                driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
            )  # fmt: skip
            _check(driver, err, "cuStreamWaitValue32")
            (err,) = driver.cuStreamWriteValue32(
                stream, self._addresses[_PASSED], driver.cuuint32_t(number),
                driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
            )  # fmt: skip
        _check(driver, err, "cuStreamWriteValue32")
        return number

    def _on_gate_stream(self) -> Any:
        return torch.cuda.stream(self.stream)

    def release(self, number: int, after: Any = None) -> None:
        """Open the gate up to ``number``, from the host, once the work ``after`` (a stream)
        has queued so far is done: a plain store into the pinned words, no driver call.
        (A driver call can wait behind the framework's thread: an allocation there, while a
        gate is shut, holds the driver until the GPU's streams drain, and they wait for the
        gate. Measured: the release's ``cuStreamWriteValue32`` and an optimizer's first
        ``zeros_like`` waited for each other for good.)"""
        if after is not None:
            after.synchronize()
        with self._lock:
            self._words[_COUNTER].value = max(self._words[_COUNTER].value, number)
            if not self._open:
                self._words[_LIMIT].value = max(self._words[_LIMIT].value, number)
            self.released = max(self.released, number)

    def close(self) -> bool:
        """Let no number pass on the GPU beyond what the host has released (a recovery
        begins: communicators may be aborted from now on). Whether the gate was open."""
        with self._lock:
            was_open, self._open, self._reopen = self._open, False, False
            self._words[_LIMIT].value = self.released
        return was_open

    def reopen(self) -> None:
        """Open again from the next number on whose earlier numbers are all released (a
        recovery ended)."""
        with self._lock:
            self._reopen = not self._open

    @property
    def passed(self) -> int:
        """The last number the GPU let through (read after a close has settled)."""
        return self._words[_PASSED].value

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
