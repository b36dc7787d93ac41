"""The demo workload trains, is deterministic, and its run summary is complete."""

from helpers import DEMO, run

STEPS = 6
SUMMARY_KEYS = {
    "final_params_sha256",
    "steps",
    "world_size",
    "faults",
    "recoveries",
    "worker_pids",
    "job_id",
    "status",
    "exit_code",
    "coordinator_pid",
    "agent_pids",
}


def _train(tmp_path, name, layout=("--nproc-per-node", "2"), extra=()):
    folder = tmp_path / name
    folder.mkdir()
    result = run([*layout, str(DEMO), "--steps", str(STEPS), *extra], folder)
    assert result.returncode == 0, result.output
    return result


def test_demo_is_deterministic_and_summarised(tmp_path):
    first = _train(tmp_path, "a")
    second = _train(tmp_path, "b")
    summary = first.summary
    assert set(summary) >= SUMMARY_KEYS
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["world_size"] == 2 and summary["faults"] == [] and summary["recoveries"] == []
    assert sorted(summary["worker_pids"]) == ["0", "1"]
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values())
    assert len(summary["final_params_sha256"]) == 64
    assert summary["final_params_sha256"] == second.summary["final_params_sha256"]
    assert f"step {STEPS - 1} loss" in first.output
    assert "completed: 6 steps on 2 ranks" in first.output


def test_different_seed_gives_different_parameters(tmp_path):
    # guards the determinism test above against a hash that ignores the training
    base = _train(tmp_path, "a").summary["final_params_sha256"]
    other = _train(tmp_path, "b", extra=["--seed", "99"]).summary["final_params_sha256"]
    assert base != other


def test_two_nodes_match_one_node(tmp_path):
    one = _train(tmp_path, "a").summary
    two = _train(tmp_path, "b", layout=("--nnodes", "2", "--nproc-per-node", "1")).summary
    assert two["world_size"] == 2 and sorted(two["agent_pids"]) == ["0", "1"]
    assert two["final_params_sha256"] == one["final_params_sha256"]
