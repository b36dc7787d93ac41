"""The control plane's etcd layer against a real 3-member cluster on loopback: one leader
among candidates, a successor when its lease runs out, a snapshot no former leader can
overwrite, a member lost, and an etcd that cannot be reached."""

import os
import signal
import threading
import time

import pytest

from test_jit_checkpoint import _read_until
from xmig.coord.etcd import (
    ControlPlane,
    ControlPlaneError,
    Leader,
    LostLeadership,
    parse_url,
)

from etcd_harness import etcd_cluster_fixture, needs_etcd  # noqa: F401 - the fixture
from helpers import (
    DEMO,
    FAST,
    fault_free_sha256,
    finish_bit_identical,
    finish_run,
    run,
    start_run,
    wait_for,
)

TTL = 1


def candidate(name: str, port: int) -> Leader:
    return Leader(address=f"127.0.0.1:{port}", store=f"127.0.0.1:{port + 1}", pid=port,
                  since=time.time())  # fmt: skip


def test_the_url_names_every_member():
    assert parse_url("etcd://h1:2379,10.0.0.2:2380") == [("h1", 2379), ("10.0.0.2", 2380)]
    for bad in ("http://h1:2379", "etcd://h1", "etcd://h1:x", "etcd://:2379"):
        with pytest.raises(ValueError, match="--control-plane"):
            parse_url(bad)


@needs_etcd
def test_one_candidate_leads_and_a_successor_takes_over_when_its_lease_runs_out(etcd_cluster):
    planes = [ControlPlane(etcd_cluster.url, "job-a") for _ in range(2)]
    stop = threading.Event()
    first = planes[0].campaign(candidate("a", 1000), TTL, stop)
    assert first is not None
    assert planes[1].leader() == Leader(**{**candidate("a", 1000).__dict__,
                                           "since": planes[1].leader().since,
                                           "revision": first.revision})  # fmt: skip
    planes[0].put_snapshot(first, {"generation": 3})
    # the second waits while the first leads
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(
        planes[1].campaign(candidate("b", 2000), TTL, stop)))  # fmt: skip
    waiting.start()
    time.sleep(2 * TTL)
    assert got == [] and planes[1].leader().address == "127.0.0.1:1000"
    first.abandon()  # the first hangs: its lease runs out, its key goes
    lost = time.monotonic()
    waiting.join(timeout=20 * TTL)
    assert got, "no successor took over"
    second = got[0]
    assert second is not None and second.revision != first.revision
    # bounded, with room for etcd's own elections: a new etcd leader renews every lease
    # (a full test run on the 2-core machine once took 6.3 s here)
    assert time.monotonic() - lost < 12 * TTL
    assert planes[0].leader().address == "127.0.0.1:2000"
    # the former leader cannot overwrite its successor's snapshot
    assert planes[1].get_snapshot() == {"generation": 3}
    planes[1].put_snapshot(second, {"generation": 4})
    with pytest.raises(LostLeadership):
        planes[0].put_snapshot(first, {"generation": 99})
    assert planes[0].get_snapshot() == {"generation": 4}
    second.resign()
    assert planes[0].leader() is None
    planes[0].clear()
    assert planes[0].get_snapshot() is None
    for plane in planes:
        plane.close()


@needs_etcd
def test_a_member_lost_is_not_the_jobs_loss(etcd_cluster):
    plane = ControlPlane(etcd_cluster.url, "job-b")
    leadership = plane.campaign(candidate("a", 1000), 2, threading.Event())
    assert leadership is not None
    etcd_cluster.kill_member(etcd_cluster.leader_member())
    killed = time.monotonic()
    plane.put_snapshot(leadership, {"generation": 1})  # on another member, after an election
    assert time.monotonic() - killed < 5.0
    time.sleep(2.5)  # past the lease's TTL: kept alive through the failover
    assert not leadership.lost.is_set() and plane.leader().revision == leadership.revision
    assert plane.get_snapshot() == {"generation": 1}
    leadership.resign()
    plane.close()


def test_an_etcd_that_cannot_be_reached_is_a_clear_error_within_its_timeout():
    plane = ControlPlane("etcd://127.0.0.1:9,127.0.0.1:10", "job-c", timeout=1.5)
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=r"etcd at etcd://127.0.0.1:9,127.0.0.1:10: "
                       "reaching the cluster failed"):  # fmt: skip
        plane.check()
    assert time.monotonic() - started < 5.0
    plane.close()


# ---- a job on the HA control plane ------------------------------------------------------


def start_ha_job(etcd_cluster, tmp_path, tmp_path_factory, steps: int, *extra: str):
    """A job of 2 ranks on the HA control plane, read up to its step 3: (its launcher, the
    output so far, the job's ``ControlPlane``, the fault-free run's final parameters)."""
    two = ["--nproc-per-node", "2", *FAST]
    slow = [str(DEMO), "--preset", "tiny", "--steps", str(steps), "--step-sleep", "0.3"]
    expected = fault_free_sha256([*two, *slow], tmp_path_factory)
    proc = start_run([*two, "--control-plane", etcd_cluster.url, *extra, *slow], tmp_path)
    seen = _read_until(proc, "step 3 loss")
    job_id = seen.split("xmig: job ", 1)[1].split(":", 1)[0]
    return proc, seen, ControlPlane(etcd_cluster.url, job_id), expected


