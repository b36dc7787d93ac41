"""In-place recovery on CPU (gloo): every fault ends with the fault-free run's parameters,
bit for bit, the survivors' PIDs unchanged, and a complete, bounded recovery record."""

import pytest

from helpers import DEMO, run

STEPS = 7
HEARTBEAT = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "1.5"]
PHASES = {"detect", "park", "respawn", "rebuild", "pull", "replay"}
_REFERENCE: dict[int, dict] = {}


def reference(world, tmp_path_factory):
    """The fault-free run's summary for this world size (computed once)."""
    if world not in _REFERENCE:
        folder = tmp_path_factory.mktemp(f"reference{world}")
        result = run(["--nproc-per-node", str(world), str(DEMO), "--steps", str(STEPS),
                      "--quiet"], folder)  # fmt: skip
        assert result.returncode == 0, result.output
        _REFERENCE[world] = result.summary
    return _REFERENCE[world]


def recover(tmp_path, tmp_path_factory, world, specs, extra=(), script_args=()):
    args = ["--nproc-per-node", str(world), *HEARTBEAT, *extra]
    for spec in specs:
        args += ["--inject", spec]
    result = run([*args, str(DEMO), "--steps", str(STEPS), "--quiet", *script_args], tmp_path)
    summary, ref = result.summary, reference(world, tmp_path_factory)
    assert result.returncode == 0, result.output
    assert summary["status"] == "completed"
    assert summary["steps"] == ref["steps"] == STEPS
    assert summary["final_params_sha256"] == ref["final_params_sha256"], "not bit-identical"
    return result, summary


def check_records(summary, failed_ranks, measure, label):
    for rank, pids in summary["worker_pids"].items():
        expected = 1 + failed_ranks.count(int(rank))
        assert len(pids) == expected, f"rank {rank} had PIDs {pids}"
    assert len(summary["recoveries"]) == len(summary["faults"])
    for record in summary["recoveries"]:
        assert set(record["phases"]) == PHASES
        assert all(v >= 0 for v in record["phases"].values())
        assert 0 < record["total_s"] < 60
        phases = " ".join(f"{k}={v:.3f}" for k, v in record["phases"].items())
        measure(f"{label}: {record['mode']} in {record['total_s']:.2f} s ({phases})")


WORLDS = [2, 3]
POINTS = ["forward", "backward", "optimizer", "boundary"]


# in CI every point once: half of them for the last rank of 3, the other half for rank 0 of 2;
# the rest of the matrix is its wider sample (XMIG_LONG_TESTS=1)
def sample(values, keep):
    """``values`` as parameters, all but ``keep`` in the wider sample (XMIG_LONG_TESTS=1)."""
    return [pytest.param(v, marks=() if v == keep else pytest.mark.long) for v in values]


# CI's sample: a kill of rank 0 in the backward at world 2, of the last rank in the optimizer
# at world 3 (the fault matrix and the other tests here kill at the other points)
CI_KILLS = {("zero", "backward", 2), ("last", "optimizer", 3)}


def _in_ci(victim: str, point: str, world: int) -> bool:
    return (victim, point, world) in CI_KILLS


KILLS = [
    pytest.param(victim, point, world, id=f"{victim}-{point}-{world}",
                 marks=() if _in_ci(victim, point, world) else pytest.mark.long)
    for victim in ("last", "zero") for point in POINTS for world in WORLDS
]  # fmt: skip


@pytest.mark.parametrize("victim, point, world", KILLS)
def test_kill(tmp_path, tmp_path_factory, measure, world, point, victim):
    rank = 0 if victim == "zero" else world - 1
    spec = f"kill:rank={rank}:step=3:at={point}"
    _, summary = recover(tmp_path, tmp_path_factory, world, [spec])
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["step"]) == (rank, "signal", 3)
    assert fault["detected_after_s"] < 1.0
    record = summary["recoveries"][0]
    assert record["mode"] == "respawn" and record["ranks"] == [rank]
    check_records(summary, [rank], measure, f"{spec} (world {world})")


