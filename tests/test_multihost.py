"""One launcher per host: every host of the job is started by its own ``xmig run`` in a
network namespace of its own (a simulated host with its own address), as ``srun`` or a
Kubernetes pod would start it; node rank 0 hosts the coordinator."""

from __future__ import annotations

import json
import signal
import time
import uuid

import psutil
import pytest

from xmig.coord.etcd import ControlPlane
from xmig.launch.multihost import job_token
from xmig.wire import Client, WireError, parse_address

from etcd_harness import EtcdCluster, needs_etcd
from helpers import DEMO, PATTERNS, assert_all_gone, fault_free_sha256, wait_for
from hosts_harness import (
    PORT,
    SECRET,
    Hosts,
    hosts_fixture,  # noqa: F401 - the fixture `hosts`
    needs_root,
)

HEARTBEAT = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "1.5"]


def status(net: Hosts, job_id: str, plane: ControlPlane | None = None) -> dict:
    where = (net.net.address(0), PORT)
    if plane is not None:  # the coordinator that leads now
        leader = plane.leader()
        if leader is None:
            raise WireError("no leader")
        where = parse_address(leader.address)
    client = Client(where, job_token(SECRET, job_id), info={"role": "client"},
                    connect_timeout=5.0)  # fmt: skip
    try:
        return client.call("status", timeout=10.0)["status"]
    finally:
        client.close()


@needs_root
def test_hosts_with_launchers_of_their_own_recover_a_killed_worker_and_a_lost_host(
    hosts, tmp_path, tmp_path_factory
):
    steps = 12
    job_id = f"job-{uuid.uuid4().hex[:6]}"
    script = [str(DEMO), "--steps", str(steps), "--step-sleep", "0.25", "--quiet"]
    reference = fault_free_sha256(["--nnodes", "3", "--hot-spares", "0", *script[:3],
                                   "--quiet"], tmp_path_factory)  # fmt: skip
    net = hosts(4)
    common = ["--nnodes", "3:4", "--rdzv-endpoint", net.endpoint, "--rdzv-id", job_id,
              "--hot-spares", "0", *HEARTBEAT, "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--inject", "kill:rank=1:step=2:at=backward"]  # fmt: skip
    # the other hosts first: they wait for the coordinator's host
    for node in (1, 2, 3):
        net.start(f"host{node}", node, [*common, *script])
    time.sleep(0.5)
    net.start("host0", 0, ["--summary", str(tmp_path / "summary.json"), *common, *script])

    def past_the_kill() -> bool:
        try:
            now = status(net, job_id)
        except WireError:  # the coordinator is not up yet
            return False
        return now["status"] == "running" and now["faults"] >= 1 and \
            min(now["progress"].values(), default=0) >= 5  # fmt: skip

    wait_for(past_the_kill, 120, "the job to recover the kill and reach step 5")
    killed = net.kill_host(2)
    assert killed, "host 2 had no processes"
    codes = {name: net.wait(name, 180) for name in ("host0", "host1", "host3")}
    assert codes == {"host0": 0, "host1": 0, "host3": 0}, {n: net.output(n) for n in codes}
    assert net.wait("host2", 10) == -signal.SIGKILL

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert summary["final_params_sha256"] == reference, "not bit-identical"
    kinds = [(f["kind"], f.get("node")) for f in summary["faults"]]
    assert kinds[0][0] != "agent_lost" and kinds[1] == ("agent_lost", 2), kinds
    assert summary["lost_nodes"] == [2]
    # rank 0 survived both faults in the same process; rank 1 was replaced on its node, rank
    # 2 moved to the spare host
    assert len(summary["worker_pids"]["0"]) == 1
    assert len(summary["worker_pids"]["1"]) == 2 and summary["worker_nodes"]["1"] == 1
    assert len(summary["worker_pids"]["2"]) == 2 and summary["worker_nodes"]["2"] == 3
    assert len(summary["recoveries"]) == 2
    assert all(0 < r["total_s"] < 60 for r in summary["recoveries"])
    # each launcher said the outcome; only the coordinator's host wrote the summary
    for name in ("host1", "host3"):
        assert f"job {job_id} completed: {steps} steps" in net.output(name)
    assert "this host is spare node rank 3" in net.output("host3")
    assert_all_gone(summary)
    for node in range(4):
        assert net.namespace_pids(node) == [], f"processes left on host {node}"


