"""The control plane's scale benchmark at its smallest size: the real coordinator recovers a
killed rank of 16 on 2 stub nodes, and every process the run started ends."""

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import control_scale  # noqa: E402


def test_a_simulated_job_of_16_ranks_recovers_and_ends():
    cfg = control_scale.Config(
        ranks=16, nodes=2, step_s=0.1, warmup_s=0.3, steady_s=0.5, post_steps=3, deadline_s=20.0
    )
    threads = threading.active_count()
    result = control_scale.run_simulation(cfg)
    assert result.error is None, result.error
    summary = result.summary
    assert summary is not None and summary["status"] == "completed", summary
    assert summary["world_size"] == 16 and summary["steps"] == cfg.total_steps
    (recovery,) = summary["recoveries"]
    assert recovery["ranks"] == [cfg.fail_rank] and recovery["mode"] == "respawn"
    assert recovery["replicas_equal"] is True and recovery["from_spare"] == [True]
    assert result.coordinator_exit == 0
    assert result.started_pids and not result.left_running
    assert not any(control_scale.alive(pid) for pid in result.started_pids)
    assert threading.active_count() <= threads  # the stubs' connections are closed
    # what the run measured is there (its values are the benchmark's business)
    assert result.decide_park_s is not None and result.decide_plan_s is not None
    assert result.steady_msgs.get("progress") and result.steady_msgs.get("agent_alive")
