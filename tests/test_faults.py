"""Every injected fault kind is detected and reported with the right rank, kind and step,
and the job then ends cleanly: exit code 1, the cause in the last lines, no process left."""

import pytest

from helpers import DEMO, run

STEPS = 8
HB_INTERVAL, HB_TIMEOUT = 0.25, 1.5

CASES = [
    # spec, world size, expected kind, expected detail
    ("kill:rank=1:step=3:at=backward", 2, "signal", "SIGKILL"),
    ("kill:rank=0:step=2:at=boundary", 2, "signal", "SIGKILL"),
    ("kill:rank=2:step=4:at=collective=1", 3, "signal", "SIGKILL"),
    ("exit:rank=1:step=2:at=forward:code=3", 2, "exit", "exit code 3"),
    ("raise:rank=1:step=3:at=backward", 2, "error", "injected communication error"),
    ("raise:rank=0:step=1:at=collective=0", 3, "error", "injected communication error"),
    ("hang:rank=1:step=2:at=optimizer", 2, "hang", "no heartbeat"),
]


@pytest.mark.parametrize("spec, world, kind, detail", CASES, ids=[c[0] for c in CASES])
def test_injected_fault_is_reported(tmp_path, measure, spec, world, kind, detail):
    result = run(
        [
            "--nproc-per-node",
            str(world),
            "--inject",
            spec,
            "--heartbeat-interval",
            str(HB_INTERVAL),
            "--heartbeat-timeout",
            str(HB_TIMEOUT),
            str(DEMO),
            "--steps",
            str(STEPS),
            "--quiet",
        ],
        tmp_path,
    )
    summary = result.summary
    assert result.returncode == 1, result.output
    assert summary["status"] == "failed"
    assert len(summary["faults"]) == 1, summary["faults"]
    fault = summary["faults"][0]
    _, rank, step = (part.split("=")[-1] for part in spec.split(":")[:3])
    assert (fault["rank"], fault["kind"], fault["step"]) == (int(rank), kind, int(step))
    assert detail in fault["detail"]
    assert fault["injected"]["kind"] == spec.split(":")[0]
    assert fault["fault_time_source"] == "injection"
    latency = fault["detected_after_s"]
    measure(f"{spec} (world {world}): detected after {latency * 1000:.1f} ms")
    if kind == "hang":
        assert HB_TIMEOUT <= latency < HB_TIMEOUT + 1.0
    else:
        assert latency < 1.0
    assert summary["steps"] == int(step)
    assert summary["final_params_sha256"] is None
    assert all(len(p) == 1 for p in summary["worker_pids"].values())
    last = result.last_lines
    assert "FAILED" in last[-2] and f"rank {rank}" in last[-2] and f"step {step}" in last[-2]
    assert "exit code 1" in last[-1]


def test_hang_with_default_heartbeat(tmp_path, measure):
    result = run(
        ["--nproc-per-node", "2", "--inject", "hang:rank=0:step=1:at=forward", str(DEMO),
         "--steps", "4", "--quiet"],
        tmp_path,
    )  # fmt: skip
    fault = result.summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["step"]) == (0, "hang", 1)
    assert 3.0 <= fault["detected_after_s"] < 5.0  # the default timeout is 3 s
    measure(f"hang, default heartbeat (0.5 s / 3 s): detected after "
            f"{fault['detected_after_s']:.3f} s")  # fmt: skip
