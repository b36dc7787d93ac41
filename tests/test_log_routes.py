"""``bench/log_routes.py`` on the CPU: the routes that need no stream run, each variant's
final parameters are plain DDP's (the log's copies change no number), and a variant the CPU
cannot run is refused with a line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "log_routes.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "tiny",
                           "--batch-size", "2", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_cpu_routes_change_no_number():
    done = _run("--steps", "3", "--warmup", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in ("plain", "nocopy", "d2d"):
        assert any(line.startswith(f"{name} ") for line in lines), done.stdout
    assert lines[-1].endswith("from plain DDP's: 0"), done.stdout


def test_copies_from_xmigs_pool_change_no_number():
    done = _run("--steps", "4", "--warmup", "1", "--pool")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith("from plain DDP's: 0"), done.stdout


def test_a_route_that_needs_a_gpu_is_refused_on_the_cpu():
    done = _run("--steps", "2", "--variants", "d2h")
    assert done.returncode == 2 and "on the CPU only" in done.stderr, done.stderr


def test_a_gate_is_refused_on_the_cpu():
    done = _run("--steps", "2", "--gate", "gate")
    assert done.returncode == 2 and "--gate is for the GPU" in done.stderr, done.stderr


def _bench_module():
    root = SCRIPT.parent.parent
    sys.path[:0] = [str(root / "src"), str(root / "bench")]  # (it adds examples/ itself)
    try:
        spec = importlib.util.spec_from_file_location("log_routes", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        del sys.path[:2]
    return module


def test_the_pool_holds_each_steps_copies_until_the_step_after_it_ends():
    log = _bench_module().Log("d2d", None, None, pool=True)
    buckets = [torch.randn(10), torch.randn(20), torch.randn(20)]
    steps = []
    for step in range(5):
        copies = [log.device_copy(i, b + step, i == len(buckets) - 1)
                  for i, b in enumerate(buckets)]  # fmt: skip
        for i, (copy, bucket) in enumerate(zip(copies, buckets, strict=True)):
            assert torch.equal(copy, bucket + step), (step, i)
        steps.append(copies)
        # the step before is still held, untouched, beside this one
        if step >= 1:
            assert all(torch.equal(c, b + (step - 1)) for c, b in zip(steps[-2], buckets,
                                                                     strict=True))  # fmt: skip
    pointers = [{c.data_ptr() for c in copies} for copies in steps]
    assert pointers[0] != pointers[1] and not pointers[0] & pointers[1]
    # from the third step on, the copies reuse the memory of the step before last
    assert pointers[2] == pointers[0] and pointers[3] == pointers[1]
