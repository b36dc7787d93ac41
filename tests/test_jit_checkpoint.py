"""Nothing lost when recovery is impossible: the ranks that still hold the state write a
just-in-time checkpoint, the job stops with the command that resumes it, and the resumed run
ends bit for bit where the fault-free run ends. A checkpoint that is not whole, was altered, or
comes from another job is refused before anything starts, and nothing is written over."""

import hashlib
import json
import os
import select
import shlex
import shutil
import time
from pathlib import Path

import psutil
import pytest

from helpers import (
    DEMO,
    FAST,
    REPO,
    fault_free_sha256,
    finish_bit_identical,
    finish_run,
    job_processes,
    run,
    start_run,
)

STEPS = 8
DEMO_ARGS = [str(DEMO), "--preset", "tiny", "--steps", str(STEPS), "--quiet"]
LAZY = REPO / "tests" / "scripts" / "lazy.py"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="simulated hosts need root (network namespaces)"
)


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _resume_line(output: str) -> list[str]:
    (line,) = [x for x in output.splitlines() if x.startswith("xmig: resume with: ")]
    return shlex.split(line.removeprefix("xmig: resume with: "))


def stopped_with_checkpoint(result, step=None):
    """The job failed, saved a whole checkpoint (of ``step``) and said how to resume it."""
    assert result.returncode == 1, result.output
    saved = result.summary["jit_checkpoint"]
    assert saved["path"] and saved["complete"], saved
    if step is not None:
        assert saved["step"] == step
    folder = Path(saved["path"])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == saved["step"] and manifest["complete"]
    assert not any(p.name.endswith(".partial") for p in folder.parent.iterdir())
    assert f"just-in-time checkpoint of step {saved['step']} in {folder}" in result.output
    command = _resume_line(result.output)
    assert command[:4] == ["xmig", "run", "--resume", str(folder)]
    assert "--inject" not in command
    return folder, command