# an exit is recovered as a kill is (test_kill); the fault matrix draws exits in CI
@pytest.mark.parametrize("world", sample(WORLDS, keep=None))
def test_exit(tmp_path, tmp_path_factory, measure, world):
    spec = "exit:rank=1:step=2:at=backward:code=7"
    _, summary = recover(tmp_path, tmp_path_factory, world, [spec])
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["detail"]) == (1, "exit", "exit code 7")
    check_records(summary, [1], measure, f"{spec} (world {world})")


# CI retries in place through test_raise_between_many_buckets and the collective that fails
# after its launch
@pytest.mark.parametrize("world", sample(WORLDS, keep=None))
def test_raise_is_retried_in_place(tmp_path, tmp_path_factory, measure, world):
    spec = "raise:rank=1:step=4:at=backward"
    _, summary = recover(tmp_path, tmp_path_factory, world, [spec])
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["step"]) == (1, "comm_error", 4)
    record = summary["recoveries"][0]
    assert record["mode"] == "in-place retry" and record["ranks"] == []
    check_records(summary, [], measure, f"{spec} (world {world})")


def test_a_collective_that_fails_after_its_launch_is_retried_in_place(
    tmp_path, tmp_path_factory, measure
):
    # the error comes from the waiter once the op has ended, the framework already past it
    spec = "raise:rank=0:step=3:at=completion=1"
    _, summary = recover(tmp_path, tmp_path_factory, 2, [spec])
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["step"]) == (0, "comm_error", 3)
    assert summary["recoveries"][0]["mode"] == "in-place retry"
    check_records(summary, [], measure, f"{spec} (world 2)")


@pytest.mark.parametrize("world", sample(WORLDS, keep=3))
def test_two_faults(tmp_path, tmp_path_factory, measure, world):
    specs = ["kill:rank=1:step=2:at=backward", f"kill:rank={world - 1 if world > 2 else 0}"
             ":step=5:at=optimizer"]  # fmt: skip
    _, summary = recover(tmp_path, tmp_path_factory, world, specs)
    failed = [f["rank"] for f in summary["faults"]]
    assert [f["step"] for f in summary["faults"]] == [2, 5]
    assert [r["generation"] for r in summary["recoveries"]] == [1, 2]
    check_records(summary, failed, measure, f"two faults (world {world})")


def test_a_survivor_dying_as_it_parks_widens_the_recovery(tmp_path, tmp_path_factory, measure):
    """Rank 1 killed; rank 2 killed as it parks for that recovery, after the fault was
    settled: the recovery starts over with both replaced (a second fault after the plan
    still ends it), and the run is bit-identical."""
    specs = ["kill:rank=1:step=2:at=backward", "kill:rank=2:step=2:at=park"]
    _, summary = recover(tmp_path, tmp_path_factory, 3, specs)
    assert [(f["rank"], f["secondary"]) for f in summary["faults"]] == [(1, False), (2, False)]
    (record,) = summary["recoveries"]
    assert record["ranks"] == [1, 2] and record["generation"] == 2
    pids = summary["worker_pids"]
    assert len(pids["0"]) == 1, "the survivor kept its process"
    assert len(pids["2"]) == 2 and 2 <= len(pids["1"]) <= 3  # its first replacement, if started
    measure(f"widened: {record['mode']} in {record['total_s']:.2f} s")


def test_hang(tmp_path, tmp_path_factory, measure):
    spec = "hang:rank=1:step=3:at=backward"
    _, summary = recover(tmp_path, tmp_path_factory, 2, [spec])
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["step"]) == (1, "hang", 3)
    assert 1.5 <= fault["detected_after_s"] < 2.5
    check_records(summary, [1], measure, f"{spec} (world 2)")


@pytest.mark.parametrize("world", sample(WORLDS, keep=3))
def test_rollback_without_replay_log(tmp_path, tmp_path_factory, measure, world):
    spec = "kill:rank=1:step=3:at=backward"
    _, summary = recover(tmp_path, tmp_path_factory, world, [spec], extra=["--no-replay-log"])
    record = summary["recoveries"][0]
    assert record["mode"] == "rollback" and "replay log" in record["why_rollback"]
    check_records(summary, [1], measure, f"{spec} --no-replay-log (world {world})")


