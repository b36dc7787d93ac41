"""Container mode on CPU (root, runc, CRIU): every worker in a runc container of a rootfs made
by ``scripts/make-rootfs.sh``, on two simulated hosts and a spare one. A run ends where the
same run of bare processes ends, bit for bit, through a kill (a new container) and a move of a
container to the spare host (its PID inside kept); bad input stops with one line, leaving
nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys

import pytest

from xmig.migrate import criu_status

from conftest import MEASUREMENTS
from container_harness import job_containers, made_rootfs, needs_containers
from helpers import DEMO, REPO, assert_all_gone, run, wait_for

STEPS = 10
HOSTS = ["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1", "--simulate-hosts"]
DEMO_ARGS = [str(DEMO), "--preset", "tiny", "--steps", str(STEPS), "--quiet"]
# the first test's setup makes the rootfs (minutes, from the mirror) if it is not kept yet
pytestmark = [needs_containers, pytest.mark.timeout(1200)]
_BARE: list[str] = []


@pytest.fixture(scope="module")
def rootfs():
    folder, took = made_rootfs()
    if took:
        MEASUREMENTS.append(f"make-rootfs.sh: a rootfs with torch in {took:.0f} s")
    return folder


def bare_hash(tmp_path_factory) -> str:
    """The same job, bare processes on the same simulated hosts, fault-free."""
    if not _BARE:
        folder = tmp_path_factory.mktemp("bare")
        result = run([*HOSTS, "--hot-spares", "0", *DEMO_ARGS], folder)
        assert result.returncode == 0, result.output
        _BARE.append(result.summary["final_params_sha256"])
    return _BARE[0]


def in_containers(rootfs, tmp_path, *more: str, step_sleep: float | None = None):
    args = [*HOSTS, "--container", str(rootfs), *more, *DEMO_ARGS]
    if step_sleep is not None:
        args += ["--step-sleep", str(step_sleep)]
    result = run(args, tmp_path, timeout=240.0)
    summary = result.summary
    assert summary is not None, result.output
    assert job_containers(summary["job_id"]) == [], "containers left behind"
    return result


def test_fault_free_runs_in_containers_are_deterministic_and_equal_bare_processes(
    rootfs, tmp_path, tmp_path_factory
):
    hashes = []
    for attempt in range(2):
        folder = tmp_path / f"run{attempt}"
        folder.mkdir()
        result = in_containers(rootfs, folder, "--hot-spares", "0")
        assert result.returncode == 0, result.output
        summary = result.summary
        hashes.append(summary["final_params_sha256"])
        # one container a rank, each its own
        ids = summary["worker_containers"]
        assert sorted(ids) == ["0", "1"] and all(len(c) == 1 for c in ids.values()), ids
        assert ids["0"] != ids["1"]
    assert hashes[0] == hashes[1], "two fault-free runs in containers differ"
    assert hashes[0] == bare_hash(tmp_path_factory), "containers compute another result"


def test_a_killed_rank_is_replaced_in_a_new_container(rootfs, tmp_path, tmp_path_factory):
    """The replacement is the node's hot spare where one is ready (itself a container), else
    a fresh container; either way a container the rank did not have. The survivor keeps its
    process (and container)."""
    result = in_containers(rootfs, tmp_path, "--inject", "kill:rank=1:step=4:at=backward",
                           step_sleep=0.3)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == bare_hash(tmp_path_factory), "not bit-identical"
    (fault,) = summary["faults"]
    assert (fault["rank"], fault["kind"], fault["step"]) == (1, "signal", 4)
    (recovery,) = summary["recoveries"]
    assert recovery["verified"] is True
    assert len(summary["worker_pids"]["0"]) == 1  # the survivor's process, kept
    first, second = summary["worker_containers"]["1"]
    assert first != second  # a new container
    assert len(summary["worker_containers"]["0"]) == 1


@pytest.mark.skipif(not criu_status()[0], reason="CRIU is not usable here")
def test_a_container_moves_to_the_spare_host_keeping_its_pid_inside(
    rootfs, tmp_path, tmp_path_factory
):
    """The launcher's output goes to a file (a container's must not: CRIU cannot take a
    host file along); once moved, the source host's namespace has no network lock left."""
    log = tmp_path / "output.log"
    args = [*HOSTS, "--container", str(rootfs), "--hot-spares", "0", "--inject",
            "migrate:rank=1:step=3:to=2", *DEMO_ARGS, "--step-sleep", "0.3"]  # fmt: skip
    env = {**os.environ, "XMIG_JOBS_DIR": str(tmp_path / "jobs")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "xmig", "run", "--summary",
                                 str(tmp_path / "summary.json"), *args], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env=env)  # fmt: skip
    try:
        wait_for(lambda: "migrated rank 1" in log.read_text() or proc.poll() is not None,
                 120.0, "the move")  # fmt: skip
        found = re.search(r"network namespaces \((\S+)-n0", log.read_text())
        assert found, log.read_text()
        if proc.poll() is None and shutil.which("nft"):
            rules = subprocess.run(["ip", "netns", "exec", f"{found.group(1)}-n1", "nft",
                                    "list", "ruleset"], capture_output=True, text=True,
                                   timeout=30, check=False)  # fmt: skip
            assert rules.stdout.strip() == "", f"a network lock was left: {rules.stdout}"
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert_all_gone(summary)
    assert job_containers(summary["job_id"]) == []
    assert summary["final_params_sha256"] == bare_hash(tmp_path_factory), "not bit-identical"
    assert summary["faults"] == [] and summary["recoveries"] == []
    (record,) = summary["migrations"]
    assert (record["rank"], record["from_node"], record["to_node"]) == (1, 1, 2)
    assert summary["worker_nodes"]["1"] == 2
    # the same container, restored under its ID on the other host; the worker is its init
    # there as here (PID 1), the host's PID of it changes
    (container,) = summary["worker_containers"]["1"]
    assert record["container"] == container
    assert record["pid_kept"] and record["pid_in_container"] == 1
    assert record["restored_pid"] != record["pid"]
    assert summary["worker_pids"]["1"] == [record["pid"], record["restored_pid"]]
    # it reported from the spare host's network namespace
    assert record["netns"] == summary["agent_netns"]["2"] != summary["agent_netns"]["1"]
    assert 0 < record["downtime_s"] < 60
    assert "[rank1] step 9" in output  # its output came on after the move


