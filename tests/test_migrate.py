"""Live migration on CPU: a rank's process moves to another simulated host with CRIU, keeps
its PID, and the run ends with the fault-free run's parameters, bit for bit."""

import os
import re
import time

import pytest

from xmig.coord.migration import DOWNTIME_PHASES, PHASES
from xmig.migrate import criu_status
from xmig.migrate.warm import WARM_ENV
from xmig.paths import parking_files

from helpers import DEMO, finish_run, resume_printed, run, start_run, xmig

STEPS = 6
LIVE_STEPS = 16  # jobs that CLI commands talk to while they run: slack for a loaded machine
usable, why_not = criu_status()
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="migration needs root (CRIU, namespaces)"),
    pytest.mark.skipif(not usable, reason=f"CRIU is not usable here: {why_not}"),
]
_REFERENCE: dict[tuple[int, int], str] = {}


def reference_hash(world, tmp_path_factory, steps=STEPS):
    if (world, steps) not in _REFERENCE:
        folder = tmp_path_factory.mktemp(f"reference{world}-{steps}")
        result = run(["--nproc-per-node", str(world), "--hot-spares", "0", str(DEMO), "--steps",
                      str(steps), "--quiet"], folder)  # fmt: skip
        assert result.returncode == 0, result.output
        _REFERENCE[world, steps] = result.summary["final_params_sha256"]
    return _REFERENCE[world, steps]


def check_migrated(summary, rank, source, target, world, steps=STEPS, parked=True):
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["faults"] == [] and summary["recoveries"] == []
    (record,) = summary["migrations"]
    assert (record["rank"], record["from_node"], record["to_node"]) == (rank, source, target)
    # the same process, restored by CRIU: one PID for every rank, the moved one included
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values()), summary["worker_pids"]
    assert record["pid_kept"] and summary["worker_pids"][str(rank)] == [record["pid"]]
    assert summary["worker_nodes"][str(rank)] == target
    # it reported from the target node's network namespace, not the source's
    assert record["netns"] == summary["agent_netns"][str(target)]
    assert record["netns"] != summary["agent_netns"][str(source)]
    assert tuple(record["phases"]) == PHASES
    # its replay log's copies of the steps before the pause were dropped, not moved
    assert record["dropped_bytes"] > 0
    if parked:  # its tensors went through a parking file, not through CRIU's images
        assert record["room_bytes"] >= record["parked_bytes"] > 0
        assert record["prepare_error"] is None
        assert record["phases"]["park"] > 0 and record["phases"]["unpark"] > 0
        # it parked at the pause, before it reported itself paused
        assert record["phases"]["stop"] >= record["phases"]["park"]
    else:  # no room: it moved with its tensors, and said why
        assert record["room_bytes"] == record["parked_bytes"] == 0
        assert "does not exist" in record["prepare_error"]
    assert parking_files(summary["job_id"]) == []  # none is left
    assert 0 < record["downtime_s"] <= record["total_s"] < 60
    downtime = sum(record["phases"][k] for k in DOWNTIME_PHASES)
    assert downtime == pytest.approx(record["downtime_s"], abs=1e-3)
    assert record["image_bytes"] > 0
    # CRIU's own accounts: what it wrote, it read back in the target node
    assert record["criu_dump_stats"]["pages_written"] > 0
    assert record["criu_restore_stats"]["pages_restored"] > 0
    assert 0 < record["criu_restore_stats"]["restore_s"] <= record["criu_restore_s"]
    # the agents' own steps: CRIU's commands as they timed them, within the phases they are in
    dump, restore = record["dump_steps"], record["restore_steps"]
    assert {"wait_ready", "criu_dump", "image_size"} <= set(dump)
    assert dump["criu_dump"] == pytest.approx(record["criu_dump_s"], abs=1e-3)
    phases = record["phases"]
    assert sum(dump.values()) <= phases["dump"] + phases["gpu_checkpoint"] + 1e-3
    assert {"criu_restore", "criu_stats"} <= set(restore)
    assert restore["criu_restore"] <= record["criu_restore_s"] + 1e-3
    assert sum(restore.values()) <= phases["restore"] + phases["gpu_restore"] + 1e-3
    assert len(summary["final_params_sha256"]) == 64
    assert summary["world_size"] == world
    return record


