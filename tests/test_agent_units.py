"""The agent's decisions that need no processes, and its spare pool without a job."""

import json
import os
import selectors
import sys

import pytest

from xmig.agent.agent import AdoptedProcess, Worker, set_worker_defaults, workers_starting
from xmig.agent.spare import READY_FD
from xmig.agent.spares import Spare, SparePool, spare_may_start
from xmig.jobspec import JobSpec


@pytest.mark.parametrize(
    ("cores", "workers", "spares", "starting", "expected"),
    [
        (2, 2, 1, True, False),  # a small node: the spare waits for the workers
        (2, 2, 1, False, True),  # ... and starts once they are up
        (32, 2, 3, True, True),  # a GPU node: spares warm up beside the starting workers
        (16, 8, 1, True, False),  # 8 workers on 16 cores: no room beside them
        (18, 8, 1, True, True),
    ],
)
def test_spare_warms_up_beside_starting_workers_only_where_cores_allow(
    cores, workers, spares, starting, expected
):
    assert spare_may_start(cores, workers, spares, starting) is expected


def test_a_worker_is_starting_until_it_has_begun_a_step():
    def worker(state, step):
        return Worker(rank=0, local_rank=0, proc=AdoptedProcess(1), pidfd=-1, attempt=0,
                      state=state, step=step)  # fmt: skip

    assert workers_starting([worker("starting", None)])  # not yet said hello
    assert workers_starting([worker("running", 3), worker("running", None)])  # no step yet
    assert not workers_starting([worker("running", 0), worker("running", 5)])
    # a worker that is gone or on its way out does not hold the spare back
    assert not workers_starting([worker("exited", None), worker("faulted", None)])
    assert not workers_starting([])


# a stand-in for ``python -m xmig.agent.spare`` (no torch): says it is ready when told to by
# its environment, then writes the order it gets on stdin to the file its environment names
FAKE_SPARE = """
import os, sys
if os.environ.get("FAKE_READY") == "1":
    os.write(int(os.environ["XMIG_SPARE_READY_FD"]), b"1")
    os.close(int(os.environ["XMIG_SPARE_READY_FD"]))
line = sys.stdin.readline()
with open(os.environ["FAKE_ORDER"], "w") as out:
    out.write(line)
"""


@pytest.fixture
def environ(tmp_path):
    """What the pool starts its next spare with (a test may change it)."""
    return {**os.environ, "FAKE_ORDER": str(tmp_path / "order.json"), "FAKE_READY": "1"}


@pytest.fixture
def pool(environ):
    selector = selectors.DefaultSelector()
    pool = SparePool(selector, lambda: dict(environ), wanted=1,
                     command=[sys.executable, "-c", FAKE_SPARE])  # fmt: skip
    yield pool
    pool.stop()
    selector.close()


def _spec(tmp_path):
    return JobSpec(job_id="j", script="/train.py", args=["--steps", "3"], cwd=str(tmp_path))


def _wait_ready(pool):
    """As the agent's main loop does: its selector says which spare's pipe is readable."""
    for key, _ in pool._selector.select(timeout=30):
        assert isinstance(key.data, Spare)
        return pool.on_ready(key.data)
    raise AssertionError("no spare said anything within 30 s")


def test_take_without_a_ready_spare_is_none(pool, environ, tmp_path):
    assert pool.take({"A": "1"}, _spec(tmp_path)) is None  # none started
    environ["FAKE_READY"] = "0"
    pool.start(str(tmp_path))
    assert len(pool) == 1 and pool.ready_count == 0
    assert pool.take({"A": "1"}, _spec(tmp_path)) is None  # started, not ready
    assert len(pool) == 1


def test_a_ready_spare_is_handed_the_workers_order(pool, tmp_path):
    spare = pool.keep(str(tmp_path), workers=1, workers_starting=False)
    assert spare is not None and READY_FD not in os.environ
    assert pool.keep(str(tmp_path), workers=1, workers_starting=False) is None  # has its one
    assert _wait_ready(pool) is True
    assert pool.ready_count == 1
    proc = pool.take({"RANK": "3"}, _spec(tmp_path))
    assert proc is spare.proc
    assert proc.wait(timeout=30) == 0
    order = json.loads((tmp_path / "order.json").read_text())
    assert order == {"env": {"RANK": "3"}, "script": "/train.py", "args": ["--steps", "3"],
                     "cwd": str(tmp_path)}  # fmt: skip
    assert len(pool) == 0
    # a taken spare is replaced, but not at once (so as not to slow a recovery)
    assert pool.keep(str(tmp_path), workers=1, workers_starting=False) is None


