"""Faults that nobody injected, a lost agent, interrupts, and faults injected at run time."""

import json
import os
import signal
import time

import psutil
import pytest

from helpers import (
    DEMO,
    fault_free_sha256,
    finish_run,
    job_processes,
    run,
    start_run,
    wait_for,
    write_script,
    xmig,
)


def _job_file(tmp_path):
    def found():
        files = list((tmp_path / "jobs").glob("*.json")) if (tmp_path / "jobs").is_dir() else []
        return json.loads(files[0].read_text()) if files else None

    return wait_for(found, 60, "the job file")


def _pid_files(tmp_path, n):
    def found():
        files = sorted(tmp_path.glob("pid-*"))
        texts = [f.read_text() for f in files]
        # a file is created before its PID is written: both must be there
        return [int(t) for t in texts] if len(texts) == n and all(texts) else None

    return wait_for(found, 60, "the workers' pid files")


SLEEPER = """
    import os, sys, time
    open(os.path.join(sys.argv[1], "pid-" + os.environ["RANK"]), "w").write(str(os.getpid()))
    time.sleep(float(sys.argv[2]))
"""


SPAWNER = """
    import os, subprocess, sys
    out = sys.argv[1]
    child = subprocess.Popen(["sleep", "600"])
    name = f"child-{os.environ['RANK']}-{os.environ['XMIG_ATTEMPT']}"
    open(os.path.join(out, name), "w").write(str(child.pid))
    sys.path.insert(0, os.path.dirname(sys.argv[2]))
    import train_gpt
    train_gpt.main(sys.argv[3:])
"""


