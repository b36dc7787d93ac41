"""Nothing reaches a rank's state unchecked: a client without the job's token cannot divert or
break the communicators through the c10d store, a state altered in transit is refused, and
replicas that disagree after a recovery stop the job; never a wrong result reported as good."""

import json
import os
import select
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from helpers import DEMO, finish_run, launched, run, wait_for

STEPS = 7
JOB = ["--nproc-per-node", "3", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "1.5"]
DEMO_ARGS = ["--steps", str(STEPS), "--quiet"]
_REFERENCE: dict[str, str] = {}


def reference_sha(tmp_path_factory):
    if "sha" not in _REFERENCE:
        result = run([*JOB, str(DEMO), *DEMO_ARGS], tmp_path_factory.mktemp("reference"))
        assert result.returncode == 0, result.output
        _REFERENCE["sha"] = result.summary["final_params_sha256"]
    return _REFERENCE["sha"]


def _store_port(proc, lines, timeout=60.0):
    """The store port from the launcher's first line (read as the job starts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "store port" in line:
            return int(line.rsplit("store port", 1)[1].strip())
    raise AssertionError("the launcher never said its store port:\n" + "".join(lines))


class Attacker(threading.Thread):
    """A local process's view of the job: a client of its c10d store, no token. It keeps
    writing its own address and garbage into every key a job's communicators would read."""

    def __init__(self, port, prefixes):
        super().__init__(daemon=True)
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=timedelta(seconds=10))  # fmt: skip
        self.prefixes = prefixes
        self.stop = threading.Event()
        self.writes = 0

    def keys(self):
        for prefix in self.prefixes:
            for generation in range(4):
                for group in ("world", "pull0", "pull1", "pull2"):
                    for rank in range(3):
                        yield f"{prefix}xmig/ccl/{group}/g{generation}/0/{rank}"

    def run(self):
        values = [b"127.0.0.1:1", os.urandom(64), b"\xff" * 8]
        while not self.stop.is_set():
            try:
                for key in self.keys():
                    self.store.set(key, values[self.writes % len(values)])
                    self.writes += 1
            except RuntimeError:  # the job ended and its store with it
                return
            time.sleep(0.05)


def _finish_with(proc, lines, tmp_path, timeout=180):
    result = finish_run(proc, tmp_path, timeout=timeout)
    result.output = "".join(lines) + result.output
    return result


def test_a_client_without_the_token_cannot_touch_the_communicators(tmp_path, tmp_path_factory):
    """Garbage and a foreign address written into every key the communicators of the first
    generations would use under xmig's former, predictable names: the job's keys are derived
    from its token, so the recovery goes on untouched and the result is bit-identical."""
    expected = reference_sha(tmp_path_factory)
    job = [*JOB, "--inject", "kill:rank=0:step=3:at=backward", str(DEMO), *DEMO_ARGS,
           "--step-sleep", "0.3"]  # fmt: skip
    with launched(job, tmp_path) as proc:
        lines: list[str] = []
        attacker = Attacker(_store_port(proc, lines), prefixes=["", "/", "default_pg/"])
        attacker.start()
        try:
            result = _finish_with(proc, lines, tmp_path)
        finally:
            attacker.stop.set()
            attacker.join(timeout=10)
    assert attacker.writes > 0
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected
    assert [r["replicas_equal"] for r in result.summary["recoveries"]] == [True]
    assert result.summary["recoveries"][0]["verified"] is not False


def test_garbage_under_a_leaked_prefix_stops_the_job_naming_the_store(tmp_path):
    """Should the keys leak after all (here: derived from the token the test reads from the
    job file), garbage in the next generation's keys makes the recovery stop with an error
    that names the store, instead of a bare std::bad_alloc."""
    from xmig.ccl import store_namespace  # here: xmig's keys were predictable before it

    job = [*JOB, "--hot-spares", "0", "--inject", "kill:rank=1:step=4:at=backward", str(DEMO),
           *DEMO_ARGS, "--step-sleep", "0.3"]  # fmt: skip
    with launched(job, tmp_path) as proc:
        lines: list[str] = []
        port = _store_port(proc, lines)
        found = wait_for(lambda: list((tmp_path / "jobs").glob("*.json")), 60, "the job file")
        token = json.loads(found[0].read_text())["token"]
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        for rank in range(3):  # before the fault: the replacement starts long after
            store.set(f"{store_namespace(token)}/xmig/ccl/world/g1/0/{rank}", os.urandom(48))
        result = _finish_with(proc, lines, tmp_path)
    assert result.returncode == 1, result.output
    message = result.summary["message"]
    assert f"c10d store at 127.0.0.1:{port}" in message, message
    assert "could not recover" in message


WRAPPER = """
import os, sys
sys.path.insert(0, {demo_dir!r})
if os.environ.get("XMIG_ATTEMPT", "0") != "0":
{patch}
import train_gpt
train_gpt.main(sys.argv[1:])
"""

CORRUPT_IN_TRANSIT = """
import torch
from xmig.state import transfer
real = transfer._broadcast
def corrupting(comm, tensor, device):
    real(comm, tensor, device)
    if tensor.dtype == torch.float32 and tensor.numel() > 100:
        tensor.view(torch.int32)[7] ^= 1  # one bit of one parameter, on the wire
transfer._broadcast = corrupting
"""

DIVERGE_AFTER_LOADING = """
import torch
import xmig.session
real = xmig.session.Session.load_state
def load_and_drift(self, state):
    real(self, state)
    with torch.no_grad():
        next(self._model().parameters()).view(-1)[0] += 1e-3
xmig.session.Session.load_state = load_and_drift
"""


def _wrapped(tmp_path, patch):
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPER.format(demo_dir=str(DEMO.parent),
                                     patch=textwrap.indent(patch.strip(), "    ")))  # fmt: skip
    return str(script)


@pytest.mark.parametrize("patch, needle", [
    (CORRUPT_IN_TRANSIT, "is not what it sent"),
    pytest.param(DIVERGE_AFTER_LOADING, "parameters differ at step", marks=pytest.mark.long),
], ids=["altered-in-transit", "replicas-diverge"])  # fmt: skip
def test_a_wrong_state_stops_the_job(tmp_path, patch, needle):
    """The replacement's state is altered on the wire (its digest differs from the one the
    sender announced: refused before loading), or drifts after loading (the replicas'
    checksums after the recovered step differ): the job stops saying so, exit 1."""
    result = run([*JOB, "--inject", "kill:rank=2:step=3:at=backward", _wrapped(tmp_path, patch),
                  *DEMO_ARGS], tmp_path)  # fmt: skip
    assert result.returncode == 1, result.output
    assert result.summary["status"] == "failed"
    assert needle in result.summary["message"], result.summary["message"]