def test_a_spare_that_dies_warming_up_is_dropped(pool, environ, tmp_path):
    environ["FAKE_READY"] = "0"
    spare = pool.start(str(tmp_path))
    spare.proc.stdin.close()  # it exits without saying it is ready
    assert _wait_ready(pool) is False
    assert len(pool) == 0 and spare.proc.returncode is not None


def test_stop_kills_every_spare_and_starts_no_more(pool, environ, tmp_path):
    environ["FAKE_READY"] = "0"
    waiting = pool.start(str(tmp_path))
    environ["FAKE_READY"] = "1"
    ready = pool.start(str(tmp_path))
    while pool.ready_count < 1:
        _wait_ready(pool)
    pool.stop()
    assert len(pool) == 0 and pool.wanted == 0
    assert waiting.proc.returncode is not None and ready.proc.returncode is not None
    assert not pool._selector.get_map()  # nothing left watched
    assert pool.keep(str(tmp_path), workers=0, workers_starting=False) is None


def test_workers_get_expandable_segments_unless_the_job_set_its_allocator():
    environ: dict[str, str] = {}
    set_worker_defaults(environ, world_size=2)
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert environ["OMP_NUM_THREADS"] == "1" and environ["PYTHONUNBUFFERED"] == "1"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        own = {name: "max_split_size_mb:128"}
        set_worker_defaults(own, world_size=1)
        assert own.get("PYTORCH_CUDA_ALLOC_CONF", "") != "expandable_segments:True"
        assert own[name] == "max_split_size_mb:128"
    single: dict[str, str] = {}
    set_worker_defaults(single, world_size=1)
    assert "OMP_NUM_THREADS" not in single  # one rank: the machine's threads are its own
    assert "CUDA_MODULE_LOADING" not in single


def test_gated_workers_load_every_cuda_module_at_start_unless_the_job_says_otherwise():
    gated: dict[str, str] = {}
    set_worker_defaults(gated, world_size=2, gpu_gate=True)
    assert gated["CUDA_MODULE_LOADING"] == "EAGER"
    own = {"CUDA_MODULE_LOADING": "LAZY"}
    set_worker_defaults(own, world_size=2, gpu_gate=True)
    assert own["CUDA_MODULE_LOADING"] == "LAZY"


def test_a_spare_container_that_does_not_start_is_tried_again_later(environ, tmp_path):
    """Container mode: the runtime refusing a spare's container leaves the pool without one
    for a while (the agent's loop goes on), never a crash of the agent."""
    from xmig.container.runc import RuncError

    selector = selectors.DefaultSelector()
    pool = SparePool(selector, lambda: dict(environ), wanted=1,
                     command=[sys.executable, "-c", FAKE_SPARE])  # fmt: skip
    tried = []

    def refuse(command, env, ready_fd):
        tried.append(command)
        raise RuncError("starting container x failed (runc exit 1): no rootfs")

    pool.in_container = refuse
    try:
        assert pool.keep(str(tmp_path), workers=0, workers_starting=False) is None
        assert len(tried) == 1 and len(pool) == 0
        assert pool.keep(str(tmp_path), workers=0, workers_starting=False) is None
        assert len(tried) == 1  # not again at once
    finally:
        pool.stop()
        selector.close()


def test_a_worker_whose_container_does_not_start_is_reported_as_a_process_that_ended():
    """To the coordinator, a rank whose container runc refused is a process that started and
    ended at once: a fault naming why, which its recovery (or the job's stop) answers."""
    from xmig.agent.agent import NO_PID, Agent
    from xmig.container.runc import RuncError
    from xmig.protocol import Fault, WorkerStarted

    class Refusing:
        def env(self, environ):
            return environ

        def start_worker(self, rank, attempt, environ):
            raise RuncError("starting container c failed (runc exit 1): exec: no such file")

    class Server:
        address = ("127.0.0.1", 1)

    agent = Agent(("127.0.0.1", 1), "t" * 64, node_rank=0)
    agent._job = JobSpec(job_id="j", script="/train.py", args=(), cwd="/", nproc_per_node=2,
                         container="/srv/rootfs")  # fmt: skip
    agent.server = Server()
    agent.containers = Refusing()
    sent = []
    agent._send = sent.append
    assert agent._spawn(1, 1, attempt=2, generation=3) is None
    assert 1 not in agent.workers
    started, fault = sent
    assert isinstance(started, WorkerStarted) and (started.rank, started.pid) == (1, NO_PID)
    assert started.attempt == 2
    assert isinstance(fault, Fault)
    record = fault.record
    assert (record.rank, record.pid, record.kind, record.attempt) == (1, NO_PID, "exit", 2)
    assert "its container did not start" in record.detail and "no such file" in record.detail