def _xmig_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines, result.output
    return lines[-1]


def test_a_rootfs_without_python_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "rootfs"
    for folder in ("usr/bin", "bin", "etc"):
        (empty / folder).mkdir(parents=True)
    result = run(["--container", str(empty), *DEMO_ARGS], tmp_path, timeout=60.0)
    assert result.returncode == 2, result.output
    assert "the rootfs has no Python" in _xmig_line(result)
    assert result.summary is None  # nothing started


def test_a_missing_runc_is_refused_in_one_line(tmp_path, rootfs):
    result = run(["--container", str(rootfs), *DEMO_ARGS], tmp_path, timeout=60.0,
                 env={"XMIG_RUNC": str(tmp_path / "no-runc")})  # fmt: skip
    assert result.returncode == 2, result.output
    assert "--container needs runc" in _xmig_line(result)
    assert result.summary is None


def test_a_container_that_cannot_start_is_refused_in_one_line(tmp_path):
    """A rootfs whose Python does not run (here: one that exits at once with an error):
    the check before the job says so, and leaves no container."""
    broken = tmp_path / "rootfs"
    (broken / "usr" / "bin").mkdir(parents=True)
    (broken / "bin").mkdir()
    python = broken / "usr" / "bin" / "python3"
    python.write_text("#!/bin/sh\necho 'no such module: torch' >&2\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    result = run(["--container", str(broken), *DEMO_ARGS], tmp_path, timeout=60.0)
    assert result.returncode == 2, result.output
    line = _xmig_line(result)
    assert "--container" in line and "cannot" in line, line
    assert result.summary is None
    assert not [c for c in _all_containers() if "-probe-" in c]


def _all_containers() -> list[str]:
    from xmig.container import runc

    return runc.list_ids("xmig-")
