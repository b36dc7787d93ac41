"""The job's control plane in etcd (``--control-plane etcd://H1:P1,H2:P2,...``): which
coordinator leads, and the leader's snapshot of the job.

Every call to etcd is in this module (the client, etcd-sdk-python, was chosen by measurement:
``bench/results/etcd-clients.md``; it has no type hints, no retries and no lease keep-alive,
which this module adds). Keys, under ``/xmig/JOB/``:

- ``leader``: the leading coordinator (its control address, its store, its PID), on its
  lease; a candidate becomes leader by creating it (a transaction: only if absent);
- ``snapshot``: the leader's snapshot of the job (``xmig.coord.snapshot``), written only in a
  transaction that finds the leader key still the one this leader created, so that a leader
  that lost its lease can never overwrite its successor's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

# gRPC's fork support, off unless the user's environment says otherwise, before gRPC is first
# loaded: with it on (grpcio 1.80 and later), a child forked to exec while a channel is open
# (``subprocess.Popen`` with a ``preexec_fn``: the launcher's coordinators and agents, an
# agent's workers) restarts gRPC's poller, which ``close_fds`` then breaks, and the child
# aborts before its exec (8 of 300 children so on the CPU machine, grpcio 1.85.4; none with
# it off; the HA job test lost its agent so in 1 run of 12). No xmig process uses gRPC in a
# child forked without exec, which is what the support is for.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

SCHEME = "etcd://"
CALL_TIMEOUT_S = 1.0  # one request to one member
ENDPOINT_RETRY_S = 0.3  # a member that failed is tried again after this long
RETRY_INTERVAL_S = 0.1
# how long an ended job's outcome stays in etcd, for a launcher or standby that comes late
OUTCOME_TTL_S = 300
T = TypeVar("T")


class ControlPlaneError(RuntimeError):
    """etcd could not be reached, or said no, within the time given."""


class LostLeadership(ControlPlaneError):
    """This coordinator no longer leads (its lease ran out, or a successor leads)."""


@dataclass(frozen=True)
class Leader:
    """The leading coordinator, as its key says."""

    address: str  # its control server, host:port
    store: str  # its c10d store, host:port
    pid: int
    since: float
    revision: int = 0  # the leader key's create revision: one per leadership

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("revision")
        return json.dumps(data)


def parse_url(text: str) -> list[tuple[str, int]]:
    """``etcd://H1:P1,H2:P2`` as endpoints; ValueError naming what is wrong."""
    if not text.startswith(SCHEME):
        raise ValueError(f"--control-plane must be {SCHEME}HOST:PORT[,HOST:PORT...], got {text!r}")
    endpoints = []
    for part in text[len(SCHEME) :].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--control-plane: {part!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints


class ControlPlane:
    """One job's keys in an etcd cluster; every call retried (on any member) until its
    deadline."""

    def __init__(self, url: str, job_id: str, timeout: float = 10.0) -> None:
        from pyetcd import Endpoint, MultiEndpointEtcd3Client

        self.url = url
        self.timeout = timeout
        self.prefix = f"/xmig/{job_id}/"
        endpoints = [Endpoint(host, port, secure=False, time_retry=ENDPOINT_RETRY_S)
                     for host, port in parse_url(url)]  # fmt: skip
        self.client = MultiEndpointEtcd3Client(endpoints, timeout=CALL_TIMEOUT_S, failover=True)

    @property
    def leader_key(self) -> str:
        return self.prefix + "leader"

    @property
    def snapshot_key(self) -> str:
        return self.prefix + "snapshot"

    @property
    def outcome_key(self) -> str:
        return self.prefix + "outcome"

    def _call(self, what: str, call: Callable[[], T], within: float | None = None) -> T:
        """``call()``, tried again on another member until ``within`` seconds have passed."""
        deadline = time.monotonic() + (self.timeout if within is None else within)
        while True:
            try:
                return call()
            except LostLeadership:
                raise
            except Exception as exc:  # the client raises grpc's and its own errors alike
                if time.monotonic() + RETRY_INTERVAL_S >= deadline:
                    raise ControlPlaneError(f"etcd at {self.url}: {what} failed: "
                                            f"{type(exc).__name__}: {exc}") from None  # fmt: skip
                log.debug("etcd: %s failed (%s), trying again", what, exc)
                time.sleep(RETRY_INTERVAL_S)

    def check(self) -> None:
        """Reach the cluster (a clear error within the timeout when it cannot be)."""
        self._call("reaching the cluster", self.client.status)

    # ---- who leads ----------------------------------------------------------------------
    def leader(self) -> Leader | None:
        """The leader now, or None."""
        value, meta = self._call("reading the leader", lambda: self.client.get(self.leader_key))
        if value is None:
            return None
        data = json.loads(value)
        return Leader(**data, revision=int(meta.create_revision))

    def wait_leader(self, within: float, other_than: int | None = None) -> Leader:
        """A leader (other than the leadership ``other_than``), waited for ``within`` s."""
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            found = self.leader() if left > 0 else None
            if found is not None and found.revision != other_than:
                return found
            if left <= 0:
                raise ControlPlaneError(f"no coordinator leads job {self.prefix[6:-1]} in etcd "
                                        f"at {self.url} after {within:.0f} s")  # fmt: skip
            time.sleep(min(0.1, max(0.0, left)))

    def campaign(self, me: Leader, ttl: int, stop: threading.Event) -> Leadership | None:
        """Become the leader: wait until no one leads, then take the key on a lease of ours
        (kept alive by a thread). None when ``stop`` is set first."""
        while not stop.is_set():
            lease_id = self._call("granting a lease", lambda: self.client.lease(ttl).id)
            taking = functools.partial(self._take, me, lease_id)
            if self._call("taking the leader key", taking):
                taken = self.leader()
                assert taken is not None
                return Leadership(self, lease_id, ttl, taken.revision)
            self._call("giving a lease back", functools.partial(self.client.revoke_lease, lease_id))
            stop.wait(min(0.2, ttl / 4))  # someone leads: wait for its key to go
        return None

    def _take(self, me: Leader, lease_id: int) -> bool:
        """Create the leader key on ``lease_id`` if no one holds it; whether it was."""
        tx = self.client.transactions
        ok, _ = self.client.transaction(
            compare=[tx.create(self.leader_key) == 0],
            success=[tx.put(self.leader_key, me.to_json(), lease=lease_id)], failure=[],
        )  # fmt: skip
        return bool(ok)

    # ---- the job's snapshot ---------------------------------------------------------------
    def put_snapshot(self, leadership: Leadership, data: dict[str, Any]) -> None:
        """Write the job's snapshot, only while ``leadership`` holds (LostLeadership)."""
        if leadership.lost.is_set():
            raise LostLeadership("this coordinator's lease ran out")
        tx = self.client.transactions
        ok, _ = self._call("writing the snapshot", lambda: self.client.transaction(
            compare=[tx.create(self.leader_key) == leadership.revision],
            success=[tx.put(self.snapshot_key, json.dumps(data, default=str))], failure=[],
        ))  # fmt: skip
        if not ok:
            leadership.lost.set()
            raise LostLeadership("another coordinator leads the job now")

    def get_snapshot(self) -> dict[str, Any] | None:
        value, _ = self._call("reading the snapshot", lambda: self.client.get(self.snapshot_key))
        return json.loads(value) if value is not None else None

    def end(self, summary: dict[str, Any]) -> None:
        """The job has ended: its summary is kept (for ``OUTCOME_TTL_S``, for a launcher or
        standby that comes late), its snapshot goes (no standby takes the job up again)."""
        lease = self._call("granting a lease", lambda: self.client.lease(OUTCOME_TTL_S).id)
        record = json.dumps({"ended": time.time(), "summary": summary}, default=str)
        self._call("keeping the outcome",
                   lambda: self.client.put(self.outcome_key, record, lease=lease))  # fmt: skip
        self._call("removing the snapshot", lambda: self.client.delete(self.snapshot_key))

    def outcome(self, since: float) -> dict[str, Any] | None:
        """The summary of the job if it ended at ``since`` (a wall time) or later; one that
        ended before is an earlier run's under the same id (a process started after that
        run ended is a new run's)."""
        value, _ = self._call("reading the outcome", lambda: self.client.get(self.outcome_key))
        if value is None:
            return None
        data = json.loads(value)
        return dict(data["summary"]) if float(data["ended"]) >= since else None

    def clear(self) -> None:
        """Remove the job's keys."""
        self._call("removing the job's keys", lambda: self.client.delete_prefix(self.prefix))

    def close(self) -> None:
        self.client.close()


class Leadership:
    """This coordinator leads while its lease lives: a thread refreshes it every third of
    its TTL; refreshes failing until the TTL has run out mean the leadership is lost
    (``lost``), and a coordinator that lost it must stop acting at once."""

    def __init__(self, plane: ControlPlane, lease_id: int, ttl: int, revision: int) -> None:
        self.plane = plane
        self.lease_id = lease_id
        self.ttl = ttl
        self.revision = revision
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_alive, name="xmig-lease", daemon=True)
        self._thread.start()

    def _keep_alive(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.ttl / 3):
            try:
                replies = list(self.plane.client.refresh_lease(self.lease_id))
                if replies and int(replies[0].TTL) > 0:
                    renewed = time.monotonic()
                    continue
                log.error("etcd: the leader's lease %x has expired", self.lease_id)
                self.lost.set()
                return
            except Exception as exc:  # a member down: the next refresh goes to another
                log.warning("etcd: refreshing the leader's lease failed: %s", exc)
            if time.monotonic() - renewed > self.ttl:
                log.error("etcd: the leader's lease could not be refreshed for %d s", self.ttl)
                self.lost.set()
                return

    def resign(self) -> None:
        """Give the leadership up (the lease, and with it the key, goes)."""
        self._stop.set()
        try:
            revoke = self.plane.client.revoke_lease
            self.plane._call("giving the leadership up", lambda: revoke(self.lease_id),
                             within=2.0)  # fmt: skip
        except ControlPlaneError as exc:
            log.warning("%s (it expires by itself)", exc)

    def abandon(self) -> None:
        """Stop refreshing the lease without giving it back (as a coordinator that hangs)."""
        self._stop.set()