@pytest.mark.parametrize("delay_s", [0.0, 0.003])
def test_a_workers_step_notices_reach_its_agent_in_order_with_its_other_messages(
    delay_s, monkeypatch
):
    # the step notice is sent by a thread of the link's (a send on the step loop's own thread
    # cost the boundary most of its time), after ``XMIG_NOTICE_DELAY_MS`` if set: it must
    # still arrive before what the rank says next
    import threading
    import time
    from types import SimpleNamespace

    from xmig import protocol
    from xmig.agent import link as link_module
    from xmig.agent.link import AgentLink
    from xmig.wire import Server

    monkeypatch.setattr(link_module, "NOTICE_DELAY_S", delay_s)

    heard, lock = [], threading.Lock()

    def handler(_peer, msg):
        with lock:
            heard.append((msg["op"], msg.get("step")))
        return {}

    token = "t" * 64
    server = Server("127.0.0.1", 0, token, handler).start()
    env = SimpleNamespace(agent_addr=f"127.0.0.1:{server.address[1]}", token=token, rank=0,
                          attempt=0, heartbeat_interval=60.0)  # fmt: skip
    link = AgentLink(env, on_inject=lambda _spec: None)
    try:
        for step in range(50):
            link.started(step)
            if step % 10 == 9:
                link.send(protocol.CommError(error="e", step=step, generation=0, t=0.0))
        link.ask(protocol.Injecting(fault={}, step=50, t=0.0))
        link.started(50)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ("step", 50) not in heard:
            time.sleep(0.01)
    finally:
        link.close()
        server.close()
    expected = [("hello", None)]
    for step in range(50):
        expected.append(("step", step))
        if step % 10 == 9:
            expected.append(("comm_error", step))
    expected += [("injecting", 50), ("step", 50)]
    assert heard == expected
    assert link.step == 50


def test_the_notice_delay_is_read_in_ms_and_a_bad_value_is_none():
    from xmig.agent.link import notice_delay_s

    assert notice_delay_s(None) == 0.0 and notice_delay_s("") == 0.0
    assert notice_delay_s("3") == 0.003 and notice_delay_s("0.5") == 0.0005
    for bad in ("abc", "-1", "5000", "nan"):
        assert notice_delay_s(bad) == 0.0, bad


@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_a_report_read_after_an_announced_kill_leaves_the_kill_to_the_death(kind):
    """A rank reports a failed collective, then announces a fault and carries it out, before
    the agent's main loop reads the report: the death (a kill) still says it was injected,
    or the report that follows the announcement is the fault (a raise)."""
    from types import SimpleNamespace

    from xmig.agent.agent import Agent
    from xmig.protocol import CommError, Fault, Injecting, encode

    agent = Agent(("127.0.0.1", 1), "t" * 64, node_rank=0)
    sent = []
    agent._send = sent.append
    worker = Worker(rank=2, local_rank=2, proc=AdoptedProcess(4242), pidfd=-1, attempt=0,
                    state="running")  # fmt: skip
    agent.workers[2] = worker
    peer = SimpleNamespace(info={"rank": 2, "pid": 4242})
    fault = {"kind": kind, "rank": 2, "step": 2, "at": "park"}
    before = CommError(error="peer gone", step=2, generation=0, t=1.0)
    agent._on_worker_message(peer, encode(before))
    agent._on_worker_message(peer, encode(Injecting(fault=fault, step=2, t=2.0)))
    if kind == "raise":
        agent._on_worker_message(peer, encode(CommError(error="injected", step=2,
                                                        generation=0, t=3.0)))  # fmt: skip
    while not agent._events.empty():
        agent._trouble(agent._events.get_nowait())
    if kind == "kill":
        agent._report_fault(worker, "killed", "killed by SIGKILL", 4.0)
    records = [m.record for m in sent if isinstance(m, Fault)]
    assert [(r.kind, r.injected) for r in records][0] == ("comm_error", None)
    last = records[-1]
    assert last.injected == fault and last.t_fault == 2.0
    assert last.fault_time_source == "injection"