@needs_etcd
def test_a_job_goes_on_through_its_leaders_deaths_and_an_etcd_members(
    etcd_cluster, tmp_path, tmp_path_factory
):
    """Two coordinators on a 3-member etcd: the leader SIGKILLed mid-run, then the next one
    in the middle of a recovery, and etcd's own leader SIGKILLed; a standby takes over each
    time, and the run ends bit-identical with its survivor in the same process."""
    kill = ["--inject", "kill:rank=1:step=10:at=backward"]
    proc, seen, plane, expected = start_ha_job(etcd_cluster, tmp_path, tmp_path_factory, 16, *kill)
    first = plane.leader()
    os.kill(first.pid, signal.SIGKILL)
    seen += _read_until(proc, "step 6 loss")
    etcd_cluster.kill_member(etcd_cluster.leader_member())
    second = plane.wait_leader(20, other_than=first.revision)
    seen += _read_until(proc, "recovery to generation 1")
    os.kill(second.pid, signal.SIGKILL)
    result = finish_run(proc, tmp_path, timeout=180)
    result.output = seen + result.output
    assert result.returncode == 0, result.output
    summary = result.summary
    assert summary["final_params_sha256"] == expected, "not bit-identical"
    took = summary["coordinator_restarts"]
    assert [r["how"] for r in took] == ["took over", "took over"]
    assert took[0]["state_before"] == "running" and took[1]["busy"] == "recovery"
    assert all(0 < r["down_s"] < 15 for r in took)
    assert summary["coordinator_pid"] not in (first.pid, second.pid)
    assert len(summary["worker_pids"]["0"]) == 1
    assert plane.leader() is None and plane.get_snapshot() is None  # the job's keys are gone
    plane.close()


def test_an_etcd_that_cannot_be_reached_stops_the_launch_with_one_line(tmp_path):
    started = time.monotonic()
    result = run(["--control-plane", "etcd://127.0.0.1:9", str(DEMO), "--steps", "2"],
                 tmp_path, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("xmig: error: etcd at etcd://127.0.0.1:9: reaching the cluster failed")
    assert time.monotonic() - started < 40


@needs_etcd
@pytest.mark.long  # the takeover itself is the job test above's
def test_a_hung_leader_is_stopped_by_its_launcher_and_a_standby_takes_over(
    etcd_cluster, tmp_path, tmp_path_factory
):
    """The leader stopped (SIGSTOP): its lease runs out and a standby takes over, but the
    stopped leader's connections stay open, so nobody would look for the standby; its
    launcher kills it once it has not answered for 10 s, the agent rejoins the standby, and
    the run is bit-identical. The standby may have ended the job before the launcher reached
    it: the launcher then finds the outcome in etcd."""
    proc, seen, plane, expected = start_ha_job(etcd_cluster, tmp_path, tmp_path_factory, 14)
    hung = plane.leader()
    os.kill(hung.pid, signal.SIGSTOP)
    seen += _read_until(proc, "it is hung")
    result = finish_bit_identical(proc, tmp_path, seen, expected)
    summary = result.summary
    assert f"the coordinator (PID {hung.pid}) has not answered for 10 s" in result.output
    (took,) = summary["coordinator_restarts"]
    assert took["how"] == "took over" and summary["coordinator_pid"] != hung.pid
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values())
    assert plane.get_snapshot() is None
    # a standby stopped at the end lets its lease run out (at most its TTL, 2 s)
    wait_for(lambda: plane.leader() is None, 5.0, "the leader key to go")
    plane.close()


@needs_etcd
def test_an_ended_jobs_outcome_is_kept_for_late_comers_but_not_for_a_new_run(etcd_cluster):
    plane = ControlPlane(etcd_cluster.url, "job-end")
    before = time.time()
    leadership = plane.campaign(candidate("a", 1000), TTL, threading.Event())
    plane.put_snapshot(leadership, {"generation": 1})
    plane.end({"status": "completed", "exit_code": 0})
    leadership.resign()
    assert plane.get_snapshot() is None  # no standby takes the job up again
    assert plane.outcome(since=before) == {"status": "completed", "exit_code": 0}
    assert plane.outcome(since=time.time() + 1) is None  # a process of a later run
    plane.clear()
    assert plane.outcome(since=before) is None
    plane.close()