def resume(command, tmp_path):
    """Run the printed resume command (the launcher's flags after ``xmig run``)."""
    folder = tmp_path / "resumed"
    folder.mkdir()
    args = list(command[2:])
    where = args.index("--summary")  # the job's own; the test reads the resumed run's
    del args[where : where + 2]
    return run(args, folder)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A checkpoint written after a kill with ``--max-recoveries 0`` (2 ranks, DDP)."""
    tmp = tmp_path_factory.mktemp("maxrec")
    result = run(["--nproc-per-node", "2", *FAST, "--max-recoveries", "0", "--inject",
                  "kill:rank=1:step=4:at=backward", *DEMO_ARGS], tmp)  # fmt: skip
    return result, tmp


def test_max_recoveries_used_up_saves_the_state_and_the_resume_is_bit_identical(
    saved_checkpoint, tmp_path, tmp_path_factory
):
    result, _ = saved_checkpoint
    expected = fault_free_sha256(["--nproc-per-node", "2", *FAST, *DEMO_ARGS], tmp_path_factory)
    folder, command = stopped_with_checkpoint(result, step=4)
    assert "--max-recoveries (--max-recoveries)" not in result.output
    assert result.summary["jit_checkpoint"]["shards"] == 1  # DDP: one writer for every rank
    before = _files(folder)
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected
    assert resumed.summary["resumed_from"] == str(folder)
    assert f"resuming from {folder}: step 4" in resumed.output
    assert _files(folder) == before  # read, never written


@pytest.mark.parametrize("damage, refusal", [
    ("flip", "checksum differs"),
    ("truncate", "truncated or altered"),
    ("manifest", "has no manifest.json"),
])  # fmt: skip
def test_a_damaged_checkpoint_is_refused_and_nothing_runs(saved_checkpoint, tmp_path, damage,
                                                          refusal):  # fmt: skip
    result, _ = saved_checkpoint
    source = Path(result.summary["jit_checkpoint"]["path"])
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    shard = folder / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (folder / "manifest.json").unlink()
    before = _files(folder)
    refused = run(["--nproc-per-node", "2", *FAST, "--resume", str(folder), *DEMO_ARGS],
                  tmp_path, timeout=60)  # fmt: skip
    assert refused.returncode == 2
    (line,) = [x for x in refused.output.splitlines() if x.startswith("xmig: error:")]
    assert line.startswith("xmig: error: cannot resume: ") and refusal in line
    assert "job 2" not in refused.output and refused.summary is None  # nothing started
    assert _files(folder) == before


def test_a_checkpoint_of_another_layout_or_script_arguments_is_refused(saved_checkpoint,
                                                                       tmp_path):  # fmt: skip
    result, _ = saved_checkpoint
    folder = Path(result.summary["jit_checkpoint"]["path"])
    for flags, args, refusal in (
        (["--nproc-per-node", "4"], DEMO_ARGS, "another world layout: 2 ranks"),
        (["--nproc-per-node", "2"], [*DEMO_ARGS[:-1], "--lr", "0.1"], "other script arguments"),
    ):
        refused = run([*flags, *FAST, "--resume", str(folder), *args], tmp_path, timeout=60)
        assert refused.returncode == 2 and refusal in refused.output, refused.output


def test_a_checkpoint_of_ddps_rebuild_step_resumes_with_its_layout(tmp_path, tmp_path_factory):
    """Rank 2 dies before its peers have DDP's bucket layout (step 1, where DDP rebuilds its
    buckets from rank 0's gradient order; with 3 ranks another layout changes the last bits):
    the writer finishes the rebuild with its own layout, and the resumed job takes it."""
    three = ["--nproc-per-node", "3", *FAST]
    expected = fault_free_sha256([*three, *DEMO_ARGS], tmp_path_factory)
    result = run([*three, "--max-recoveries", "0", "--inject",
                  "kill:rank=2:step=1:at=collective=0", *DEMO_ARGS], tmp_path)  # fmt: skip
    folder, command = stopped_with_checkpoint(result, step=1)
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected
    assert "warning" not in resumed.output


@pytest.mark.long  # CI: the same in the fault matrix's examples (tests/test_fault_matrix.py)
def test_a_second_kill_during_the_recovery_saves_the_last_survivor(tmp_path, tmp_path_factory):
    """Rank 1 dies; rank 2 dies as the recovery's pull begins: rank 0 still holds the state."""
    three = ["--nproc-per-node", "3", *FAST]
    expected = fault_free_sha256([*three, *DEMO_ARGS], tmp_path_factory)
    result = run([*three, "--inject", "kill:rank=1:step=3:at=backward", "--inject",
                  "kill:rank=2:step=3:at=pull", *DEMO_ARGS], tmp_path)  # fmt: skip
    folder, command = stopped_with_checkpoint(result, step=3)
    assert "a second fault hit during recovery" in result.summary["message"]
    assert result.summary["jit_checkpoint"]["shards"] == 1
    assert json.loads((folder / "manifest.json").read_text())["shards"][0]["writer"] == 0
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected


def test_the_same_rank_failing_twice_at_one_step_is_saved_and_resumed(tmp_path, tmp_path_factory):
    """Rank 1 dies in step 3's forward; its replacement dies in the same step's optimizer."""
    two = ["--nproc-per-node", "2", *FAST]
    expected = fault_free_sha256([*two, *DEMO_ARGS], tmp_path_factory)
    result = run([*two, "--inject", "kill:rank=1:step=3:at=forward", "--inject",
                  "kill:rank=1:step=3:at=optimizer", *DEMO_ARGS], tmp_path)  # fmt: skip
    folder, command = stopped_with_checkpoint(result)
    assert "failed again at step 3" in result.summary["message"]
    assert len(result.summary["recoveries"]) == 1
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected


