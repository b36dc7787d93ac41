"""The GPU gate in whole jobs, on a GPU (skipped without one; run on the GPU machine): a rank
whose step's collectives break is recovered bit-identically whether the CPU had got past
its backward or even past its optimizer's update, which then waited behind the gate."""

import pytest
import torch

from xmig.traces import read_trace

from helpers import FAST, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# one rank, in-place recovery; the model big enough that the CPU runs ahead of the GPU. No
# collective after the update (a fault there is a case of its own, gate or not): the step's
# last collective is its last bucket's, and the update is issued behind its gate
JOB = ["--nproc-per-node", "1", "--gpu-gate", *FAST, "examples/train_gpt.py", "--preset", "gpt100m",
       "--steps", "6", "--quiet", "--dropout", "0.1"]  # fmt: skip
QUEUED = "waits behind a shut gate"
STEP = 3
# the survivor's line that says the update was queued is an info line
INFO = ["--log-level", "info"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run's final parameters, and the index of the step's last collective
    (its last bucket's), read from its trace."""
    tmp = tmp_path_factory.mktemp("gate-reference")
    result = run(["--trace-dir", str(tmp / "trace"), *JOB], tmp, timeout=240)
    assert result.returncode == 0, result.output
    (trace,) = (tmp / "trace").glob("rank0-*.jsonl")
    _, entries = read_trace(trace)
    last = max(e["index"] for e in entries if e["kind"] == "op" and e["step"] == STEP)
    return result.summary["final_params_sha256"], last


def _recovered(tmp_path, faults, extra=()):
    args = [*extra, *(a for f in faults for a in ("--inject", f)), *JOB]
    result = run(args, tmp_path, timeout=240)
    assert result.returncode == 0, result.output
    return result


def test_the_gate_changes_no_number(reference, tmp_path):
    result = run([a for a in JOB if a != "--gpu-gate"], tmp_path, timeout=300)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == reference[0]


def test_a_bucket_that_fails_behind_the_gate_is_replayed_bit_identically(reference, tmp_path):
    result = _recovered(tmp_path, [f"raise:rank=0:step={STEP}:at=collective=1"])
    assert result.summary["final_params_sha256"] == reference[0]
    assert [r["mode"] for r in result.summary["recoveries"]] == ["in-place retry"]


def test_an_update_queued_behind_a_shut_gate_counts_as_not_taken(reference, tmp_path):
    # the last bucket's all-reduce fails after its launch; its future was complete at once,
    # so the CPU issues the update behind the shut gate
    expected, last = reference
    result = _recovered(tmp_path, [f"raise:rank=0:step={STEP}:at=completion={last}"],
                        extra=INFO)  # fmt: skip
    assert result.summary["final_params_sha256"] == expected
    assert QUEUED in result.output


def test_a_rollback_behind_a_shut_gate_starts_the_step_again(reference, tmp_path):
    expected, last = reference
    result = _recovered(tmp_path, [f"raise:rank=0:step={STEP}:at=completion={last}"],
                        extra=["--no-replay-log", *INFO])  # fmt: skip
    assert result.summary["final_params_sha256"] == expected
    assert [r["mode"] for r in result.summary["recoveries"]] == ["rollback"]
    assert QUEUED in result.output
