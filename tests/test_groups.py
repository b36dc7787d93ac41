"""Process groups beyond the world: DDP over the dp groups of a (stage, dp) DeviceMesh, with ops
of the world and of the stage groups in every step. Every group is proxied; a fault rebuilds
the groups that hold the failed rank, keeps the others, and the run ends bit-identical to the
fault-free one."""

import pytest

from helpers import FAST, REPO, fault_free_sha256, run, write_script

SCRIPT = REPO / "tests" / "scripts" / "groups.py"

# the (stage, dp) mesh's groups as c10d numbers them: the stage dimension's first
STAGE = {0: "pg1[0,2]", 1: "pg2[1,3]"}
DP = {0: "pg3[0,1]", 1: "pg4[2,3]"}


def job(*extra, groups="mesh"):
    return ["--nproc-per-node", "4", *FAST, *extra, str(SCRIPT), "--groups", groups]


def reference(tmp_path_factory, groups="mesh"):
    return fault_free_sha256(job(groups=groups), tmp_path_factory)


@pytest.mark.long  # the recoveries compare with the reference in CI
def test_fault_free_runs_are_alike_and_cover_both_stages(tmp_path, tmp_path_factory):
    expected = reference(tmp_path_factory)
    again = run(job(), tmp_path)
    assert again.returncode == 0, again.output
    assert again.summary["final_params_sha256"] == expected
    # the stages train different models: the fingerprint covers both dp groups' replicas
    parts = again.summary["final_params_parts"]
    assert sorted(parts) == ["0", "2"] and parts["0"] != parts["2"]
    assert expected not in parts.values()


