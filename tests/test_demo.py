"""The demo workload trains, is deterministic, and its run summary is complete."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from helpers import DEMO, run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


@pytest.mark.long
def test_different_seed_gives_different_parameters(tmp_path):
    # guards the determinism test above against a hash that ignores the training
    base = _train(tmp_path, "a").summary["final_params_sha256"]
    other = _train(tmp_path, "b", extra=["--seed", "99"]).summary["final_params_sha256"]
    assert base != other


@pytest.mark.long  # test_nodes.py's simulated hosts train like one host in CI
def test_two_nodes_match_one_node(tmp_path):
    one = _train(tmp_path, "a").summary
    two = _train(tmp_path, "b", layout=("--nnodes", "2", "--nproc-per-node", "1")).summary
    assert two["world_size"] == 2 and sorted(two["agent_pids"]) == ["0", "1"]
    assert two["final_params_sha256"] == one["final_params_sha256"]


@pytest.mark.long  # the benchmarks' torchrun baseline, not xmig's own path
def test_checkpoint_restart_baseline_resumes_bit_identically(tmp_path):
    """The benchmarks' baseline (torchrun restarting every worker, reloading the last
    checkpoint) must train the same parameters, or comparing with it would mean nothing."""
    steps, events = 8, tmp_path / "events.jsonl"
    reference = _train(tmp_path, "ref", extra=["--steps", str(steps)])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1", "--master-port", str(free_port()),
        str(DEMO), "--plain", "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "3", "--die-at", "1:5", "--events-file", str(events),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=180)
    finally:  # torchrun, its agent and workers: one process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    kills = [r for r in lines if "kill" in r]
    assert kills == [{"rank": 1, "kill": 5, "t": kills[0]["t"]}]
    # the second attempt resumed from the checkpoint after step 2 (steps 3 and 4 redone)
    restarted = sorted({(r["rank"], r["step"]) for r in lines if r.get("attempt") == 1})
    assert restarted == [(rank, step) for rank in (0, 1) for step in range(3, steps)]
    hashes = re.findall(r"final params sha256 ([0-9a-f]{64})", output)
    assert hashes == [reference.summary["final_params_sha256"]]


@pytest.mark.long  # the GPT's recoveries run in CI; this is the other workload
def test_the_mlp_workload_recovers_bit_identically(tmp_path):
    """The comparison's second workload: a kill mid-backward changes no bit of the result."""
    mlp = ("--model", "mlp", "--n-embd", "64")
    clean = _train(tmp_path, "mlp", extra=mlp)
    killed = _train(tmp_path, "mlp-kill", layout=("--nproc-per-node", "2", "--inject",
                    "kill:rank=1:step=3:at=backward"), extra=mlp)  # fmt: skip
    assert "MLP" in clean.output
    assert len(killed.summary["recoveries"]) == 1
    assert killed.summary["final_params_sha256"] == clean.summary["final_params_sha256"]


# tests/test_fsdp.py covers both layouts in CI; the demo's is the wider sample
@pytest.mark.long
@pytest.mark.parametrize("layout", ["hsdp", "tp-dp"])
def test_the_demo_laid_out_on_a_mesh_recovers_bit_identically(tmp_path, layout):
    """``--parallel``: the demo GPT under HSDP (or TP x DP) on 4 ranks, a kill mid-backward."""
    four = ("--nproc-per-node", "4", "--hot-spares", "0")
    extra = ("--parallel", layout, "--quiet")
    clean = _train(tmp_path, layout, layout=four, extra=extra)
    killed = _train(tmp_path, f"{layout}-kill",
                    layout=(*four, "--inject", "kill:rank=1:step=3:at=backward"),
                    extra=extra)  # fmt: skip
    assert len(killed.summary["recoveries"]) == 1
    assert killed.summary["final_params_sha256"] == clean.summary["final_params_sha256"]
    assert sorted(clean.summary["final_params_parts"]) == ["0", "1"]  # both shards


@pytest.mark.long  # test_fsdp.py's TP x DP kill (backward) pulls from the same peer in CI
def test_a_tp_by_dp_rank_killed_in_its_forward_pulls_from_its_data_parallel_peer(tmp_path):
    """Inside a step FSDP2 swaps in unsharded parameters, whose tensor-parallel meshes alone
    hid the data-parallel replicas: a fault there found "no replica" and stopped the job. The
    replicas are taken when the step loop begins."""
    four = ("--nproc-per-node", "4", "--hot-spares", "0")
    extra = ("--parallel", "tp-dp", "--preset", "small", "--quiet")
    extra = (*extra, "--steps", "4")  # the last --steps is the one taken
    clean = _train(tmp_path, "clean", layout=four, extra=extra)
    killed = _train(tmp_path, "kill", extra=extra,
                    layout=(*four, "--inject", "kill:rank=1:step=3:at=forward"))  # fmt: skip
    (recovery,) = killed.summary["recoveries"]
    assert recovery["sources"] == {"1": 3}
    assert killed.summary["final_params_sha256"] == clean.summary["final_params_sha256"]