def test_no_recovery_allowed_stops_cleanly(tmp_path):
    result = run(["--nproc-per-node", "2", "--max-recoveries", "0", "--inject",
                  "kill:rank=1:step=2", str(DEMO), "--steps", str(STEPS), "--quiet"],
                 tmp_path)  # fmt: skip
    summary = result.summary
    assert result.returncode == 1 and summary["status"] == "failed"
    assert "--max-recoveries" in summary["message"]
    (failed,) = [x for x in result.output.splitlines() if "FAILED: rank 1" in x]
    assert "step 2" in failed
    # the state is saved before the stop (tests/test_jit_checkpoint.py resumes it)
    assert summary["jit_checkpoint"]["complete"] and "xmig: resume with: " in result.output


def test_raise_between_many_buckets(tmp_path, measure):
    """A communication error in the middle of a step with many gradient buckets: the ops the
    framework issues after the lost one must not reach the old communicator (they would pair
    with the peer's earlier buckets of the same size and corrupt them)."""
    many = ["--bucket-cap-mb", "0.02"]  # a bucket or two per layer
    base = ["--nproc-per-node", "2", "--hot-spares", "0"]
    script = [str(DEMO), "--steps", "5", "--quiet", *many]
    reference = run([*base, *script], tmp_path / "reference")
    result = run([*base, "--inject", "raise:rank=1:step=3:at=backward", *script],
                 tmp_path / "faulty")  # fmt: skip
    assert result.returncode == 0, result.output
    assert result.summary["recoveries"][0]["mode"] == "in-place retry"
    assert result.summary["final_params_sha256"] == reference.summary["final_params_sha256"]
    check_records(result.summary, [], measure, "raise between many buckets (world 2)")


@pytest.mark.parametrize("point", sample(["forward", "boundary"], keep="forward"))
def test_exception_then_later_faults_still_watched(tmp_path, tmp_path_factory, measure, point):
    """A Python exception ends rank 1's process after its replacement has started: its agent
    must keep watching the replacement and every other rank, so that a later hang is detected
    and a later kill recovered (the agent once waited on the live replacement for ever)."""
    specs = [f"raise:rank=1:step=2:at={point}", "hang:rank=2:step=4:at=backward",
             "kill:rank=1:step=5:at=backward"]  # fmt: skip
    _, summary = recover(tmp_path, tmp_path_factory, 3, specs)
    kinds = [(f["rank"], f["kind"], f["step"]) for f in summary["faults"]]
    assert kinds == [(1, "error", 2), (2, "hang", 4), (1, "signal", 5)]
    assert [r["ranks"] for r in summary["recoveries"]] == [[1], [2], [1]]
    check_records(summary, [1, 2, 1], measure, f"raise at {point}, then hang, then kill")


@pytest.mark.parametrize("spec", [f"kill:rank=2:step={STEPS - 1}:at=optimizer",
                                  pytest.param(f"kill:rank=0:step={STEPS}:at=boundary",
                                               marks=pytest.mark.long)])  # fmt: skip
def test_fault_after_peers_finished(tmp_path, tmp_path_factory, measure, spec):
    """A rank fails in (or after) the last step while its peers have finished: they stay,
    able to serve, until every rank has, so the job completes promptly and bit-identically
    instead of waiting for parks that never come."""
    result, summary = recover(tmp_path, tmp_path_factory, 3, [spec])
    assert result.elapsed < 60
    assert summary["recoveries"][0]["resume_step"] == STEPS
    check_records(summary, [int(spec.split("rank=")[1][0])], measure, f"{spec} (last step)")