@needs_root
@pytest.mark.long  # CI: a lost agent (test_a_lost_agent_saves_the_other_nodes_ranks)
def test_a_lost_node_without_a_spare_is_saved_and_resumed(tmp_path, tmp_path_factory):
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--simulate-hosts", *FAST]
    expected = fault_free_sha256([*nodes, *DEMO_ARGS], tmp_path_factory)
    result = run([*nodes, "--inject", "node:rank=1:step=3:at=backward", *DEMO_ARGS], tmp_path)
    folder, command = stopped_with_checkpoint(result, step=3)
    assert "no spare node" in result.summary["message"] and result.summary["lost_nodes"] == [1]
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected


def test_hsdp_with_both_replicas_of_a_shard_lost_saves_the_rest_and_says_so(tmp_path):
    """A node of 2 ranks holding one shard's both replicas is lost: the other shard is
    written, the checkpoint says it is incomplete, and no resume command is given."""
    result = run(["--nnodes", "2", "--nproc-per-node", "2", *FAST, "--inject",
                  "node:rank=1:step=3:at=backward", str(REPO / "tests" / "scripts" / "fsdp.py"),
                  "--layout", "hsdp-by-node"], tmp_path)  # fmt: skip
    assert result.returncode == 1, result.output
    saved = result.summary["jit_checkpoint"]
    assert saved["path"] and not saved["complete"] and saved["shards"] == 1
    assert "no live copy of" in saved["why"] and "resume with" not in result.output


def test_one_rank_alone_has_no_live_copy_to_save(tmp_path):
    result = run(["--nproc-per-node", "1", *FAST, "--inject", "kill:rank=0:step=3", *DEMO_ARGS],
                 tmp_path)  # fmt: skip
    assert result.returncode == 1
    assert result.summary["jit_checkpoint"]["path"] is None
    assert "no just-in-time checkpoint: no rank that holds the state is left" in result.output


def test_a_step_that_cannot_be_replayed_is_rolled_back(tmp_path, tmp_path_factory):
    """A module broadcasts a buffer at its process's third forward (step 2): a replacement,
    a new process, does not; the replay is refused, the step rolled back on every rank with
    a new replacement, and the run ends bit-identical."""
    two = ["--nproc-per-node", "2", *FAST]
    expected = fault_free_sha256([*two, str(LAZY)], tmp_path_factory)
    result = run([*two, "--inject", "kill:rank=1:step=2:at=backward", str(LAZY)], tmp_path)
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    (recovery,) = result.summary["recoveries"]
    assert recovery["mode"] == "rollback" and "replaying it failed" in recovery["why_rollback"]
    assert "replay impossible" in result.output
    assert len(result.summary["worker_pids"]["1"]) == 3  # the refusing replacement ended
    assert len(result.summary["worker_pids"]["0"]) == 1


# ---- xmig's own processes lost -----------------------------------------------------------------


def _read_until(proc, text, timeout=120.0):
    """The launcher's output as soon as it holds ``text`` (all read so far: read from the
    pipe itself, so that no line waits in a buffer for the next one)."""
    deadline, read = time.monotonic() + timeout, b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            read += chunk
            if text.encode() in read:
                return read.decode(errors="replace")
    raise AssertionError(f"no {text!r} within {timeout} s:\n{read.decode(errors='replace')}")


def _job_process(output, role):
    job_id = output.split("xmig: job ", 1)[1].split(":", 1)[0]
    (proc,) = [p for p in job_processes(job_id) if role in " ".join(p.cmdline())]
    return proc


SLOW_DEMO = [str(DEMO), "--preset", "tiny", "--steps", "10", "--step-sleep", "0.3"]


@pytest.mark.parametrize("when", [pytest.param("mid-run", marks=pytest.mark.long),
                                  "mid-recovery"])  # fmt: skip
