"""A collective issued after the optimizer's update (a mean loss all-reduced for logging):
a fault in it is replayed from its step's start while every rank is alive, and where it
cannot be replayed (no log, or a replacement that resumes past it) the job stops with a
just-in-time checkpoint: never a result made without the peers handed to the script."""

import re

import pytest

from test_jit_checkpoint import resume, stopped_with_checkpoint
from xmig.traces import read_trace

from helpers import DEMO, FAST, run

STEP = 3
JOB = ["--nproc-per-node", "2", *FAST]
SCRIPT = [str(DEMO), "--preset", "tiny", "--steps", "6", "--mean-loss"]
# (two ranks' lines can run into one another in the launcher's output)
LOSS = re.compile(r"\[rank(\d)\] step (\d+) loss ([0-9.]+)")


def _losses(output: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> the mean loss the script printed."""
    return {(int(r), int(s)): loss for r, s, loss in LOSS.findall(output)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run: its final parameters, its printed losses, and the index of the
    mean loss's all-reduce in the step (the step's last op, read from the trace)."""
    tmp = tmp_path_factory.mktemp("after-update")
    result = run(["--trace-dir", str(tmp / "trace"), *JOB, *SCRIPT], tmp)
    assert result.returncode == 0, result.output
    (trace, *_) = sorted((tmp / "trace").glob("rank0-*.jsonl"))
    _, entries = read_trace(trace)
    last = max(e["index"] for e in entries if e["kind"] == "op" and e["step"] == STEP)
    return result.summary["final_params_sha256"], _losses(result.output), last


def test_a_broken_collective_after_the_update_is_replayed_in_place(reference, tmp_path):
    expected, losses, last = reference
    fault = f"raise:rank=0:step={STEP}:at=collective={last}"
    result = run([*JOB, "--inject", fault, *SCRIPT], tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    assert recovery["mode"] == "in-place retry" and recovery["resume_step"] == STEP + 1
    # the script was handed the mean over both ranks, as without the fault
    assert _losses(result.output) == losses
    assert all(len(pids) == 1 for pids in result.summary["worker_pids"].values())


def test_without_the_log_it_stops_with_a_checkpoint_that_resumes_bit_identically(
    reference, tmp_path
):
    expected, losses, last = reference
    fault = f"raise:rank=0:step={STEP}:at=collective={last}"
    result = run([*JOB, "--no-replay-log", "--inject", fault, *SCRIPT], tmp_path)
    _, command = stopped_with_checkpoint(result, step=STEP + 1)
    assert "waits in a collective it issued after it" in result.output
    # no loss of the broken step was printed: the script never saw a value made alone
    assert all(step != STEP for _, step in _losses(result.output))
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected
    assert {k: v for k, v in _losses(resumed.output).items() if k[1] > STEP} == {
        k: v for k, v in losses.items() if k[1] > STEP
    }