@needs_root
def test_hosts_that_cannot_join_say_why_and_a_host_that_never_comes_stops_the_job(hosts, tmp_path):
    net = hosts(3)
    job_id = f"job-{uuid.uuid4().hex[:6]}"
    common = ["--nnodes", "3", "--rdzv-endpoint", net.endpoint, "--rdzv-id", job_id,
              "--hot-spares", "0", "--join-timeout", "8"]  # fmt: skip
    script = [str(DEMO), "--steps", "3", "--quiet"]
    # nobody hosts a coordinator at this endpoint: a bounded wait
    lonely = ["--nnodes", "2", "--rdzv-endpoint", f"{net.net.address(0)}:{PORT + 1}",
              "--rdzv-id", "nobody", "--join-timeout", "2"]  # fmt: skip
    net.start("lonely", 1, [*lonely, *script], namespace=1)
    net.start("host0", 0, ["--summary", str(tmp_path / "summary.json"), *common, *script])
    net.start("host1", 1, [*common, *script])
    wait_for(lambda: "this host is node rank 1" in net.output("host1"), 60, "host 1 to join")
    # a wrong secret, a node rank taken twice, another command line: each refused at once
    net.start("wrong-secret", 2, [*common, *script], secret="not-the-job's-secret-at-all",
              namespace=2)  # fmt: skip
    net.start("twice", 1, [*common, *script], namespace=2)
    net.start("other-args", 2, [*common, str(DEMO), "--steps", "4", "--quiet"], namespace=2)
    for name, needle in [
        ("lonely", f"cannot reach the coordinator at {net.net.address(0)}:{PORT + 1}"),
        ("wrong-secret", "refused this host: it does not hold this job's token"),
        ("twice", "node rank 1 has already joined"),
        ("other-args", "node rank 2 was started with another command line than node 0's: "
                       "args: "),
    ]:  # fmt: skip
        assert net.wait(name, 60) == 2, net.output(name)
        assert needle in net.output(name), net.output(name)
    # host 2 never comes: the job stops at the join timeout, on every host that joined
    assert net.wait("host0", 60) == 1 and net.wait("host1", 60) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "hosts of node ranks [2] did not connect within 8 s (--join-timeout)" in \
        summary["message"]  # fmt: skip
    assert "did not connect within 8 s" in net.output("host1")
    assert_all_gone(summary)
    for node in range(3):
        assert net.namespace_pids(node) == [], f"processes left on host {node}"
    assert not [p for p in psutil.pids() if p in net.procs and psutil.pid_exists(p)]


@needs_root
@pytest.mark.long  # the same node loss as a whole host killed, which CI runs
def test_a_host_told_to_go_leaves_and_the_job_goes_on(hosts, tmp_path, tmp_path_factory):
    """SIGTERM to another host's launcher (a drained node, an evicted pod): that host leaves,
    its rank moves to the spare host, and the run is bit-identical; node 0's SIGTERM would
    stop the job."""
    job_id = f"job-{uuid.uuid4().hex[:6]}"
    script = [str(DEMO), "--steps", "10", "--step-sleep", "0.25", "--quiet"]
    reference = fault_free_sha256(["--nnodes", "2", "--hot-spares", "0", *script[:3],
                                   "--quiet"], tmp_path_factory)  # fmt: skip
    net = hosts(3)
    common = ["--nnodes", "2:3", "--rdzv-endpoint", net.endpoint, "--rdzv-id", job_id,
              "--hot-spares", "0", *HEARTBEAT]  # fmt: skip
    net.start("host0", 0, ["--summary", str(tmp_path / "summary.json"), *common, *script])
    for node in (1, 2):
        net.start(f"host{node}", node, [*common, *script])

    def at_step_3() -> bool:
        try:
            return min(status(net, job_id)["progress"].values(), default=0) >= 3
        except WireError:
            return False

    wait_for(at_step_3, 120, "the job to reach step 3")
    net.procs["host1"].send_signal(signal.SIGTERM)
    assert net.wait("host1", 30) == 128 + signal.SIGTERM
    assert "this host (node rank 1) leaves the job" in net.output("host1")
    assert net.wait("host0", 120) == 0 and net.wait("host2", 60) == 0, net.output("host0")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_params_sha256"] == reference, "not bit-identical"
    assert summary["lost_nodes"] == [1] and summary["worker_nodes"]["1"] == 2
    assert len(summary["worker_pids"]["0"]) == 1
    assert_all_gone(summary)