def test_a_lost_coordinator_loses_nothing(tmp_path, tmp_path_factory, when):
    """The coordinator SIGKILLed and not started again: every rank saves its own state, the
    launcher makes one checkpoint of it and the summary, no process of the job is left, the
    resume is bit-identical."""
    two = ["--nproc-per-node", "2", *FAST]
    expected = fault_free_sha256([*two, *SLOW_DEMO], tmp_path_factory)
    extra = ["--inject", "kill:rank=1:step=4:at=backward"] if when == "mid-recovery" else []
    proc = start_run([*two, "--coordinator-restarts", "0", *extra, *SLOW_DEMO], tmp_path)
    seen = _read_until(proc, "recovery to generation 1" if extra else "step 3 loss")
    _job_process(seen, "xmig.coord").kill()
    result = finish_run(proc, tmp_path, timeout=120)  # no process of the job left: checked
    result.output = seen + result.output
    assert result.summary["coordinator"] == "lost"
    assert "the coordinator died" in result.output
    folder, command = stopped_with_checkpoint(result)
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected


def test_a_restarted_coordinator_takes_the_job_up_and_recovers_a_later_fault(
    tmp_path, tmp_path_factory
):
    """The coordinator SIGKILLed mid-run: its launcher starts it again, it reads its
    snapshot, the agent rejoins, the workers go on in the same processes and connect to the
    new store; a kill afterwards is recovered through it, and the run is bit-identical."""
    two = ["--nproc-per-node", "2", *FAST]
    slow = [str(DEMO), "--preset", "tiny", "--steps", "16", "--step-sleep", "0.3"]
    expected = fault_free_sha256([*two, *slow], tmp_path_factory)
    proc = start_run([*two, "--inject", "kill:rank=1:step=11:at=backward", *slow], tmp_path)
    seen = _read_until(proc, "step 3 loss")
    first = _job_process(seen, "xmig.coord")
    first.kill()
    result = finish_run(proc, tmp_path, timeout=120)
    result.output = seen + result.output
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected, "not bit-identical"
    assert "the coordinator died (exit -9); starting it again (1 of 3)" in result.output
    restarts = summary["coordinator_restarts"]
    assert len(restarts) == 1, (restarts, result.output[-4000:])
    (restart,) = restarts
    assert restart["state_before"] == "running" and restart["busy"] is None
    assert restart["missing_nodes"] == [] and summary["coordinator_pid"] != first.pid
    assert summary["worker_pids"]["0"] == [summary["worker_pids"]["0"][0]]  # same process
    (recovery,) = summary["recoveries"]
    assert recovery["ranks"] == [1] and recovery["verified"] is True


@pytest.mark.long  # the restart itself is the test above's
def test_a_hung_coordinator_is_stopped_and_started_again(tmp_path, tmp_path_factory):
    """The coordinator stopped (SIGSTOP: alive, its connections open, silent): its launcher,
    which asks it how the job is every 2 s, kills it once it has not answered for 10 s and
    starts it again; the job goes on in the same worker processes, bit-identical."""
    two = ["--nproc-per-node", "2", *FAST]
    slow = [str(DEMO), "--preset", "tiny", "--steps", "12", "--step-sleep", "0.3"]
    expected = fault_free_sha256([*two, *slow], tmp_path_factory)
    proc = start_run([*two, *slow], tmp_path)
    seen = _read_until(proc, "step 3 loss")
    hung = _job_process(seen, "xmig.coord")
    hung.suspend()
    stopped = time.monotonic()
    seen += _read_until(proc, "it is hung")
    assert 10 <= time.monotonic() - stopped < 30
    result = finish_bit_identical(proc, tmp_path, seen, expected, timeout=120)
    summary = result.summary
    assert f"the coordinator (PID {hung.pid}) has not answered for 10 s" in result.output
    assert "the coordinator died (exit -9); starting it again (1 of 3)" in result.output
    assert summary["coordinator_pid"] != hung.pid
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values())  # same processes


