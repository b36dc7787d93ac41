"""Host cost of the CUDA calls an op's issue through xmig's proxy makes, and of the step
boundary's reseeding: microseconds a call, on one GPU.

    python bench/issue_calls.py [--calls 2000]

Each call is made ``--calls`` times after 50 of warm-up; the line gives the mean. Only the
host's time is measured (nothing here waits for the GPU)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from xmig.state import rng  # noqa: E402


def mean_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(50):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("issue_calls: no GPU here", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream()
    small = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize()

    def stream_context() -> None:
        with torch.cuda.stream(stream):
            pass

    def set_stream_pair() -> None:
        previous = torch.cuda.current_stream(device)
        torch.cuda.set_stream(stream)
        torch.cuda.set_stream(previous)

    def future_completed() -> None:
        torch.futures.Future(devices=[device]).set_result([small])

    calls: list[tuple[str, Callable[[], object]]] = [
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(device)),
        ("with torch.cuda.stream(s)", stream_context),
        ("set_stream there and back", set_stream_pair),
        ("torch.cuda.Event()", torch.cuda.Event),
        ("torch.cuda.Event().record()", lambda: torch.cuda.Event().record()),
        ("Future(devices=[device])", lambda: torch.futures.Future(devices=[device])),
        ("Future(devices=[device]).set_result", future_completed),
        ("clone of 4 MiB", small.clone),
        ("torch.cuda.is_available()", torch.cuda.is_available),
        ("threading.Event()", threading.Event),
        ("xmig's step reseeding", lambda: rng.reseed(1, 0, 5)),
    ]
    for name, fn in calls:
        print(f"{name:40s} {mean_us(fn, args.calls):8.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
