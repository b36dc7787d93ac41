"""Where the GPU waits: its idle gaps in a Chrome trace of ``torch.profiler``, and what the
CPU was running meanwhile.

    python bench/trace_gaps.py TRACE.json [--min-us 50] [--top 10]

For each gap of at least ``--min-us`` between the GPU's kernels and copies (the largest
first), what the CPU was doing meanwhile, by how much of the gap each covers: the innermost
events of the thread that launched the most kernels (in a training step, autograd's, not
necessarily the step loop's), and of the other threads.
Python frames appear when the trace was taken with ``with_stack=True`` (``bench/proxy_overhead.py
--trace DIR --stack``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CATEGORIES = {"cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver"}


def gpu_gaps(events: list[dict], min_us: float) -> list[tuple[float, float]]:
    """The intervals (start, end) of at least ``min_us`` in which no GPU work ran, between
    the trace's first and last GPU event."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events
                   if e.get("cat") in GPU_CATEGORIES)  # fmt: skip
    gaps: list[tuple[float, float]] = []
    end = None
    for start, stop in spans:
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def overlapping(events: list[dict], start: float, end: float) -> dict[str, float]:
    """The CPU events overlapping ``[start, end]``: name -> microseconds of overlap."""
    covered: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") not in CPU_CATEGORIES or e.get("ph") != "X":
            continue
        s, d = e["ts"], e.get("dur", 0.0)
        overlap = min(end, s + d) - max(start, s)
        if overlap > 0:
            covered[f"[{e['cat']}] {e['name']}"] += overlap
    return covered


def launching_thread(events: list[dict]) -> object:
    """The thread that launched the most kernels (in a training step: autograd's)."""
    launches: dict[object, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "cuda_runtime" and "Launch" in e.get("name", ""):
            launches[e.get("tid")] += 1
    return max(launches, key=launches.__getitem__) if launches else None


def by_thread(events: list[dict]) -> dict[object, list[dict]]:
    """The CPU events of each thread."""
    found: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in CPU_CATEGORIES and e.get("ph") == "X":
            found[e.get("tid")].append(e)
    return found


def innermost(events: list[dict], start: float, end: float) -> dict[str, float]:
    """What one thread was doing in ``[start, end]``: at each instant the innermost of its
    events then (events of one thread nest), as name -> microseconds."""
    active = [e for e in events if e["ts"] < end and e["ts"] + e.get("dur", 0.0) > start]
    cuts = sorted({start, end} | {t for e in active for t in (e["ts"], e["ts"] + e.get("dur", 0.0))
                                  if start < t < end})  # fmt: skip
    covered: dict[str, float] = defaultdict(float)
    for left, right in zip(cuts, cuts[1:], strict=False):
        inside = [e for e in active if e["ts"] <= left and e["ts"] + e.get("dur", 0.0) >= right]
        if inside:
            # the innermost: the one that began last (the shortest, of two that began together)
            e = max(inside, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
            covered[f"[{e['cat']}] {e['name']}"] += right - left
    return covered


def summarize(trace: Path, min_us: float, top: int) -> dict:
    events = json.loads(trace.read_text())["traceEvents"]
    gaps = gpu_gaps(events, min_us)
    spans = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    first = min(e["ts"] for e in spans) if spans else 0.0
    last = max(e["ts"] + e.get("dur", 0.0) for e in spans) if spans else 0.0
    largest = sorted(gaps, key=lambda g: g[1] - g[0], reverse=True)[:top]
    main = launching_thread(events)
    threads = by_thread(events)
    return {
        "trace": str(trace),
        "gpu_span_ms": (last - first) / 1000,
        "gaps": len(gaps),
        "idle_ms": sum(e - s for s, e in gaps) / 1000,
        "largest": [
            {
                "at_ms": (s - first) / 1000,
                "gap_us": e - s,
                "launching_thread": _top(innermost(threads.get(main, []), s, e)),
                "other_threads": _top(
                    _merged(innermost(found, s, e) for tid, found in threads.items() if tid != main)
                ),  # fmt: skip
            }
            for s, e in largest
        ],
    }


def _merged(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for part in parts:
        for name, us in part.items():
            total[name] += us
    return total


def _top(covered: dict[str, float], count: int = 8) -> dict[str, float]:
    return dict(sorted(covered.items(), key=lambda kv: -kv[1])[:count])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--min-us", type=float, default=50.0, help="the smallest gap reported")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest gaps")
    parser.add_argument("--out", type=Path, help="also write the summaries as JSON here")
    args = parser.parse_args()
    summaries = [summarize(t, args.min_us, args.top) for t in args.traces]
    for s in summaries:
        print(f"{s['trace']}: GPU span {s['gpu_span_ms']:.1f} ms, {s['gaps']} gaps of "
              f">= {args.min_us:.0f} us, {s['idle_ms']:.2f} ms idle in them")  # fmt: skip
        for gap in s["largest"]:
            print(f"  at {gap['at_ms']:9.2f} ms: {gap['gap_us']:8.0f} us")
            for who in ("launching_thread", "other_threads"):
                for name, us in list(gap[who].items())[:5]:
                    print(f"      {us:8.0f} us  {who[:5]}  {name[:100]}")
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