# (long: test_etcd.py's leaders' deaths and the lost host above cover its parts in CI)
@pytest.mark.long
@needs_root
@needs_etcd
def test_hosts_on_an_ha_control_plane_lose_the_leaders_whole_host(
    hosts, tmp_path, tmp_path_factory
):
    """Coordinators on hosts 0 and 1 campaign on a 3-member etcd; the leader's host (its
    launcher, agent and rank) is lost whole: the other's coordinator takes over, the lost
    host's rank restarts on the spare host, and the run ends bit-identical, its summary
    written by a host that is left."""
    job_id = f"job-{uuid.uuid4().hex[:6]}"
    script = [str(DEMO), "--steps", "14", "--step-sleep", "0.25", "--quiet"]
    reference = fault_free_sha256(["--nnodes", "3", "--hot-spares", "0", *script[:3],
                                   "--quiet"], tmp_path_factory)  # fmt: skip
    net = hosts(4)
    cluster = EtcdCluster(3, host=net.net.bridge_address).start()
    try:
        common = ["--nnodes", "3:4", "--rdzv-endpoint", net.endpoint, "--rdzv-id", job_id,
                  "--control-plane", cluster.url, "--coordinators", "2", "--hot-spares", "0",
                  "--rejoin-timeout", "6", *HEARTBEAT]  # fmt: skip
        for node in (0, 1, 2, 3):
            summary = ["--summary", str(tmp_path / f"summary{node}.json")]
            net.start(f"host{node}", node, [*summary, *common, *script])
        plane = ControlPlane(cluster.url, job_id)
        leader = plane.wait_leader(120)

        def at_step_4() -> bool:
            try:
                return min(status(net, job_id, plane)["progress"].values(), default=0) >= 4
            except WireError:
                return False

        try:
            wait_for(at_step_4, 120, "the job to reach step 4")
        except AssertionError as exc:  # what each host said, to tell why
            raise AssertionError({n: net.output(f"host{n}")[-3000:] for n in range(4)}) from exc
        # the coordinators of hosts 0 and 1 campaign: either may win
        lost = next(n for n in (0, 1) if leader.address.startswith(net.net.address(n) + ":"))
        net.kill_host(lost)
        left = [n for n in range(4) if n != lost]
        codes = {f"host{n}": net.wait(f"host{n}", 180) for n in left}
        assert set(codes.values()) == {0}, {name: net.output(name) for name in codes}
        summary = json.loads((tmp_path / f"summary{1 - lost}.json").read_text())
        assert summary["final_params_sha256"] == reference, "not bit-identical"
        restarts = summary["coordinator_restarts"]
        assert len(restarts) == 1, (lost, restarts, net.output(f"host{1 - lost}")[-4000:])
        assert restarts[0]["how"] == "took over" and restarts[0]["missing_nodes"] == [lost]
        assert summary["lost_nodes"] == [lost] and summary["worker_nodes"][str(lost)] == 3
        assert all(len(summary["worker_pids"][str(r)]) == 1 for r in range(3) if r != lost)
        plane.close()
    finally:
        cluster.stop()


@needs_root
@pytest.mark.long  # the coordinator's side runs in CI (test_resize_machine), the grow too
def test_a_lost_host_started_again_grows_the_world_it_shrank(hosts, tmp_path, tmp_path_factory):
    """3 hosts, no spare, ``--on-no-spare shrink``: host 2 is killed whole and the world
    shrinks to 2; the host is started again with its node rank (repaired) and the world grows
    back onto it: bit-identical to the fault-free run with planned resizes at those steps."""
    job_id = f"job-{uuid.uuid4().hex[:6]}"
    script = [str(PATTERNS), "--pattern", "shards", "--steps", "16", "--step-sleep", "0.3"]
    net = hosts(3)
    common = ["--nnodes", "3", "--rdzv-endpoint", net.endpoint, "--rdzv-id", job_id,
              "--hot-spares", "0", *HEARTBEAT, "--on-no-spare", "shrink"]  # fmt: skip
    for node in (1, 2):
        net.start(f"host{node}", node, [*common, *script])
    time.sleep(0.5)
    net.start("host0", 0, ["--summary", str(tmp_path / "summary.json"), *common, *script])

    def world(size: int, step: int = 0) -> bool:
        try:
            now = status(net, job_id)
        except WireError:
            return False
        return now["status"] == "running" and now["world_size"] == size and \
            min(now["progress"].values(), default=0) >= step  # fmt: skip

    wait_for(lambda: world(3, step=3), 120, "the job to reach step 3")
    assert net.kill_host(2), "host 2 had no processes"
    wait_for(lambda: world(2), 60, "the world to shrink to 2")
    net.start("host2-again", 2, [*common, *script])
    assert net.wait("host0", 180) == 0, net.output("host0")
    assert net.wait("host1", 60) == 0 and net.wait("host2-again", 60) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    shrink, grow = summary["resizes"]
    assert shrink["cause"] == "node lost" and grow["cause"] == "node added"
    assert grow["added"] == {"2": 2} and grow["replicas_equal"] is True
    assert grow["why"] == "node 2 joined"
    planned = ["--nnodes", "3", "--hot-spares", "0", "--inject",
               f"resize:world=2:step={shrink['step']}", "--inject",
               f"resize:world=3:step={grow['step']}", *script[:-2]]  # fmt: skip
    assert summary["final_params_sha256"] == fault_free_sha256(planned, tmp_path_factory)
    assert len(summary["worker_pids"]["0"]) == len(summary["worker_pids"]["1"]) == 1
    assert_all_gone(summary)