def test_fault_after_peers_exited_stops_at_once(tmp_path):
    """Peers that finished and left (``os._exit``, no lingering) cannot serve a rank that
    fails after them: the job stops at once, saying so, not after the recovery timeout."""
    script = tmp_path / "exit_early.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(DEMO.parent)!r})\n"
        "import train_gpt\n"
        "args = sys.argv[1:] + (['--step-sleep', '0.5'] if os.environ['RANK'] == '2' else [])\n"
        "train_gpt.main(args)\n"
        "os._exit(0)\n"
    )
    result = run(["--nproc-per-node", "3", "--inject", f"kill:rank=2:step={STEPS}:at=boundary",
                  str(script), "--steps", str(STEPS), "--quiet"], tmp_path)  # fmt: skip
    assert result.returncode == 1, result.output
    assert "finished and exited" in result.summary["message"]
    assert result.elapsed < 40


@pytest.mark.parametrize(
    "spec",
    sample(["kill:rank=1:step=1:at=forward", "exit:rank=2:step=4:at=boundary"],
           keep="kill:rank=1:step=1:at=forward"),
)  # fmt: skip
def test_bare_module_registered(tmp_path, tmp_path_factory, measure, spec):
    """A script that trains through DDP but registers the bare module: xmig finds the DDP
    that wraps it (its bucket layout travels), and the run ends bit-identical."""
    _, summary = recover(tmp_path, tmp_path_factory, 3, [spec],
                         script_args=["--register-module"])  # fmt: skip
    check_records(summary, [int(spec.split("rank=")[1][0])], measure, f"{spec}, bare module")


@pytest.mark.parametrize("point", sample(["boundary", "collective=0", "collective=1"],
                                         keep="collective=1"))  # fmt: skip
def test_rank0_dies_inside_ddp_bucket_rebuild(tmp_path, tmp_path_factory, measure, point):
    """Rank 0 is the root of DDP's bucket-layout broadcasts in step 1: killed before (or
    between) them, its peers finish the rebuild with their own layout, which its replacement
    takes (it used to pick one of its own, which the survivors never had: a silently
    different result)."""
    spec = f"kill:rank=0:step=1:at={point}"
    _, summary = recover(tmp_path, tmp_path_factory, 3, [spec])
    assert summary["recoveries"][0]["replicas_equal"] is True
    assert summary["recoveries"][0]["verified"] is not False
    assert "not_bit_identical" not in summary["recoveries"][0]
    check_records(summary, [0], measure, f"{spec} (world 3, DDP rebuild)")


@pytest.mark.long  # the rebuild with the log, and rollbacks without it, run in CI
def test_rank0_dies_inside_ddp_bucket_rebuild_without_replay_log(
    tmp_path, tmp_path_factory, measure
):
    spec = "kill:rank=0:step=1:at=collective=1"
    _, summary = recover(tmp_path, tmp_path_factory, 3, [spec], extra=["--no-replay-log"])
    assert summary["recoveries"][0]["mode"] == "rollback"
    check_records(summary, [0], measure, f"{spec} --no-replay-log (world 3)")


ORDER_SCRIPT = """
import os, torch, xmig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        # the same sum; the branch computed last gets its gradients first
        if os.environ["XMIG_ATTEMPT"] != "0":
            hb, ha = self.b(x), self.a(x)
        else:
            ha, hb = self.a(x), self.b(x)
        return (ha + hb).pow(2).mean()

session = xmig.init(seed=7)
torch.manual_seed(7)
model = TwoBranches()
ddp = DistributedDataParallel(model, process_group=session.process_group)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
session.register(model=ddp, optimizer=optimizer)
for step in session.steps(5):
    x = torch.randn(4, 8)
    optimizer.zero_grad()
    ddp(x).backward()
    optimizer.step()
"""


def test_a_replacement_whose_gradients_come_in_another_order_says_so(tmp_path):
    """Rank 0 dies before sending DDP's layout, and its replacement's gradients become ready
    in another order than its peers': the layout its peers made themselves cannot be the one
    the fault-free run had, and the recovery says so instead of claiming bit-identity."""
    script = tmp_path / "two_branches.py"
    script.write_text(ORDER_SCRIPT)
    result = run(["--nproc-per-node", "3", "--inject", "kill:rank=0:step=1:at=boundary",
                  str(script)], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    record = result.summary["recoveries"][0]
    assert "became ready in another order" in record["not_bit_identical"]
    assert "is not bit-identical to a run without the fault" in result.output
