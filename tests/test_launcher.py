"""The launcher's side of a job: scripts written for torchrun, interrupts, job files, reports."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from xmig.coord import eventlog
from xmig.jobenv import WorkerEnv
from xmig.launch.launcher import LaunchError, find_job, remove_stale_jobs

from helpers import DEMO, finish_run, launched, run, wait_for, write_script, xmig

NOTE = "does not use xmig"

# a DDP script as written for torchrun, knowing nothing of xmig
TORCHRUN_SCRIPT = """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} done", flush=True)
    # torch 2.13's CPU build aborts at interpreter exit now and then (a gloo thread of DDP's
    # group ends during finalization; torchrun alone: 4 of 10 runs) unless DDP is gone first
    import gc
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
"""

SLEEPER = """
    import time
    time.sleep(600)
"""


def _final_line(result):
    return [line for line in result.output.splitlines() if line.startswith("xmig: job ")][-1]


def test_worker_environment_is_torchruns():
    env = WorkerEnv(rank=3, local_rank=1, world_size=4, master_addr="h", master_port=29500,
                    job_id="j1", node_rank=1, attempt=2, nnodes=2, local_world_size=2)  # fmt: skip
    environ = env.to_environ()
    expected = {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ROLE_NAME": "default",
        "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "j1",
    }  # fmt: skip
    assert {k: environ[k] for k in expected} == expected
    assert WorkerEnv.from_environ(environ) == env
    # what is not known is left out, not guessed
    bare = WorkerEnv(rank=0, local_rank=0, world_size=1, master_addr="h", master_port=1)
    assert not {"GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"} & set(bare.to_environ())


def test_a_torchrun_script_runs_unchanged(tmp_path):
    """env:// on rank 0 would host the store on MASTER_PORT, which the coordinator holds:
    as under torchrun, every rank is a client of the agent side's store."""
    script = write_script(tmp_path, TORCHRUN_SCRIPT, "plain_ddp.py")
    result = run(["--nproc-per-node", "2", "--hot-spares", "0", script], tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    assert "rank 0 of 2 done" in result.output and "rank 1 of 2 done" in result.output
    notes = [line for line in result.output.splitlines() if NOTE in line]
    assert len(notes) == 1, result.output
    assert notes[0].startswith("xmig: note: plain_ddp.py") and "xmig.init()" in notes[0]


def test_a_plain_script_is_reported_without_fault_handling(tmp_path):
    script = write_script(tmp_path, "import time\ntime.sleep(0.1)\n")
    result = run([script], tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    line = _final_line(result)
    assert "completed on 1 ranks in" in line, line
    assert "without fault handling: no rank called xmig.init()" in line
    assert "None" not in line


def test_an_xmig_script_without_steps_is_reported_without_fault_handling(tmp_path):
    # it mentions xmig, so no note at the start, but it never reported steps
    script = write_script(tmp_path, "# meant for xmig, not adapted yet\n")
    result = run([script], tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    assert NOTE not in result.output
    line = _final_line(result)
    assert "without fault handling: rank 0 reported no steps" in line and "None" not in line


def test_sigterm_exit_code_is_in_the_summary(tmp_path):
    jobs = tmp_path / "jobs"
    job = ["--nproc-per-node", "2", "--hot-spares", "0", write_script(tmp_path, SLEEPER)]
    with launched(job, tmp_path) as proc:
        wait_for(lambda: jobs.is_dir() and list(jobs.glob("*.json")), 60, "the job file")
        proc.send_signal(signal.SIGTERM)
        result = finish_run(proc, tmp_path, timeout=60)  # also: nothing of the job is left
    assert result.returncode == 130, result.output
    assert result.summary["exit_code"] == 130
    assert result.summary["interrupted"] == "SIGTERM"
    assert "; exit code 130" in result.output
    assert not list(jobs.glob("*.json"))


def test_xmig_stop_ends_a_running_job_with_its_reason(tmp_path):
    """``xmig stop`` stops the job's workers within the stop grace; the job fails with the
    reason given, and its event log says how it ended."""
    jobs = tmp_path / "jobs"
    job = ["--nproc-per-node", "2", "--hot-spares", "0", "--stop-grace", "1",
           write_script(tmp_path, SLEEPER)]  # fmt: skip
    with launched(job, tmp_path) as proc:
        wait_for(lambda: jobs.is_dir() and list(jobs.glob("*.json")), 60, "the job file")
        env = {"XMIG_JOBS_DIR": str(jobs)}
        # the job file comes before every agent has said hello: the job is running after
        wait_for(lambda: ": running," in xmig("status", env=env, timeout=60).stdout, 60,
                 "the job to run")  # fmt: skip
        stopped = xmig("stop", "--reason", "maintenance window", env=env, timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == "xmig: stopping the job"
        result = finish_run(proc, tmp_path, timeout=60)  # also: nothing of the job is left
    assert result.returncode == 1, result.output
    assert result.summary["message"] == "failed: maintenance window"
    assert result.summary["stop_s"] < 1 + 10  # the grace, and the agents' slack at most
    events = eventlog.read(Path(result.summary["event_log"]))
    assert events[-1]["event"] == "outcome" and events[-1]["status"] == "failed"
    assert {"from": "running", "to": "stopping"} in [
        {k: e.get(k) for k in ("from", "to")} for e in events if e["event"] == "job"
    ]
    refused = xmig("stop", env=env, timeout=60)  # no job is left to stop
    assert refused.returncode == 2 and "no running xmig job" in refused.stderr


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def _job_file(folder, name, **fields):
    data = {"job_id": name, "coordinator": "127.0.0.1:1", "token": "t", **fields}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    folder = tmp_path / "jobs"
    folder.mkdir()
    monkeypatch.setenv("XMIG_JOBS_DIR", str(folder))
    return folder


def _stale_and_live(folder):
    me = psutil.Process()
    stale = [
        _job_file(folder, "dead", launcher_pid=_dead_pid(), launcher_started=time.time()),
        _job_file(folder, "dead-old-format", launcher_pid=_dead_pid()),
        # a live PID, but of a process started at another time: the PID was reused
        _job_file(folder, "reused", launcher_pid=me.pid, launcher_started=me.create_time() - 60),
    ]
    garbage = folder / "garbage.json"
    garbage.write_text("{not json")
    stale.append(garbage)
    live = _job_file(folder, "live", launcher_pid=me.pid, launcher_started=me.create_time())
    return stale, live


def test_find_job_skips_stale_files(jobs):
    stale, live = _stale_and_live(jobs)
    assert find_job(None).job_id == "live"
    assert find_job("live").launcher_pid == os.getpid()
    for path in stale:
        with pytest.raises(LaunchError, match="no running job"):
            find_job(path.stem)
    live.unlink()
    with pytest.raises(LaunchError, match="no running xmig job"):
        find_job(None)


def test_a_start_removes_stale_job_files(tmp_path, jobs):
    """A SIGKILLed launcher leaves its job file (with the job's token): the next start removes
    it, and never a live job's."""
    stale, live = _stale_and_live(jobs)
    result = run([write_script(tmp_path, "pass\n")], tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    assert sorted(p.name for p in jobs.glob("*.json")) == [live.name]
    # the finished job left its folder: its event log, which names how it ended
    (log,) = jobs.glob("*/events.jsonl")
    assert '"event": "outcome"' in log.read_text().splitlines()[-1]


def test_a_fault_beyond_the_last_step_is_an_error(tmp_path):
    """A fault whose step the script never reaches is said at once when the step count is
    known, and the run ends as bad input (exit 2): a chaos test that injected nothing must
    not pass."""
    result = run(["--nproc-per-node", "2", "--inject", "kill:rank=1:step=100", str(DEMO),
                  "--steps", "3", "--quiet"], tmp_path)  # fmt: skip
    assert result.returncode == 2, result.output
    summary = result.summary
    assert summary["status"] == "completed" and summary["exit_code"] == 2
    assert summary["unfired_faults"] == ["kill:rank=1:step=100:at=backward"]
    assert "will never fire: the script runs 3 steps" in result.output
    assert "injected faults never fired" in result.last_lines[-1]


def test_job_files_of_another_machine_are_neither_judged_nor_removed(jobs):
    """A home folder the hosts of a job share holds every host's job file: a launcher cannot
    see another machine's processes, so it leaves their files alone; ``xmig status`` takes
    this machine's file of a job first, else another host's (same job, same coordinator)."""
    me = psutil.Process()
    other = _job_file(jobs, "run-7.node1", launcher_pid=_dead_pid(), launcher_started=1.0,
                      host="another-machine", job_id="run-7")  # fmt: skip
    remove_stale_jobs(jobs)
    assert other.exists()
    assert find_job("run-7").host == "another-machine"
    _job_file(jobs, "run-7.node0", launcher_pid=me.pid, launcher_started=me.create_time(),
              host=socket.gethostname(), job_id="run-7")  # fmt: skip
    assert find_job("run-7").host == socket.gethostname()
    assert find_job(None).job_id == "run-7"  # one job, however many hosts' files


def test_a_leader_whose_connection_ended_is_reaped_before_its_standby_is_replaced():
    """(HA control plane.) A SIGKILLed leader's socket closes before its exit can be reaped:
    the launcher waits for the former leader, so that it starts a new standby in its place.
    Polled at once, it kept one coordinator fewer, and the next leader's death found no
    standby (the etcd job test's failure under load)."""
    from xmig.jobspec import JobSpec
    from xmig.launch.launcher import Launcher

    spec = JobSpec(job_id="j", script="train.py", args=(), cwd="/", nnodes=1,
                   nproc_per_node=1, control_plane="etcd://127.0.0.1:1")  # fmt: skip
    launcher = Launcher(spec, None, token="t" * 64)
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    standby = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = []
    launcher._start_candidate = lambda: started.append(True)
    launcher.candidates = [dying, standby]
    launcher.coordinator = dying
    try:
        assert dying.poll() is None  # as the launcher finds it when its connection ends
        launcher._replace_dead_candidates("1 of 3")
        assert started == [True]
        assert launcher.candidates == [standby]
    finally:
        for proc in (dying, standby):
            proc.kill()
            proc.wait()