@pytest.mark.parametrize(
    "layout",
    [("2", "1"), pytest.param(("1", "3"), marks=pytest.mark.long)],
    ids=["rank1-of-2", "rank1-of-3"],
)
def test_injected_migration_is_bit_identical(tmp_path, tmp_path_factory, measure, layout):
    nnodes, nproc = layout
    world = int(nnodes) * int(nproc)
    source, target = (1, 2) if nnodes == "2" else (0, 1)
    # the images (and the parking file, which the target finds in place) go over the network
    # as between machines, though the simulated hosts share this one. The steps are paced:
    # unpaced, the job once ended (6 steps in 0.19 s) before the move's pause could come
    result = run(["--nnodes", nnodes, "--nproc-per-node", nproc, "--spare-nodes", "1",
                  "--simulate-hosts", "--hot-spares", "0", "--inject", "migrate:rank=1:step=3",
                  str(DEMO), "--steps", str(STEPS), "--quiet", "--step-sleep", "0.2"], tmp_path,
                 env={"XMIG_STREAM_IMAGES": "1"})  # fmt: skip
    assert result.returncode == 0, result.output
    record = check_migrated(result.summary, 1, source, target, world)
    assert record["phases"]["transfer"] > 0
    assert record["step"] >= 3  # it starts at step 3; the moving rank prepares, then all pause
    # the rank's own interface (its address, which NCCL keeps) went with it
    assert record["interface"] == "xr1"
    assert result.summary["final_params_sha256"] == reference_hash(world, tmp_path_factory)
    phases = " ".join(f"{k}={v:.3f}" for k, v in record["phases"].items())
    measure(f"migrate rank 1 of {world}, node {source} -> {target}: downtime "
            f"{record['downtime_s']:.2f} s, image {record['image_bytes'] / 1e6:.0f} MB "
            f"({phases})")  # fmt: skip


