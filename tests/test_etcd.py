"""The control plane's etcd layer against a real 3-member cluster on loopback: one leader
among candidates, a successor when its lease runs out, a snapshot no former leader can
overwrite, a member lost, and an etcd that cannot be reached."""

import threading
import time

import pytest

from xmig.coord.etcd import (
    ControlPlane,
    ControlPlaneError,
    Leader,
    LostLeadership,
    parse_url,
)

from etcd_harness import etcd_cluster_fixture, needs_etcd  # noqa: F401 - the fixture

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
    waiting.join(timeout=10 * TTL)
    second = got[0]
    assert second is not None and second.revision != first.revision
    assert time.monotonic() - lost < 4 * TTL
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
