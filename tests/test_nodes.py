"""Several simulated hosts on one machine (a network namespace per node) and node loss:
the lost node's ranks restart on a spare node, pull their state and replay, and the run ends
with the fault-free run's parameters, bit for bit."""

import os
import subprocess

import pytest

from xmig.launch import hosts

from helpers import DEMO, run

STEPS = 6
HEARTBEAT = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "1.5"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="simulated hosts need root (network namespaces)"
)
_REFERENCE: dict[tuple[int, int], dict] = {}


def reference(nnodes, nproc, tmp_path_factory):
    key = (nnodes, nproc)
    if key not in _REFERENCE:
        folder = tmp_path_factory.mktemp(f"reference{nnodes}x{nproc}")
        result = run(["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--hot-spares",
                      "0", str(DEMO), "--steps", str(STEPS), "--quiet"], folder)  # fmt: skip
        assert result.returncode == 0, result.output
        _REFERENCE[key] = result.summary
    return _REFERENCE[key]


def xmig_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("xmig-")]


@needs_root
def test_simulated_hosts_train_like_one_host(tmp_path, tmp_path_factory):
    before = xmig_namespaces()
    result = run(["--nnodes", "2", "--nproc-per-node", "1", "--simulate-hosts", "--hot-spares",
                  "0", str(DEMO), "--steps", str(STEPS), "--quiet"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    summary = result.summary
    assert (
        summary["final_params_sha256"] == reference(2, 1, tmp_path_factory)["final_params_sha256"]
    )
    # each node's agent ran in a namespace of its own, not in this test's
    own = os.stat("/proc/self/ns/net").st_ino
    namespaces = list(summary["agent_netns"].values())
    assert len(set(namespaces)) == 2 and own not in namespaces
    assert "simulated hosts: 2 network namespaces" in result.output
    assert xmig_namespaces() == before, "the job's namespaces were not removed"


@needs_root
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
def test_node_loss_moves_its_ranks_to_a_spare_node(tmp_path, tmp_path_factory, measure, nproc):
    lost = list(range(nproc, 2 * nproc))  # the ranks of node 1
    spec = f"node:rank={lost[-1]}:step=3:at=backward"
    result = run(["--nnodes", "2", "--nproc-per-node", str(nproc), "--spare-nodes", "1",
                  "--simulate-hosts", *HEARTBEAT, "--inject", spec, str(DEMO), "--steps",
                  str(STEPS), "--quiet"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.output
    summary, ref = result.summary, reference(2, nproc, tmp_path_factory)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["final_params_sha256"] == ref["final_params_sha256"], "not bit-identical"
    fault = summary["faults"][0]
    assert fault["kind"] == "agent_lost" and fault["node"] == 1 and fault["ranks"] == lost
    assert fault["injected"]["kind"] == "node" and fault["detected_after_s"] < 1.0
    assert summary["lost_nodes"] == [1]
    record = summary["recoveries"][0]
    assert record["mode"] == "respawn" and record["ranks"] == lost
    assert record["nodes"] == {str(r): 2 for r in lost}
    assert 0 < record["total_s"] < 60
    for rank, pids in summary["worker_pids"].items():
        assert len(pids) == (2 if int(rank) in lost else 1), f"rank {rank}: {pids}"
        assert summary["worker_nodes"][rank] == (2 if int(rank) in lost else int(rank) // nproc)
    phases = " ".join(f"{k}={v:.3f}" for k, v in record["phases"].items())
    measure(f"{spec} ({nproc} rank(s) per node): moved to node 2 in {record['total_s']:.2f} s "
            f"({phases})")  # fmt: skip


def test_node_loss_without_a_spare_node_stops_clearly(tmp_path):
    result = run(["--nnodes", "2", "--nproc-per-node", "1", *HEARTBEAT, "--inject",
                  "node:rank=1:step=2", str(DEMO), "--steps", str(STEPS), "--quiet"],
                 tmp_path)  # fmt: skip
    assert result.returncode == 1
    assert "no spare node" in result.summary["message"]
    assert result.summary["lost_nodes"] == [1]


def test_simulated_hosts_need_root(monkeypatch):
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    with pytest.raises(hosts.HostSetupError, match="needs root"):
        hosts.check_can_simulate()


def test_simulated_hosts_need_the_ip_command(monkeypatch):
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts.shutil, "which", lambda _name: None)
    with pytest.raises(hosts.HostSetupError, match="iproute2"):
        hosts.check_can_simulate()
