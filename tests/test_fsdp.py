"""FSDP2 and tensor parallel through xmig on CPU: HSDP on a (replicate, shard) mesh of 2 × 2 and
TP × DP on a (dp, tp) mesh of 2 × 2 recover bit-identically, each rank's shards pulled from the
rank that holds the same shards in the other replica; pure FSDP (no replica of any shard) is
refused before the first step."""

import pytest

from helpers import FAST, REPO, fault_free_sha256, run

SCRIPT = REPO / "tests" / "scripts" / "fsdp.py"
# the mesh's groups as c10d numbers them: the replicate dimension's first
REPLICATE = {0: "pg1[0,2]", 1: "pg2[1,3]"}  # by shard coordinate
SHARD = {0: "pg3[0,1]", 1: "pg4[2,3]"}  # by replica coordinate


def job(*extra, layout="hsdp"):
    return ["--nproc-per-node", "4", *FAST, *extra, str(SCRIPT), "--layout", layout]


def reference(tmp_path_factory, layout="hsdp"):
    return fault_free_sha256(job(layout=layout), tmp_path_factory)


@pytest.mark.long  # the HSDP recoveries compare with the reference in CI
def test_hsdp_runs_alike_twice_and_its_fingerprint_covers_both_shards(tmp_path, tmp_path_factory):
    expected = reference(tmp_path_factory)
    again = run(job(), tmp_path)
    assert again.returncode == 0, again.output
    assert again.summary["final_params_sha256"] == expected
    parts = again.summary["final_params_parts"]
    assert sorted(parts) == ["0", "1"] and parts["0"] != parts["1"]