@needs_etcd
def test_a_launcher_passes_over_a_leader_that_died_before_it_connected(etcd_cluster):
    """etcd names a leader that died before the launcher reached it (a race the job test
    above hit now and then): the launcher asks etcd again and connects to the successor,
    rather than knocking at the dead one's port for the whole rejoin timeout."""
    from xmig.jobspec import JobSpec
    from xmig.launch.launcher import Launcher
    from xmig.wire import Server, format_address

    from etcd_harness import _free_ports

    token = "t" * 64
    asked = []
    successor = Server("127.0.0.1", 0, token, lambda _peer, msg: asked.append(msg["op"]) or {},
                       name="successor").start()  # fmt: skip
    plane = ControlPlane(etcd_cluster.url, "job-race")
    (nobody,) = _free_ports(1)
    dead = plane.campaign(candidate("dead", nobody), TTL, threading.Event())
    assert dead is not None
    spec = JobSpec(job_id="job-race", script="train.py", args=(), cwd="/", nnodes=1,
                   nproc_per_node=1, control_plane=etcd_cluster.url,
                   rejoin_timeout=20.0)  # fmt: skip
    launcher = Launcher(spec, None, token=token)

    def take_over() -> None:
        time.sleep(1.0)
        dead.resign()
        alive = Leader(address=format_address(successor.address), store="127.0.0.1:1", pid=2,
                       since=time.time())  # fmt: skip
        plane.campaign(alive, TTL, threading.Event())

    threading.Thread(target=take_over, daemon=True).start()
    started = time.monotonic()
    try:
        assert launcher._follow_leader("1 of 3")
        assert asked == ["wait_result"]
        assert time.monotonic() - started < 10.0
    finally:
        if launcher.client is not None:
            launcher.client.close()
        successor.close()
        plane.clear()
        plane.close()


@needs_etcd
def test_children_forked_while_an_etcd_channel_is_open_reach_their_exec(etcd_cluster):
    """A launcher, an agent or a coordinator starts processes while its etcd channel is open,
    through a ``preexec_fn`` (so a fork, not a vfork): every child reaches its exec. With
    gRPC's fork support on (grpcio 1.80 and later) 5-8 of 300 aborted before it."""
    import subprocess

    plane = ControlPlane(etcd_cluster.url, "job-fork")
    try:
        plane.leader()  # the channel is up
        codes = [subprocess.run(["/bin/true"], preexec_fn=lambda: None, check=False,
                                stderr=subprocess.DEVNULL, timeout=10).returncode
                 for _ in range(300)]  # fmt: skip
        assert codes.count(0) == len(codes), sorted(set(codes))
    finally:
        plane.close()


@needs_etcd
def test_a_coordinator_stopped_by_sigterm_gives_its_lead_back_at_once(etcd_cluster, tmp_path):
    """The launcher ends a job's coordinators with SIGTERM: one that leads (as a standby does
    when it took the lead over just before) gives its key back as it ends, rather than
    leaving it to its lease's time, and a standby that does not lead ends at once."""
    import json
    import select
    import subprocess
    import sys

    from xmig.jobenv import TOKEN
    from xmig.jobspec import JobSpec

    from etcd_harness import _free_ports

    plane = ControlPlane(etcd_cluster.url, "job-term")

    def coordinator() -> subprocess.Popen:
        (port,) = _free_ports(1)
        spec = JobSpec(job_id="job-term", script="train.py", args=(), cwd=str(tmp_path),
                       nnodes=1, nproc_per_node=1, control_plane=etcd_cluster.url,
                       master_port=port)  # fmt: skip
        env = {**os.environ, TOKEN: "t" * 64}
        proc = subprocess.Popen([sys.executable, "-m", "xmig.coord"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)  # fmt: skip
        started.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(spec.to_json()) + "\n").encode())
        proc.stdin.close()
        # its ready line, within a bound (a coordinator that hangs before it fails the test)
        assert select.select([proc.stdout], [], [], 30)[0], "no ready line within 30 s"
        assert json.loads(proc.stdout.readline())["ready"]
        return proc

    started: list[subprocess.Popen] = []
    try:
        leader = coordinator()
        wait_for(lambda: getattr(plane.leader(), "pid", None) == leader.pid, 20, "its lead")
        standby = coordinator()
        time.sleep(0.5)  # campaigning (its SIGTERM handler set): the key is the leader's
        standby.send_signal(signal.SIGTERM)
        assert standby.wait(10) == 128 + signal.SIGTERM
        assert plane.leader().pid == leader.pid
        # the key must go before the lease could have run out by itself: refreshed every
        # third of its 2 s, the lease has over 1.3 s left at any moment, so a key gone
        # within 1.2 s was given back (waiting for the exit first could take longer)
        signalled = time.monotonic()
        leader.send_signal(signal.SIGTERM)
        while plane.leader() is not None and time.monotonic() - signalled < 5:
            time.sleep(0.01)
        gone_after = time.monotonic() - signalled
        assert gone_after < 1.2, f"the leader key went {gone_after:.2f} s after SIGTERM"
        assert leader.wait(10) == 128 + signal.SIGTERM
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        plane.clear()
        plane.close()
