"""``bench/proxy_overhead.py`` on the CPU: a short paired run through ``xmig run`` writes its
ratio, the proxy's issue by kind of op, and with ``--split-issue`` the issue's parts."""

import json

import torch

from helpers import REPO, run

SCRIPT = REPO / "bench" / "proxy_overhead.py"


def test_the_issue_is_split_into_its_parts(tmp_path):
    out = tmp_path / "result.json"
    result = run(["--nproc-per-node", "2", "--hot-spares", "0", str(SCRIPT), "--steps", "6",
                  "--warmup", "2", "--out", str(out), "--split-issue", "--preset", "tiny",
                  "--batch-size", "2"], tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.output
    data = json.loads(out.read_text())
    assert data["paired_ratio_median"] > 0
    # each thread's CPU time a step, by name: the step loop's thread ran every step
    threads = data["thread_cpu_ms_per_step"]
    assert threads["MainThread"] > 0, threads
    split = data["issue_split_us"]
    # DDP's forward broadcasts its buffers, its backward all-reduces the gradients' buckets
    assert {"broadcast", "allreduce"} <= set(split)
    for op, parts in split.items():
        assert parts["issue"] == max(parts.values()), (op, parts)  # the whole holds each part
        assert parts["_enqueue"] >= parts["_launch"] >= parts["_when_done"] > 0, (op, parts)
        assert parts["_new_record"] >= parts["signature_of"] > 0, (op, parts)
        assert parts["_log_inputs"] > 0 and parts["_create_work_from_future"] > 0, (op, parts)
        # the parts run inside the issue, one after another: what they leave (the timers'
        # own cost, and the waits for the interpreter between them) is never below zero
        assert -0.01 < parts["rest"] < parts["issue"], (op, parts)
        # the same ops as the unsplit timer's, within its own overhead
        assert abs(parts["issue"] - data["issue_us_by_op"][op]) < 0.5 * parts["issue"], op


def test_the_issue_alone_is_timed_against_a_communicator_that_does_nothing():
    import subprocess
    import sys

    script = REPO / "bench" / "issue_alone.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "3", "--ops", "2", "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert 0 < result["issue_us_least"] <= result["issue_us_median"]
    assert result["issue_us_median"] < result["with_wait_us_median"]  # the wait holds the issue
    refused = subprocess.run([sys.executable, str(script), "--steps", "0"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "--steps" in refused.stderr
    split = subprocess.run([sys.executable, str(script), "--steps", "3", "--ops", "2", "--split",
                            "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert split.returncode == 0, split.stderr
    parts = json.loads(split.stdout)["issue_split_us"]
    assert set(parts) == {"broadcast", "allreduce"}
    assert 0 < parts["allreduce"]["_launch"] < parts["allreduce"]["issue"]
    # a real group of one rank (gloo here): its ops go through a real backend's launch
    real = subprocess.run([sys.executable, str(script), "--steps", "3", "--ops", "2", "--real",
                           "--split", "--json"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert real.returncode == 0, real.stderr
    real_parts = json.loads(real.stdout)["issue_split_us"]
    assert 0 < real_parts["allreduce"]["_launch"] < real_parts["allreduce"]["issue"]
    if not torch.cuda.is_available():  # the GPU's own timings are refused on the CPU
        gpu = subprocess.run([sys.executable, str(script), "--real", "--primitives"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert gpu.returncode == 2 and "needs a GPU" in gpu.stderr