@pytest.mark.long  # test_etcd.py's job has its leader killed mid-recovery in CI
def test_a_recovery_the_coordinator_died_in_starts_over(tmp_path, tmp_path_factory):
    """The coordinator SIGKILLed in the middle of a recovery: the restarted one does not know
    where each process stood in the plan, so it ends the replacement and starts the recovery
    over, rolling the step back on every rank; the run ends bit-identical."""
    two = ["--nproc-per-node", "2", *FAST]
    expected = fault_free_sha256([*two, *SLOW_DEMO], tmp_path_factory)
    proc = start_run([*two, "--inject", "kill:rank=1:step=4:at=backward", *SLOW_DEMO], tmp_path)
    seen = _read_until(proc, "step 1 loss")
    coordinator = _job_process(seen, "xmig.coord")  # found ahead: a search takes seconds
    seen += _read_until(proc, "recovery to generation 1")
    coordinator.kill()  # the replacement starts from scratch meanwhile (~2 s)
    result = finish_run(proc, tmp_path, timeout=120)
    result.output = seen + result.output
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected, "not bit-identical"
    (restart,) = summary["coordinator_restarts"]
    assert restart["busy"] == "recovery" and restart["state_before"] == "recovering"
    assert "during the recovery: it starts over" in result.output
    (recovery,) = summary["recoveries"]
    assert recovery["generation"] == 2 and recovery["mode"] == "rollback"
    assert len(summary["worker_pids"]["0"]) == 1  # the survivor kept its process
    assert len(summary["worker_pids"]["1"]) == 3  # killed, the first replacement ended, the second


def test_a_lost_agent_saves_the_other_nodes_ranks(tmp_path, tmp_path_factory):
    """The agent of node 1 SIGKILLed (its rank dies with it): node 0's rank saves the state."""
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", *FAST]
    expected = fault_free_sha256([*nodes, *SLOW_DEMO], tmp_path_factory)
    proc = start_run([*nodes, *SLOW_DEMO], tmp_path)
    seen = _read_until(proc, "step 3 loss")
    agents = [p for p in psutil.Process(proc.pid).children() if "xmig.agent" in p.cmdline()]
    (agent,) = [p for p in agents if p.cmdline()[-1] == "1"]
    agent.kill()
    result = finish_run(proc, tmp_path, timeout=120)
    result.output = seen + result.output
    folder, command = stopped_with_checkpoint(result)
    assert result.summary["lost_nodes"] == [1]
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["final_params_sha256"] == expected


EXACT = REPO / "tests" / "scripts" / "resize_exact.py"


def test_a_fault_while_the_world_waits_to_resize_saves_the_paused_ranks_state(tmp_path):
    """3 ranks are to shrink to 2 at step 4's start; rank 0 hangs at step 3's update, after
    that step's collectives, so ranks 1 and 2 pause at step 4 holding its state and wait
    there until the hang is found (2 s). The resize fails and the job stops, the paused
    ranks saving that state (a job whose resize or migration failed stopped with nothing
    saved, and a paused rank could not park to save). Resumed, the job ends with the exact
    weight of the fault-free run (``resize_exact.py``: a sample lost, repeated or misweighed
    changes it)."""
    out = tmp_path / "w.json"
    args = ["--nproc-per-node", "3", *FAST, "--inject", "resize:world=2:step=4",
            "--inject", "hang:rank=0:step=3:at=optimizer", str(EXACT), "--steps", "8",
            "--out", str(out), "--step-sleep", "0.05"]  # fmt: skip
    result = run(args, tmp_path)
    assert "fault during a resize" in result.output, result.output
    assert "saving a just-in-time checkpoint from ranks [1, 2]" in result.output
    _folder, command = stopped_with_checkpoint(result, step=4)
    resumed = resume(command, tmp_path)
    assert resumed.returncode == 0, resumed.output
    assert json.loads(out.read_text()) == {"w": -sum(6 * s + 2.5 for s in range(8)),
                                           "world_size": 3}  # fmt: skip