def _wait_for_step(env, step, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = xmig("status", env=env, timeout=30)
        found = re.search(r"rank 1: step (\d+)", status.stdout)
        if status.returncode == 0 and found and int(found.group(1)) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank 1 did not reach step {step} within {timeout} s")


def test_migrate_command_moves_a_running_rank(tmp_path, tmp_path_factory):
    env = {"XMIG_JOBS_DIR": str(tmp_path / "jobs")}
    # no room to park its tensors in: the rank moves with them. Every node writes some of
    # its memory once as it starts (a machine that backs memory on first use moves faster)
    proc = start_run(["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                      "--simulate-hosts", "--hot-spares", "0", str(DEMO), "--steps",
                      str(LIVE_STEPS), "--quiet", "--step-sleep", "0.5"], tmp_path,
                     env={"XMIG_PARK_DIR": str(tmp_path / "no-such-folder"),
                          WARM_ENV: "0.3"})  # fmt: skip
    _wait_for_step(env, 1)
    moved = xmig("migrate", "--rank", "1", "--to", "2", env=env, timeout=30)
    assert moved.returncode == 0, moved.stderr
    assert "moving rank 1 from node 1 to node 2" in moved.stdout
    result = finish_run(proc, tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    record = check_migrated(result.summary, 1, 1, 2, 2, LIVE_STEPS, parked=False)
    assert record["phases"]["transfer"] == 0  # one machine: the images are read in place
    expected = reference_hash(2, tmp_path_factory, LIVE_STEPS)
    assert result.summary["final_params_sha256"] == expected
    # the target node had written its 0.3 GB and given them back before the move came
    assert re.search(
        r"agent 2: warmed 0\.3 GB of this host's memory in [0-9.]+ s \(", result.output
    ), result.output


def test_bad_migrations_are_refused_and_the_job_goes_on(tmp_path, tmp_path_factory):
    env = {"XMIG_JOBS_DIR": str(tmp_path / "jobs")}
    # no CRIU on the job's nodes (the agents look where XMIG_CRIU points)
    proc = start_run(["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                      "--simulate-hosts", "--hot-spares", "0", str(DEMO), "--steps",
                      str(LIVE_STEPS), "--quiet", "--step-sleep", "0.5"], tmp_path,
                     env={"XMIG_CRIU": "/nonexistent/criu"})  # fmt: skip
    _wait_for_step(env, 1)
    cases = [
        (["--rank", "7", "--to", "2"], "rank 7 does not exist"),
        (["--rank", "1", "--to", "9"], "node 9 does not exist"),
        (["--rank", "1", "--to", "1"], "rank 1 is already on node 1"),
        (["--rank", "1", "--to", "2"], "CRIU is not usable on node 1"),
    ]
    for args, expected in cases:
        refused = xmig("migrate", *args, env=env, timeout=30)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("xmig: error: migration refused: ")
        assert expected in lines[0]
    result = finish_run(proc, tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["migrations"] == [] and summary["faults"] == []
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values())
    assert summary["final_params_sha256"] == reference_hash(2, tmp_path_factory, LIVE_STEPS)


def test_a_fault_while_the_world_pauses_for_a_move_saves_the_state(tmp_path, tmp_path_factory):
    """3 simulated hosts and a spare: rank 1 is to move at step 3, and rank 2 is killed as it
    pauses (at step 4 or 5: the pause's step depends on when the room is made). The move is
    given up and the ranks left save the state (a failed migration stopped the job with
    nothing saved); the resumed run ends bit for bit where the fault-free run does."""
    steps = STEPS
    args = ["--nnodes", "3", "--nproc-per-node", "1", "--spare-nodes", "1", "--simulate-hosts",
            "--hot-spares", "0", "--inject", "migrate:rank=1:step=3",
            "--inject", "kill:rank=2:step=4:at=pause", "--inject", "kill:rank=2:step=5:at=pause",
            str(DEMO), "--steps", str(steps), "--quiet", "--step-sleep", "0.3"]  # fmt: skip
    result = run(args, tmp_path)
    assert result.returncode == 1, result.output
    assert "fault during a migration" in result.output
    saved = result.summary["jit_checkpoint"]
    assert saved["path"] and saved["complete"] and saved["step"] in (4, 5), saved
    resumed = resume_printed(result.output, tmp_path)
    assert resumed.returncode == 0, resumed.output
    expected = reference_hash(3, tmp_path_factory, steps=steps)
    assert resumed.summary["final_params_sha256"] == expected


@pytest.mark.long
def test_a_rank_lost_after_a_move_is_recovered_from_the_moved_one(tmp_path, tmp_path_factory):
    """Rank 1 moves (dropping its replay log's copies of the steps before its pause), then
    rank 0 is killed in a later step's backward: the moved rank serves the replacement and
    replays that step from the copies it has taken since, and the run ends bit for bit
    where the fault-free run does."""
    steps = 8
    result = run(["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
                  "--simulate-hosts", "--hot-spares", "0", "--inject", "migrate:rank=1:step=3",
                  "--inject", "kill:rank=0:step=6:at=backward", str(DEMO), "--steps",
                  str(steps), "--quiet", "--step-sleep", "0.3"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = result.summary
    (record,) = summary["migrations"]
    assert record["pid_kept"] and record["step"] < 6, record
    assert summary["worker_pids"]["1"] == [record["pid"]]  # the moved rank survived
    assert len(summary["recoveries"]) == 1 and len(summary["worker_pids"]["0"]) == 2
    assert summary["final_params_sha256"] == reference_hash(2, tmp_path_factory, steps)
