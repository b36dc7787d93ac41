"""Changing the world size at a step boundary, with no fault (``--inject resize:``,
``xmig scale``): the ranks that stay keep their processes and state, the highest ranks leave,
and the job goes on at the new size with no sample skipped or seen twice.

``tests/scripts/resize_exact.py`` makes every number exact, so its final weight is known in
advance whatever the world size (-188 after 8 steps): a sample skipped, repeated or misweighed,
or DDP averaging over the old number of ranks, gives another weight."""

import json
import re
import time

from helpers import REPO, fault_free_sha256, finish_run, run, start_run, xmig

EXACT = REPO / "tests" / "scripts" / "resize_exact.py"
PATTERNS = REPO / "tests" / "scripts" / "patterns.py"
FAST = ["--hot-spares", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
STEPS = 8
EXPECTED_W = -sum(6 * step + 2.5 for step in range(STEPS))  # each step: its batch's mean


def exact_job(tmp_path, *extra, steps=STEPS, sleep=0.0, script=()):
    return ["--nproc-per-node", "3", *FAST, *extra, str(EXACT), "--steps", str(steps),
            "--out", str(tmp_path / "w.json"), "--step-sleep", str(sleep), *script]  # fmt: skip


def final_weight(tmp_path):
    return json.loads((tmp_path / "w.json").read_text())


def test_a_planned_resize_goes_on_at_the_new_size_with_every_sample_once(tmp_path):
    # a step of 50 ms: the pause, sent two steps ahead, has time to reach every rank
    result = run(exact_job(tmp_path, "--inject", "resize:world=2:step=4", sleep=0.05),
                 tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    # the model's one weight, exactly what the fault-free run at 3 ranks ends with
    assert final_weight(tmp_path) == {"w": EXPECTED_W, "world_size": 2}
    summary = result.summary
    assert summary["world_size"] == 2 and summary["launch_world_size"] == 3
    assert summary["world_sizes"] == [[0, 3], [4, 2]]
    assert summary["unfired_faults"] == []
    (record,) = summary["resizes"]
    assert record["what"] == "shrunk from 3 to 2 at step 4 (planned)"
    assert record["left"] == [2] and record["refused"] is None
    assert record["why"] == "resize:world=2:step=4"
    # the ranks that stay keep their processes: one each, all through
    assert {r: len(p) for r, p in summary["worker_pids"].items()} == {"0": 1, "1": 1}
    (left,) = summary["left_ranks"]
    assert left["rank"] == 2 and left["pid"] not in summary["worker_pids"]["0"]
    assert "shrunk from 3 to 2 at step 4" in result.output


def test_a_planned_grow_starts_a_rank_that_pulls_the_state_and_goes_on_exactly(tmp_path):
    """3 ranks on one node, down to 2 at step 3. A grow back to 3 at step 6 whose new rank
    exits before it joins leaves the world at 2, nothing lost; the one at step 9 starts the
    new rank 2 in the free slot, which pulls the state of step 9's start from rank 0. Every
    sample is still taken once, weighed by the world of its step."""
    steps = 12
    result = run(exact_job(tmp_path, "--inject", "resize:world=2:step=3", "--inject",
                           "resize:world=3:step=6", "--inject", "resize:world=3:step=9",
                           steps=steps, sleep=0.05, script=("--fail-new-rank", "2")),
                 tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    assert final_weight(tmp_path) == {"w": -sum(6 * s + 2.5 for s in range(steps)),
                                      "world_size": 3}  # fmt: skip
    summary = result.summary
    assert summary["world_sizes"] == [[0, 3], [3, 2], [9, 3]]
    _, failed, grow = summary["resizes"]
    assert "new rank(s) [2] did not start: exit code 3" in failed["refused"]
    assert "the world stays at 2 ranks" in result.output
    assert grow["what"] == "grown from 2 to 3 at step 9 (planned)"
    assert grow["added"] == {"2": 0} and grow["pulled"] == {"2": 0}
    assert grow["replicas_equal"] is True  # its parameters equal its peers' after a step
    # ranks 0 and 1 kept their processes throughout; rank 2 is a new one
    pids = summary["worker_pids"]
    assert len(pids["0"]) == len(pids["1"]) == len(pids["2"]) == 1
    left = [r["pid"] for r in summary["left_ranks"]]
    assert len(left) == 2 and not set(left) & set(pids["2"])  # the leaver, the failed start
    assert "grown from 2 to 3 at step 9" in result.output


def test_scale_by_request_shrinks_a_running_job(tmp_path):
    env = {"XMIG_JOBS_DIR": str(tmp_path / "jobs")}
    proc = start_run(exact_job(tmp_path, steps=12, sleep=0.3), tmp_path, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = xmig("status", env=env, timeout=30)
        found = re.search(r"rank 0: step (\d+)", status.stdout)
        if status.returncode == 0 and found and int(found.group(1)) >= 2:
            break
        time.sleep(0.2)
    scaled = xmig("scale", "--world-size", "1", env=env, timeout=30)
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    assert "from 3 to 1 ranks" in scaled.stdout
    refused = xmig("scale", "--world-size", "5", env=env, timeout=30)
    assert refused.returncode == 2 and "resize refused: " in refused.stderr
    result = finish_run(proc, tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert final_weight(tmp_path) == {"w": -sum(6 * s + 2.5 for s in range(12)),
                                      "world_size": 1}  # fmt: skip
    (record,) = result.summary["resizes"]
    assert record["new_world"] == 1 and record["left"] == [1, 2] and record["why"] == "request"


def test_a_world_whose_data_cannot_be_redistributed_is_not_resized(tmp_path, tmp_path_factory):
    """``session.batches`` keeps each rank's own position: the ranks resume at the old size,
    and the run is the fault-free one."""
    args = ["--nproc-per-node", "3", *FAST, str(PATTERNS), "--pattern", "batches"]
    expected = fault_free_sha256(args, tmp_path_factory)
    result = run([*args[:-3], "--inject", "resize:world=2:step=3", *args[-3:]], tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    assert result.summary["world_size"] == 3
    (record,) = result.summary["resizes"]
    assert "session.batches()" in record["refused"]
    assert "resize to 2 ranks refused at step 3" in result.output


NODES = ["--nnodes", "3", "--nproc-per-node", "1", "--simulate-hosts", *FAST]


def shards_job(*extra, script=()):
    return [*NODES, *extra, str(PATTERNS), "--pattern", "shards", "--slow-backward", *script]


def test_a_lost_node_without_a_spare_shrinks_the_world_as_the_planned_resize_would(
    tmp_path, tmp_path_factory
):
    """3 simulated hosts, no spare: rank 1's node is lost mid-backward in step 5, while rank
    2 is still in step 4 (before its update, its collectives done). Rank 0 rolls step 5 back,
    rank 2 finishes step 4 without an update and pulls step 5's state from rank 0, and both
    go on at 2 ranks from step 5: bit-identical to the fault-free run resized to 2 at step 5
    (uneven shares of 10 at 3 ranks, SGD with momentum, a StepLR that changes the learning
    rate at the end of step 5, dropout)."""
    result = run(shards_job("--on-no-spare", "shrink", "--inject",
                            "node:rank=1:step=5:at=backward",
                            script=("--slow-update", "2:4")), tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = result.summary
    (record,) = summary["resizes"]
    assert record["cause"] == "node lost" and record["lost"] == [1] and record["step"] == 5
    assert record["pulled"] == {"2": 0}, record
    expected = fault_free_sha256(shards_job("--inject", "resize:world=2:step=5"),
                                 tmp_path_factory)  # fmt: skip
    assert summary["final_params_sha256"] == expected, "not the planned resize's run"
    assert record["what"] == "shrunk from 3 to 2 at step 5 (node lost)"
    assert summary["world_sizes"] == [[0, 3], [5, 2]] and summary["lost_nodes"] == [1]
    # the survivors kept their processes: old rank 2 is rank 1 now
    assert {r: len(p) for r, p in summary["worker_pids"].items()} == {"0": 1, "1": 1}
    assert summary["worker_nodes"] == {"0": 0, "1": 2}
    assert summary["unfired_faults"] == []


def test_a_shrink_below_the_minimum_stops_with_a_checkpoint(tmp_path):
    result = run(shards_job("--on-no-spare", "shrink", "--min-world-size", "3", "--inject",
                            "node:rank=2:step=4:at=backward"), tmp_path)  # fmt: skip
    assert result.returncode == 1, result.output
    assert "below --min-world-size 3" in result.summary["message"]
    saved = result.summary["jit_checkpoint"]
    assert saved["path"] and saved["step"] == 4
    assert result.summary["resizes"] == [] and result.summary["world_size"] == 3


def test_a_node_added_after_a_shrink_grows_the_world_as_planned_resizes_would(
    tmp_path, tmp_path_factory
):
    """3 simulated hosts, no spare: node 1 is lost in step 4 and the world shrinks to 2; the
    process launched as rank 2 (rank 1 since) is killed in step 6 and replaced at world 2;
    a node is added as the job reaches step 10 (``add-node``, as ``xmig scale --add-node``
    does: started two steps ahead, at step 8, so after the kill's recovery: a fault while a
    grow waits for its step stops the job) and the world grows back to 3 onto it, its new
    rank pulling the state. The run ends bit-identical to the fault-free run with planned
    resizes to 2 at step 4 and back to 3 at the grow's step."""
    result = run(shards_job("--on-no-spare", "shrink",
                            "--inject", "node:rank=1:step=4:at=backward",
                            "--inject", "kill:rank=2:step=6", "--inject", "add-node:step=10",
                            script=("--steps", "14", "--step-sleep", "0.3")),
                 tmp_path, timeout=240)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = result.summary
    shrink, grow = summary["resizes"]
    assert shrink["what"] == "shrunk from 3 to 2 at step 4 (node lost)"
    step = grow["step"]
    assert grow["cause"] == "node added" and step >= 10
    assert grow["added"] == {"2": 3} and summary["added_nodes"] == [3]
    assert grow["replicas_equal"] is True
    assert summary["world_sizes"] == [[0, 3], [4, 2], [step, 3]]
    (recovery,) = summary["recoveries"]
    assert recovery["ranks"] == [1] and recovery["verified"] is not False
    # rank 0 kept its process throughout; rank 1 (launched as 2) was replaced once
    pids = summary["worker_pids"]
    assert (len(pids["0"]), len(pids["1"]), len(pids["2"])) == (1, 2, 1)
    assert summary["worker_nodes"] == {"0": 0, "1": 2, "2": 3}
    assert summary["unfired_faults"] == []
    planned = shards_job("--inject", "resize:world=2:step=4", "--inject",
                         f"resize:world=3:step={step}", script=("--steps", "14"))  # fmt: skip
    expected = fault_free_sha256(planned, tmp_path_factory)
    assert summary["final_params_sha256"] == expected, "not the planned resizes' run"


def test_a_lost_node_in_a_world_that_cannot_shrink_stops_with_a_checkpoint(tmp_path):
    """``session.batches()`` keeps each rank's own position: the survivors say so as they
    park, and the state is saved at once (told to resume at the old size, they would wait
    for the lost rank)."""
    args = [*NODES, "--on-no-spare", "shrink", "--inject", "node:rank=1:step=3:at=backward",
            str(PATTERNS), "--pattern", "batches", "--slow-backward", "--steps", "6"]  # fmt: skip
    result = run(args, tmp_path, timeout=120)
    assert result.returncode == 1, result.output
    assert "the world cannot shrink: rank 0: the data stream 'data' is drawn through " \
        "session.batches()" in result.summary["message"]  # fmt: skip
    saved = result.summary["jit_checkpoint"]
    assert saved["path"] and saved["step"] == 3 and result.summary["resizes"] == []
    assert result.elapsed < 60  # not a wait for a rank that is gone
