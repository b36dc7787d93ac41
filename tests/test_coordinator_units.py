"""The coordinator and agent processes' machinery without a job: a Coordinator on loopback
driven by hand-made clients, an Agent's message intake called directly."""

import queue
import threading
from datetime import timedelta

import pytest

from xmig.agent.agent import AdoptedProcess, Agent, CoordLost, ToCoordinator, Worker
from xmig.coord import eventlog
from xmig.coord.coordinator import Coordinator
from xmig.jobspec import JobSpec
from xmig.protocol import Park, Parked, Position, encode
from xmig.wire import Client, RemoteError, parse_address

TOKEN = "unit-test-token"


@pytest.fixture
def coordinator(tmp_path, monkeypatch):
    monkeypatch.setenv("XMIG_JOBS_DIR", str(tmp_path))
    spec = JobSpec(job_id="unit", script="train.py", args=(), cwd=str(tmp_path), nnodes=1,
                   nproc_per_node=1, stop_grace=0.5)  # fmt: skip
    coord = Coordinator(spec, TOKEN)
    thread = threading.Thread(target=coord.run, daemon=True)
    thread.start()
    clients = []

    def connect(info):
        pushed = queue.SimpleQueue()
        client = Client(parse_address(coord.address), TOKEN, info=info, on_push=pushed.put)
        clients.append(client)
        return client, pushed

    yield coord, thread, connect
    for client in clients:
        client.close()
    coord.finished.set()
    thread.join(5)
    coord.server.close()


def test_events_are_applied_in_order_and_unknown_messages_refused(coordinator):
    coord, thread, connect = coordinator
    agent, to_agent = connect({"role": "agent", "node": 0, "pid": 1})
    reply = agent.call("agent_hello", node=0, pid=1, netns=None)
    assert reply["job"]["job_id"] == "unit" and reply["generation"] == 0
    with pytest.raises(RemoteError, match="unknown message 'bogus'"):
        agent.call("bogus")
    with pytest.raises(RemoteError, match="field 'step' is missing"):
        agent.call("progress", rank=0)
    with pytest.raises(RemoteError, match="node rank 0 has already joined"):
        agent.call("agent_hello", node=0, pid=1, netns=None)

    launcher, to_launcher = connect({"role": "launcher"})
    with pytest.raises(RemoteError, match="cannot come from the launcher"):
        launcher.call("worker_exited", rank=0, pid=1, t=0.0)
    launcher.call("wait_result")
    assert launcher.call("status")["status"]["status"] == "running"
    assert launcher.call("stop", reason="a unit test")["stopping"] is True
    assert to_agent.get(timeout=5) == {"op": "stop_workers", "grace": 0.5}
    assert launcher.call("stop")["stopping"] is False  # already ending

    agent.notify("stopped", node=0)
    result = to_launcher.get(timeout=5)
    assert result["op"] == "result"
    assert result["summary"]["message"] == "failed: a unit test"
    assert result["summary"]["event_log"] == str(coord.events_path)
    assert to_agent.get(timeout=5) == {"op": "shutdown"}
    thread.join(5)
    assert not thread.is_alive() and coord.status == "failed"
    events = [e["event"] for e in eventlog.read(coord.events_path)]
    assert events[0] == "job" and events[-1] == "outcome"
    assert "agent" in events and events.count("job") == 4  # starting, running, stopping, failed


def test_an_agent_that_falls_silent_is_lost_with_its_ranks(coordinator):
    coord, thread, connect = coordinator
    agent, to_agent = connect({"role": "agent", "node": 0, "pid": 1})
    agent.call("agent_hello", node=0, pid=1, netns=None)
    agent.notify("worker_started", rank=0, node=0, pid=7, attempt=0, t=0.0, from_spare=False)
    agent.notify("worker_joined", rank=0, pid=7, attempt=0, t=0.0)
    # no heartbeat: after heartbeat_timeout (3 s) the agent is told to go, its node is lost
    assert to_agent.get(timeout=10) == {"op": "shutdown"}
    thread.join(10)
    assert coord.status == "failed" and coord.job.lost_nodes == [0]
    assert "no spare node" in coord.summary["message"]
    assert coord.summary["faults"][0]["kind"] == "agent_lost"


