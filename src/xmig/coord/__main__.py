"""``python -m xmig.coord``: the job's coordinator process (started by ``xmig run``).

Reads the job spec as JSON on stdin and the token from the environment, then prints one JSON
line on stdout: ``{"ready": ..., "address": ..., "master_port": ...}`` or ``{"error": ...}``.
"""

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

from xmig import logs
from xmig.coord.coordinator import Coordinator
from xmig.coord.etcd import ControlPlaneError
from xmig.coord.snapshot import SnapshotError
from xmig.jobenv import COORD_RESTART as RESTART
from xmig.jobenv import TOKEN
from xmig.jobspec import JobSpec

LINGER_S = 5.0


def main() -> int:
    token = os.environ.get(TOKEN)
    spec = JobSpec.from_json(json.loads(sys.stdin.readline()))
    logs.setup(spec.log_level)
    if not token:
        print(json.dumps({"error": "the job token is missing from the environment"}), flush=True)
        return 2
    restart = int(os.environ.get(RESTART, "0") or 0)
    try:
        coord = Coordinator(spec, token, restart=restart)
    except (SnapshotError, ControlPlaneError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    except (RuntimeError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"cannot listen on {spec.master_addr}:{spec.master_port}: {first}"
        if "in use" in first.lower() or "EADDRINUSE" in first:
            reason = f"port {spec.master_port} on {spec.master_addr} is already in use"
        print(json.dumps({"error": reason}), flush=True)
        return 2
    ready = {"ready": True, "address": coord.address, "master_port": coord.spec.master_port,
             "pid": os.getpid()}  # fmt: skip
    print(json.dumps(ready), flush=True)
    if coord.plane is not None:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda signum, _frame: given_up(coord, stop, signum))
        if not coord.lead(stop):
            return 1
    coord.run()
    # let the launcher read the outcome and the agents shut down before the store goes away,
    # and the requests decided before the end (``xmig stop``'s) have their replies
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline and (
        any(not p.conn.closed for p in coord.peers.values())
        or any(not p.conn.closed for p in coord.launchers)
        or coord.server.answering()
    ):
        time.sleep(0.02)
    if coord.plane is not None and coord.leadership is not None:
        # the job is over: its outcome stays (a launcher or standby that comes late finds it
        # there), its snapshot goes first (no standby may take the job up again)
        with contextlib.suppress(ControlPlaneError):
            if coord.summary is not None:
                coord.plane.end(coord.summary)
            else:
                coord.plane.clear()
        leadership, coord.leadership = coord.leadership, None
        leadership.resign()
    return 0 if coord.status == "completed" else 1


def given_up(coord: Coordinator, stop: threading.Event, signum: int) -> None:
    """(HA control plane.) SIGTERM, as the launcher ends the job's coordinators: the lead, if
    this one holds it, is given back before the process ends, so that its key does not
    outlive it by its lease's time (a standby stopped as it took the lead over left it)."""
    stop.set()
    leadership = coord.leadership
    if leadership is not None:
        leadership.resign()
    leave(128 + signum)


def leave(code: int) -> None:
    """End the process at once, its output flushed: the interpreter's own teardown of torch
    (collecting and freeing its objects) takes about 0.5 s, which the launcher would wait
    for at every job's end, and the coordinator has nothing left to finish by then."""
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
