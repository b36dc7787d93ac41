"""``bench/log_routes.py`` on the CPU: the routes that need no stream run, each variant's
final parameters are plain DDP's (the log's copies change no number), and a variant the CPU
cannot run is refused with a line."""

import subprocess
import sys
from pathlib import Path

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
