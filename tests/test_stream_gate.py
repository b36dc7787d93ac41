"""The GPU gate's words (``xmig.proxy.gate.StreamGate``), with the driver's stream memory
operations recorded instead of queued: which word each op's gate waits on, for which
number, and where the host puts the words as gates are held, released, closed and
reopened. The GPU's side of it (that a wait on a word holds the stream) runs on the GPU
machine (``tests/test_gpu_gate.py``)."""

import contextlib
import ctypes
import threading
from types import SimpleNamespace

from xmig.proxy.gate import _COUNTER, _LIMIT, _PASSED, OPEN_AHEAD, StreamGate


class Driver:
    """The few driver calls a gate makes, recorded."""

    def __init__(self):
        self.calls = []
        self.CUstreamWaitValue_flags = SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0)
        self.CUstreamWriteValue_flags = SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0)
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=0)

    def CUstream(self, handle):  # noqa: N802 (the driver's name)
        return handle

    def cuuint32_t(self, value):
        return value

    def cuStreamWaitValue32(self, stream, address, value, flags):  # noqa: N802
        self.calls.append(("wait", address, value))
        return (0,)

    def cuStreamWriteValue32(self, stream, address, value, flags):  # noqa: N802
        self.calls.append(("write", address, value))
        return (0,)


def _gate():
    gate = object.__new__(StreamGate)
    gate._driver = Driver()
    gate.device = None
    gate._words = [ctypes.c_int32() for _ in range(3)]
    gate._addresses = [_COUNTER, _LIMIT, _PASSED]  # the calls name the words
    gate.stream = SimpleNamespace(cuda_stream=1)
    gate._on_gate_stream = contextlib.nullcontext
    gate._lock = threading.Lock()
    gate.issued = gate.released = 0
    gate._open, gate._reopen = True, False
    return gate


def _ends():
    waited = []
    return waited, lambda: waited.append(True)


def test_an_open_gate_waits_for_the_collective_on_the_gpu_and_keeps_its_limit_ahead():
    gate = _gate()
    waited, end = _ends()
    assert gate.hold(end) == 1 and gate.hold(end) == 2
    assert waited == [True, True]  # the gate stream waited for each collective's end
    assert gate._driver.calls == [("wait", _LIMIT, 1), ("write", _PASSED, 1),
                                  ("wait", _LIMIT, 2), ("write", _PASSED, 2)]  # fmt: skip
    assert gate._words[_LIMIT].value == 2 + OPEN_AHEAD
    gate.release(1)  # the host's bookkeeping: the limit is not lowered
    assert gate._words[_COUNTER].value == 1 and gate._words[_LIMIT].value == 2 + OPEN_AHEAD
    assert gate.closed  # number 2 is not released on the host yet


def test_an_op_without_an_end_waits_for_the_hosts_release():
    gate = _gate()
    gate.hold(None)
    assert gate._driver.calls[0] == ("wait", _COUNTER, 1)
    gate.release(1)
    assert gate._words[_COUNTER].value == 1 and not gate.closed


def test_a_closed_gate_lets_through_only_what_the_host_released_until_it_is_reopened():
    gate = _gate()
    waited, end = _ends()
    for _ in range(3):
        gate.hold(end)
    gate.release(1)
    assert gate.close() is True and gate.close() is False
    assert gate._words[_LIMIT].value == 1  # numbers 2 and 3 wait again
    gate.release(2)  # a drained or replayed op: its gate opens
    assert gate._words[_LIMIT].value == 2
    gate.hold(end)  # number 4, issued while closed: the host's release alone
    assert gate._driver.calls[-2] == ("wait", _COUNTER, 4) and len(waited) == 3
    gate.reopen()
    gate.hold(end)  # number 5: 3 and 4 are not released, so it stays on the host's
    assert gate._driver.calls[-2] == ("wait", _COUNTER, 5)
    gate.release(5)
    gate.hold(end)  # number 6: everything before it released, open again
    assert gate._driver.calls[-2] == ("wait", _LIMIT, 6)
    assert gate._words[_LIMIT].value == 6 + OPEN_AHEAD and len(waited) == 4


def test_passed_reads_the_word_the_gpu_writes():
    gate = _gate()
    gate._words[_PASSED].value = 7
    assert gate.passed == 7