def test_children_of_workers_end_with_them(tmp_path):
    """Processes a worker starts end with it: those of a rank killed by a fault at its
    recovery, the others' when the job ends (as torchrun kills each worker's group)."""
    script = write_script(tmp_path, SPAWNER)
    job = ["--nproc-per-node", "2", "--inject", "kill:rank=1:step=2:at=backward", script,
           str(tmp_path), str(DEMO), "--steps", "5", "--quiet"]  # fmt: skip
    result = run(job, tmp_path)
    assert result.returncode == 0, result.output
    children = {f.name: int(f.read_text()) for f in tmp_path.glob("child-*")}
    assert set(children) == {"child-0-0", "child-1-0", "child-1-1"}
    left = [pid for pid in children.values() if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert not left, f"children of workers outlived the job: {left}"


def test_plain_script_exit_code(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, sys, time
        time.sleep(0.3)
        sys.exit(3 * int(os.environ["RANK"]))
    """,
    )
    result = run(["--nproc-per-node", "2", script], tmp_path, timeout=60)
    fault = result.summary["faults"][0]
    assert result.returncode == 1
    assert (fault["rank"], fault["kind"], fault["detail"]) == (1, "exit", "exit code 3")
    assert fault["step"] is None and "before its first step" in result.last_lines[-2]
    # a worker that never joined with xmig.init() cannot be parked: a clear stop, no attempt
    assert "never called xmig.init()" in result.summary["message"]
    assert result.summary["recoveries"] == []


def test_external_sigkill(tmp_path, measure):
    proc = start_run(
        ["--nproc-per-node", "2", write_script(tmp_path, SLEEPER), str(tmp_path), "60"], tmp_path
    )
    pids = _pid_files(tmp_path, 2)
    os.kill(pids[1], signal.SIGKILL)
    result = finish_run(proc, tmp_path, timeout=60)
    fault = result.summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["detail"]) == (1, "signal", "SIGKILL")
    assert result.returncode == 1 and result.summary["worker_pids"]["1"] == [pids[1]]
    measure(f"external SIGKILL of a worker: job stopped {result.summary['stop_s']:.3f} s after")


def test_hang_without_steps(tmp_path, measure):
    # a worker that joined with xmig.init() but never reaches session.steps(): still no hang
    script = write_script(
        tmp_path,
        """
        import os, sys, time
        import xmig
        xmig.init()
        open(os.path.join(sys.argv[1], "pid-" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(60)
    """,
    )
    proc = start_run(
        ["--nproc-per-node", "2", "--heartbeat-timeout", "1.5", script, str(tmp_path)], tmp_path
    )
    pids = _pid_files(tmp_path, 2)
    os.kill(pids[0], signal.SIGSTOP)
    result = finish_run(proc, tmp_path, timeout=60)
    fault = result.summary["faults"][0]
    assert (fault["rank"], fault["kind"]) == (0, "hang")
    assert fault["fault_time_source"] == "last_heartbeat"
    assert fault["detected_after_s"] < 1.5 + 1.0
    assert "session.steps()" in result.summary["message"]
    assert result.returncode == 1
    measure(
        f"external SIGSTOP, heartbeat timeout 1.5 s: detected "
        f"{fault['detected_after_s']:.3f} s after the last heartbeat"
    )


@pytest.mark.parametrize("how", ["killed", pytest.param("silent", marks=pytest.mark.long)])
def test_lost_agent_stops_the_job(tmp_path, how):
    """An agent that dies (its connection closes) or goes silent (SIGSTOP: no heartbeat to
    the coordinator) is a lost node; with no spare node the job stops, within a bound."""
    proc = start_run(
        ["--nnodes", "2", "--nproc-per-node", "1", "--heartbeat-timeout", "1.5", "--stop-grace",
         "1", write_script(tmp_path, SLEEPER), str(tmp_path), "60"],
        tmp_path,
    )  # fmt: skip
    _pid_files(tmp_path, 2)
    launcher = psutil.Process(proc.pid)
    agent = wait_for(
        lambda: [
            p for p in launcher.children() if "xmig.agent" in p.cmdline() and p.cmdline()[-1] == "1"
        ],
        30,
        "the agent of node 1",
    )[0]
    started = time.monotonic()
    if how == "killed":
        agent.kill()
    else:
        agent.suspend()
    result = finish_run(proc, tmp_path, timeout=60)
    fault = result.summary["faults"][0]
    assert fault["kind"] == "agent_lost" and fault["node"] == 1
    assert result.summary["lost_nodes"] == [1]
    assert "no spare node" in result.summary["message"]
    assert result.returncode == 1
    # noticed and stopped well within the 60 s the workers would have slept
    assert time.monotonic() - started < 40


def test_interrupt_stops_everything(tmp_path):
    proc = start_run(
        ["--nproc-per-node", "2", write_script(tmp_path, SLEEPER), str(tmp_path), "60"], tmp_path
    )
    _pid_files(tmp_path, 2)
    proc.send_signal(signal.SIGINT)
    result = finish_run(proc, tmp_path, timeout=60)
    assert result.returncode == 130
    assert "interrupted by SIGINT" in result.summary["message"]


def test_killed_launcher_takes_the_job_with_it(tmp_path):
    proc = start_run(
        ["--nproc-per-node", "2", write_script(tmp_path, SLEEPER), str(tmp_path), "60"], tmp_path
    )
    job = _job_file(tmp_path)
    _pid_files(tmp_path, 2)
    assert len(job_processes(job["job_id"])) >= 4  # coordinator, agent, two workers
    proc.kill()
    proc.communicate(timeout=30)
    wait_for(lambda: not job_processes(job["job_id"]), 15, "the job's processes to end")


def test_inject_at_run_time_into_a_hot_spare(tmp_path, tmp_path_factory, measure):
    """A fault injected into a running job, once its hot spare is warm: the spare becomes the
    replacement, and the run still ends bit for bit where the fault-free run does."""
    job_args = ["--nproc-per-node", "2", str(DEMO), "--steps", "100", "--step-sleep", "0.05",
                "--quiet"]  # fmt: skip
    expected = fault_free_sha256(job_args, tmp_path_factory)
    faulty = tmp_path / "faulty"
    proc = start_run(job_args, faulty)
    job = _job_file(faulty)
    env = {"XMIG_JOBS_DIR": str(faulty / "jobs")}
    wait_for(lambda: "1 hot spare(s) ready" in xmig("status", env=env).stdout, 90,
              "the hot spare")  # fmt: skip
    wrong = xmig("inject", "kill:rank=1", "--token", "0" * 64, env=env)
    assert wrong.returncode == 2 and "wrong job token" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    bad = xmig("inject", "kill:rank=1:step=0", env=env)
    assert bad.returncode == 2 and "already at step" in bad.stderr
    ok = xmig("inject", "exit:rank=1:at=boundary:code=9", "--job", job["job_id"], env=env)
    assert ok.returncode == 0, ok.stderr
    result = finish_run(proc, faulty, timeout=120)
    summary = result.summary
    fault = summary["faults"][0]
    assert (fault["rank"], fault["kind"], fault["detail"]) == (1, "exit", "exit code 9")
    assert fault["injected"]["at"] == "boundary"
    assert result.returncode == 0 and summary["status"] == "completed"
    record = summary["recoveries"][0]
    assert record["mode"] == "respawn" and record["from_spare"] == [True]
    assert summary["final_params_sha256"] == expected
    assert len(summary["worker_pids"]["0"]) == 1 and len(summary["worker_pids"]["1"]) == 2
    phases = " ".join(f"{k}={v:.3f}" for k, v in record["phases"].items())
    measure(f"exit of rank 1 into a hot spare: {record['total_s']:.2f} s ({phases})")