# a step's collectives, as each rank issues them: all-gathers 0-3 (forward, and the
# backward's), reduce-scatter 4, the replicate group's all-reduce 5, reduce-scatter 6, ...
@pytest.mark.parametrize("fault, verified", [
    ("kill:rank=1:step=3:at=backward", True),
    pytest.param("kill:rank=2:step=3:at=collective=1", True,  # inside an FSDP all-gather
                 marks=pytest.mark.long),
    pytest.param("kill:rank=3:step=4:at=collective=4", True,  # inside a reduce-scatter
                 marks=pytest.mark.long),
    pytest.param("exit:rank=1:step=3:at=boundary", "unverifiable", marks=pytest.mark.long),
    pytest.param("kill:rank=0:step=2:at=forward", "unverifiable", marks=pytest.mark.long),
    pytest.param("kill:rank=2:step=3:at=optimizer", "unverifiable", marks=pytest.mark.long),
])  # fmt: skip
def test_a_rank_of_hsdp_is_replaced_from_its_replica(tmp_path, tmp_path_factory, fault, verified):
    expected = reference(tmp_path_factory)
    result = run(job("--inject", fault), tmp_path)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    (recovery,) = summary["recoveries"]
    rank = int(fault.split("rank=")[1].split(":")[0])
    assert recovery["mode"] == "respawn" and recovery["verified"] == verified
    assert recovery["sources"] == {str(rank): rank ^ 2}  # the same shard, the other replica
    assert recovery["groups"] == {
        "rebuilt": sorted(["world", REPLICATE[rank % 2], SHARD[rank // 2]]),
        "kept": sorted([REPLICATE[1 - rank % 2], SHARD[1 - rank // 2]]),
    }
    assert recovery["replicas_equal"] is True
    assert all(len(summary["worker_pids"][str(r)]) == 1 for r in range(4) if r != rank)


@pytest.mark.parametrize("layout, fault", [
    ("hsdp", "raise:rank=2:step=2:at=collective=5"),  # the replicate group's all-reduce
    # the tensor-parallel all-reduce (long: a TP by DP rank's replacement runs in CI)
    pytest.param("tp-dp", "raise:rank=1:step=3:at=collective=0", marks=pytest.mark.long),
])  # fmt: skip
def test_a_communication_error_in_a_collective_is_retried_in_place(
    tmp_path, tmp_path_factory, layout, fault
):
    expected = reference(tmp_path_factory, layout)
    result = run(job("--inject", fault, layout=layout), tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    assert recovery["mode"] == "in-place retry" and recovery["verified"] is True
    assert all(len(pids) == 1 for pids in result.summary["worker_pids"].values())


def test_a_death_and_a_failed_collective_in_a_group_without_it_roll_the_step_back(
    tmp_path, tmp_path_factory
):
    """Rank 3 dies as step 4 begins while rank 1's first all-gather of the step fails, in
    the shard group of ranks 0 and 1, which a replay would keep as it is (rank 0 waiting in
    the all-gather rank 1 never sent): the step is rolled back, every group rebuilt, and the
    run ends bit-identical, in a bounded time, the survivors in their processes."""
    expected = reference(tmp_path_factory)
    faults = ["--inject", "raise:rank=1:step=4:at=collective=0",
              "--inject", "kill:rank=3:step=4:at=boundary"]  # fmt: skip
    result = run(job(*faults), tmp_path, timeout=90)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    (recovery,) = summary["recoveries"]
    assert recovery["mode"] == "rollback" and recovery["ranks"] == [3]
    assert "group of ranks [0, 1], which holds none of the replaced" in recovery["why_rollback"]
    assert sorted(recovery["groups"]["rebuilt"]) == sorted([*REPLICATE.values(),
                                                            *SHARD.values(), "world"])  # fmt: skip
    assert all(len(summary["worker_pids"][str(r)]) == 1 for r in range(3))
    assert summary["unfired_faults"] == []


@pytest.mark.long
def test_tp_by_dp_runs_alike_twice_and_its_fingerprint_covers_both_tp_shards(
    tmp_path, tmp_path_factory
):
    expected = reference(tmp_path_factory, "tp-dp")
    again = run(job(layout="tp-dp"), tmp_path)
    assert again.returncode == 0, again.output
    assert again.summary["final_params_sha256"] == expected
    parts = again.summary["final_params_parts"]
    assert sorted(parts) == ["0", "1"] and parts["0"] != parts["1"]


def test_fsdp_without_a_replica_of_its_shards_is_refused_before_the_first_step(tmp_path):
    result = run(job(layout="fsdp"), tmp_path, timeout=120)
    assert result.returncode == 1, result.output
    summary = result.summary
    assert summary["steps"] == 0 and summary["faults"] == []
    assert summary["message"].startswith("failed: no replica of shard ")
    assert ": recovery of rank " in summary["message"]
    assert "would need a checkpoint" in summary["message"]


# TP × DP: ranks 0, 1 and 2, 3 are tensor-parallel peers, 0, 2 and 1, 3 data-parallel ones; a
# step's collectives: the row-wise layer's all-reduce over tp (0), the gradients' over dp (1)
@pytest.mark.parametrize("fault", [
    "kill:rank=1:step=3:at=backward",
    pytest.param("kill:rank=2:step=3:at=collective=0",  # inside the tensor-parallel all-reduce
                 marks=pytest.mark.long),
    pytest.param("kill:rank=0:step=4:at=collective=1", marks=pytest.mark.long),  # dp's
    pytest.param("exit:rank=3:step=2:at=boundary", marks=pytest.mark.long),
    pytest.param("kill:rank=1:step=3:at=forward", marks=pytest.mark.long),
    pytest.param("kill:rank=2:step=4:at=optimizer", marks=pytest.mark.long),
])  # fmt: skip
def test_a_rank_of_tp_by_dp_is_replaced_from_its_data_parallel_peer(
    tmp_path, tmp_path_factory, fault
):
    expected = reference(tmp_path_factory, "tp-dp")
    result = run(job("--inject", fault, layout="tp-dp"), tmp_path)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    assert sorted(summary["final_params_parts"]) == ["0", "1"]  # both tp shards
    (recovery,) = summary["recoveries"]
    rank = int(fault.split("rank=")[1].split(":")[0])
    assert recovery["mode"] == "respawn" and recovery["replicas_equal"] is True
    assert recovery["sources"] == {str(rank): rank ^ 2}  # its dp peer holds its tp shard
    dp, tp = ("pg1[0,2]", "pg2[1,3]")[rank % 2], ("pg7[0,1]", "pg8[2,3]")[rank // 2]
    assert recovery["groups"]["rebuilt"] == sorted(["world", dp, tp])
    assert recovery["verified"] in (True, "unverifiable")
    assert all(len(summary["worker_pids"][str(r)]) == 1 for r in range(4) if r != rank)


def test_fsdp_on_one_rank_retries_a_communication_error_in_place(tmp_path, tmp_path_factory):
    """What one GPU can show of FSDP2 (a mesh of one rank is not refused: nothing to lose to a
    peer), on CPU: the loss logged over the world is the one op, retried in place."""
    one = ["--nproc-per-node", "1", *FAST]
    script = [str(SCRIPT), "--layout", "fsdp", "--log-loss"]
    expected = fault_free_sha256([*one, *script], tmp_path_factory)
    result = run([*one, "--inject", "raise:rank=0:step=3:at=collective=0", *script], tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    assert recovery["mode"] == "in-place retry"
    assert len(result.summary["worker_pids"]["0"]) == 1
