"""The GPU's idle gaps read from a synthetic profiler trace (``bench/trace_gaps.py``)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import trace_gaps  # noqa: E402


def _event(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


EVENTS = [
    _event("kernel", "a", 0, 100, tid=0),
    _event("gpu_memcpy", "b", 50, 100, tid=0),  # overlaps a: no gap between them
    _event("kernel", "c", 400, 10, tid=0),  # 250 us after b ends
    _event("kernel", "d", 420, 10, tid=0),  # 10 us: under the threshold
    _event("python_function", "step", 100, 350),  # the thread that launches most (1)
    _event("python_function", "boundary", 120, 200),  # inside step
    _event("cpu_op", "aten::copy_", 200, 20),  # inside boundary: the innermost
    _event("cuda_runtime", "cudaLaunchKernel", 390, 5),
    _event("cuda_runtime", "cudaLaunchKernel", 415, 5),
    _event("python_function", "waiter", 100, 400, tid=2),  # another thread, all along
    _event("cuda_runtime", "cudaLaunchKernel", 600, 5, tid=2),
]


def test_gaps_between_overlapping_kernels():
    assert trace_gaps.gpu_gaps(EVENTS, 50) == [(150, 400)]
    assert trace_gaps.overlapping(EVENTS, 150, 400)["[python_function] boundary"] == 170


def test_what_a_thread_did_in_a_gap_is_its_innermost_event_at_each_instant():
    assert trace_gaps.launching_thread(EVENTS) == 1
    threads = trace_gaps.by_thread(EVENTS)
    assert trace_gaps.innermost(threads[1], 150, 400) == {
        "[python_function] boundary": 50 + 100,  # 150-200, 220-320
        "[cpu_op] aten::copy_": 20,  # 200-220
        "[python_function] step": 70 + 5,  # 320-390, 395-400
        "[cuda_runtime] cudaLaunchKernel": 5,  # 390-395
    }
    assert trace_gaps.innermost(threads[2], 150, 400) == {"[python_function] waiter": 250}


def test_a_summary_of_a_trace_file(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    summary = trace_gaps.summarize(trace, 50, 5)
    assert summary["gaps"] == 1
    assert summary["idle_ms"] == pytest.approx(0.25)
    assert summary["gpu_span_ms"] == pytest.approx(0.43)
    gap = summary["largest"][0]
    assert gap["at_ms"] == pytest.approx(0.15)
    assert gap["launching_thread"]["[python_function] boundary"] == 150
    assert gap["other_threads"] == {"[python_function] waiter": 250}