def _groups_of(rank):
    """The groups a failure of ``rank`` rebuilds, and those it keeps."""
    mine = ["world", STAGE[rank % 2], DP[rank // 2]]
    others = [STAGE[1 - rank % 2], DP[1 - rank // 2]]
    return sorted(mine), sorted(others)


@pytest.mark.parametrize("fault, verified", [
    # (a kill in a backward is test_groups_made_with_split_group_recover_too's too, in CI)
    pytest.param("kill:rank=1:step=4:at=backward", True, marks=pytest.mark.long),
    # rank 0 roots its dp group's DDP broadcasts; collective 0 is the world's op
    pytest.param("kill:rank=0:step=3:at=collective=0", "unverifiable", marks=pytest.mark.long),
    ("kill:rank=3:step=4:at=collective=1", True),  # inside a DDP all-reduce of the dp group
    pytest.param("exit:rank=2:step=5:at=boundary", "unverifiable", marks=pytest.mark.long),
    pytest.param("kill:rank=2:step=3:at=optimizer", "unverifiable", marks=pytest.mark.long),
    # step 1: DDP rebuilds its buckets in its forward, broadcasting the layout first
    pytest.param("kill:rank=1:step=1:at=forward", True, marks=pytest.mark.long),
])  # fmt: skip
def test_a_fault_rebuilds_only_the_groups_that_hold_the_failed_rank(
    tmp_path, tmp_path_factory, fault, verified
):
    expected = reference(tmp_path_factory)
    result = run(job("--inject", fault), tmp_path)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    (recovery,) = summary["recoveries"]
    rank = int(fault.split("rank=")[1].split(":")[0])
    rebuilt, kept = _groups_of(rank)
    assert recovery["mode"] == "respawn"
    assert recovery["groups"] == {"rebuilt": rebuilt, "kept": kept}
    # its state comes from the other rank of its dp group, the one replica it has
    assert recovery["sources"] == {str(rank): rank ^ 1}
    assert recovery["verified"] == verified and recovery["replicas_equal"] is True
    survivors = [r for r in range(4) if r != rank]
    assert all(len(summary["worker_pids"][str(r)]) == 1 for r in survivors)
    assert len(summary["worker_pids"][str(rank)]) == 2


def test_a_rank_whose_replica_has_stepped_already_is_rolled_forward(tmp_path, tmp_path_factory):
    """Rank 3 dies before the stage group's op of step 4, after its dp group's: rank 2 (its
    replica) takes step 4's update, rank 1 (waiting for rank 3) cannot. Nothing can replay
    step 4 for rank 3, so the job goes on from step 5: rank 3 and rank 1 pull step 5's state
    from their replicas, every group is rebuilt."""
    expected = reference(tmp_path_factory)
    result = run(job("--inject", "kill:rank=3:step=4:at=collective=3"), tmp_path)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    (recovery,) = summary["recoveries"]
    assert recovery["mode"] == "rollback" and recovery["resume_step"] == 5
    assert "rank 3's replicas have taken step 4's update already" in recovery["why_rollback"]
    assert recovery["sources"] == {"1": 0, "3": 2}
    assert recovery["groups"]["kept"] == [] and len(recovery["groups"]["rebuilt"]) == 5
    assert all(len(summary["worker_pids"][str(r)]) == 1 for r in (0, 1, 2))


@pytest.mark.long
def test_groups_made_with_new_group_recover_too(tmp_path, tmp_path_factory):
    expected = reference(tmp_path_factory, "new_group")
    result = run(job("--inject", "kill:rank=2:step=4:at=backward", groups="new_group"), tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    # new_group([0, 1]), ([2, 3]), ([0, 2]), ([1, 3]): rank 2 is in the second and third
    assert recovery["groups"] == {"rebuilt": ["pg2[2,3]", "pg3[0,2]", "world"],
                                  "kept": ["pg1[0,1]", "pg4[1,3]"]}  # fmt: skip
    assert recovery["sources"] == {"2": 3} and recovery["verified"] is True


@pytest.mark.long  # new_group's recoveries and split_group's contract run in CI
def test_groups_made_with_split_group_recover_too(tmp_path, tmp_path_factory):
    """split_group's groups (torch's own needs NCCL and a bound device) are proxied too."""
    expected = reference(tmp_path_factory, "split")
    result = run(job("--inject", "kill:rank=2:step=4:at=backward", groups="split"), tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    # c10d names a split by a hash of its ranks: the labels' members say which is which
    members = {kind: sorted(label.partition("[")[2] for label in labels)
               for kind, labels in recovery["groups"].items()}  # fmt: skip
    assert members == {"rebuilt": ["", "0,2]", "2,3]"], "kept": ["0,1]", "1,3]"]}
    assert recovery["sources"] == {"2": 3} and recovery["verified"] is True
    assert all(len(result.summary["worker_pids"][str(r)]) == 1 for r in (0, 1, 3))


def test_split_group_keeps_torchs_contract(tmp_path):
    """A rank in no split gets None, a split of a sub-group is a group of its members, a
    split that is not one is refused on every rank with torch's ValueError."""
    script = write_script(
        tmp_path,
        """
        import os
        import torch, torch.distributed as dist
        import xmig
        session = xmig.init()
        first = dist.split_group(split_ranks=[[0]])
        assert (first is None) == (session.rank == 1), first
        pair = dist.new_group([0, 1])
        again = dist.split_group(pair, split_ranks=[[1, 0]])
        assert dist.get_process_group_ranks(again) == [0, 1]
        try:
            dist.split_group(split_ranks=[[0, 1], [1]])
        except ValueError as error:
            # one write a line: two ranks' prints to one pipe may interleave
            os.write(1, f"refused: {error}\\n".encode())
        for step in session.steps(2):
            t = torch.ones(1)
            dist.all_reduce(t, group=again)
            assert t.item() == 2.0
    """,
    )
    result = run(["--nproc-per-node", "2", *FAST, script], tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert result.output.count("refused: split_ranks overlap: [1] in two splits") == 2


def test_a_communication_error_in_a_group_is_retried_in_place(tmp_path, tmp_path_factory):
    expected = reference(tmp_path_factory)
    # collective 3 of step 4 on rank 1: an all-reduce of its dp group
    result = run(job("--inject", "raise:rank=1:step=4:at=collective=3"), tmp_path)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected
    (recovery,) = summary["recoveries"]
    assert recovery["mode"] == "in-place retry"
    # which group failed only the failing rank knows: every group is rebuilt
    assert recovery["groups"]["kept"] == []
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values())


def test_a_layout_without_replicas_is_refused_before_the_first_step(tmp_path):
    result = run(job(groups="solo"), tmp_path, timeout=120)
    assert result.returncode == 1, result.output
    summary = result.summary
    assert summary["steps"] == 0 and summary["faults"] == [] and summary["recoveries"] == []
    assert summary["message"].startswith("failed: no replica of rank ")
    assert "would need a checkpoint" in summary["message"]


def test_a_group_of_another_backend_is_named_as_not_recovered(tmp_path):
    script = write_script(
        tmp_path,
        """
        import torch, torch.distributed as dist
        import xmig
        session = xmig.init()
        plain = dist.new_group(backend="gloo")  # not through xmig
        mine = dist.new_group()
        for step in session.steps(2):
            t = torch.ones(1)
            dist.all_reduce(t, group=plain)
            dist.all_reduce(t, group=mine)
    """,
    )
    result = run(["--nproc-per-node", "2", *FAST, script], tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    (line,) = [x for x in result.output.splitlines() if "another backend than xmig's" in x]
    assert "1 (gloo)" in line and "a fault in them is not recovered" in line
    assert "2 (" not in line  # the group made with xmig's backend is proxied