class FakePeer:
    def __init__(self, rank, pid):
        self.info = {"role": "worker", "rank": rank, "pid": pid}
        self.pushed = []

    def push(self, msg):
        self.pushed.append(msg)
        return True


def drain(agent):
    out = []
    while not agent._events.empty():
        out.append(agent._events.get())
    return out


def test_the_agent_rejects_what_it_does_not_know_and_names_the_sender_of_reports():
    agent = Agent(("127.0.0.1", 1), TOKEN, node_rank=0)
    agent.workers[0] = Worker(rank=0, local_rank=0, proc=AdoptedProcess(4242), pidfd=-1,
                              attempt=0)  # fmt: skip
    peer = FakePeer(rank=0, pid=4242)
    for frame, error in [({"op": "bogus"}, "unknown message"),
                         (encode(Park(generation=1, replaced=[0])), "cannot come from the worker"),
                         ({"op": "step", "step": "x", "t": 0.0}, "str is not int")]:  # fmt: skip
        with pytest.raises(ValueError, match=error):
            agent._on_worker_message(peer, frame)
    assert drain(agent) == []
    position = Position(step=3, state_step=3, log_from=2, keep_log=True, signatures={})
    agent._on_worker_message(peer, encode(Parked(generation=1, position=position)))
    (event,) = drain(agent)
    assert isinstance(event, ToCoordinator) and event.msg.rank == 0  # from its connection
    with pytest.raises(ValueError, match="no worker with rank 0 and that pid"):
        agent._on_worker_message(FakePeer(rank=0, pid=1), {"op": "hb", "step": 1, "t": 0.0})

    agent._on_coord_push({"op": "park", "generation": "one", "replaced": []})
    agent._on_coord_push({"op": "hello", "rank": 0, "pid": 1, "attempt": 0})  # a worker's
    assert drain(agent) == []
    agent._on_coord_push(encode(Park(generation=1, replaced=[0])))
    agent._on_coord_lost()
    assert drain(agent) == [Park(generation=1, replaced=[0]), CoordLost()]


def test_the_store_serves_on_the_port_said_before_it_was_up(coordinator):
    coord, _, _ = coordinator
    import torch.distributed as dist

    # the port is known at once (the ready line carries it); the store comes up on its thread
    port = coord.spec.master_port
    assert port == coord._store_socket.getsockname()[1]
    assert coord.store_ready.wait(60), "the store did not come up"
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert coord.store.get("key") == b"value"


def test_a_nodes_images_go_where_xmig_images_dir_says(tmp_path, monkeypatch):
    import tempfile
    from pathlib import Path

    from xmig.coord.migration import images_dir, job_images

    monkeypatch.delenv("XMIG_MIGRATE_DIR", raising=False)
    monkeypatch.delenv("XMIG_IMAGES_DIR", raising=False)
    default = Path(tempfile.gettempdir()) / "xmig-migrate" / "j1"
    assert images_dir("j1", 2, "r0-g3") == str(default / "node2" / "r0-g3")
    assert job_images("j1") == [default]
    monkeypatch.setenv("XMIG_IMAGES_DIR", str(tmp_path))
    assert images_dir("j1", 2, "r0-g3") == str(tmp_path / "xmig-migrate" / "j1" / "node2" / "r0-g3")
    assert job_images("j1") == [default, tmp_path / "xmig-migrate" / "j1"]  # both cleaned up
    monkeypatch.setenv("XMIG_MIGRATE_DIR", str(tmp_path / "shared"))  # a shared one wins
    shared = tmp_path / "shared" / "xmig-migrate" / "j1"
    assert images_dir("j1", 2, "r0-g3") == str(shared / "r0-g3")
