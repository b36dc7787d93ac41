"""Workers forked from a node's zygote: what each gets, what happens when the zygote or the
agent dies, and that a forked worker computes what a fresh interpreter does."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil

from helpers import DEMO, FAST, REPO, fault_free_sha256, run, wait_for

AGENT = REPO / "tests" / "scripts" / "zygote_agent.py"
WORKER = REPO / "tests" / "scripts" / "zygote_worker.py"


def _agent(tmp_path, mode, **kwargs):
    return subprocess.Popen(
        [sys.executable, str(AGENT), str(tmp_path), mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        start_new_session=True,
        **kwargs,
    )


def _said(proc, timeout=90):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    return json.loads(out.splitlines()[-1])


def test_a_forked_worker_is_the_agents_child_and_runs_its_order_as_main(tmp_path):
    seen = _said(_agent(tmp_path, "facts"))
    facts = json.loads((tmp_path / "facts.json").read_text())
    agent_pid = facts["ppid"]
    assert facts["pid"] == seen["first"] != seen["zygote"]
    # reaped by the agent (a subreaper), with its exit code or signal, as a Popen'd worker
    assert (seen["first_code"], seen["second_code"]) == (3, -signal.SIGKILL)
    assert seen["forked"] == 2 and agent_pid not in (seen["zygote"], facts["pid"])
    assert facts["session_leader"] and facts["stdin"] == "" and facts["stdin_target"] == "/dev/null"
    # the order's environment, also where C code reads it; not the zygote's own descriptor
    assert facts["order_env"] == facts["c_env"] == "only in the worker's order"
    assert not facts["fd_env"] and facts["fds"] == [0, 1, 2, 3]  # 3: its own listing's
    assert facts["cwd"] == str(tmp_path) and facts["main"] == "__main__"
    assert facts["argv"] == [str(WORKER), str(tmp_path), "3"]
    assert facts["path0"] == str(WORKER.parent)
    assert facts["torch_loaded"]  # what the zygote imported is there at once


def test_forked_workers_and_the_zygote_die_with_their_agent(tmp_path):
    proc = _agent(tmp_path, "orphan")
    seen = None
    try:
        seen = json.loads(proc.stdout.readline())
        assert psutil.Process(seen["worker"]).ppid() == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

        def gone():
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                           for p in (seen["worker"], seen["zygote"]))  # fmt: skip

        wait_for(gone, 10, "the worker and the zygote to die with their agent")
        seen = None  # gone: their PIDs may be someone else's now
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        for pid in (seen or {}).values():  # they outlived it: ended by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_zygote_that_died_or_never_started_forks_nothing_and_is_not_waited_for(tmp_path):
    seen = _said(_agent(tmp_path, "dead"))
    assert seen["after_death"] and seen["never"] and not seen["alive"]
    assert seen["seconds"] < 30  # not the 120 s a slow zygote is given to get ready


def test_a_job_of_fresh_interpreters_ends_as_one_of_forked_workers(tmp_path, tmp_path_factory):
    args = [*FAST, "--nproc-per-node", "2", str(DEMO), "--steps", "4", "--quiet"]
    forked = fault_free_sha256(args, tmp_path_factory)
    fresh = run(args, tmp_path, env={"XMIG_ZYGOTE": "0"})
    assert fresh.returncode == 0, fresh.output
    assert fresh.summary["final_params_sha256"] == forked


def test_a_worker_whose_pid_the_agent_never_heard_of_does_not_run(tmp_path):
    # the zygote forks it, then stalls before saying its PID: the agent gives up (and would
    # start the rank afresh), so this one must not run as a second process of the rank
    seen = _said(_agent(tmp_path, "stalled"))
    assert not seen["forked"] and not seen["alive"]
    assert seen["seconds"] < 30  # the agent's bound on an answer, not the zygote's stall
    assert seen["children"] == []  # the worker has exited (and been reaped)
    assert not (tmp_path / "facts.json").exists()  # without running its script
