"""The worker's end of its connection to the node agent: hello, heartbeat, reports."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from xmig.faults.spec import FaultSpec
from xmig.jobenv import WorkerEnv
from xmig.wire import Client, WireError, parse_address

LOST_AGENT_EXIT_CODE = 70
# orders from the coordinator that the agent hands on to its workers
PLAN_OPS = ("park", "rebuild", "abort", "pause", "dump", "resume", "release", "state_digest")


class AgentLink:
    """Connects a worker to its agent and keeps a heartbeat thread running.

    The heartbeat is a one-way notice every ``heartbeat_interval`` seconds carrying the current
    step; it never touches a collective. If the agent goes away the worker exits at once, so a
    lost node never leaves orphaned workers behind.
    """

    def __init__(
        self,
        env: WorkerEnv,
        on_inject: Callable[[FaultSpec], None],
        on_plan: Callable[[dict], None] | None = None,
    ) -> None:
        assert env.agent_addr and env.token
        self.rank = env.rank
        self.step: int | None = None
        self._on_inject = on_inject
        self._on_plan = on_plan
        self._closing = False
        self._client = Client(
            parse_address(env.agent_addr),
            env.token,
            info={"role": "worker", "rank": env.rank, "pid": os.getpid()},
            on_push=self._on_push,
            on_close=self._on_lost,
        )
        self._client.call("hello", rank=env.rank, pid=os.getpid(), attempt=env.attempt)
        self._interval = env.heartbeat_interval
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="xmig-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._client.notify("hb", step=self.step, t=time.time())
            except WireError:
                return

    def _on_push(self, msg: dict) -> None:
        if msg.get("op") == "inject":
            self._on_inject(FaultSpec.from_json(msg["fault"]))
        elif msg.get("op") in PLAN_OPS and self._on_plan is not None:
            self._on_plan(msg)

    def _on_lost(self) -> None:
        if self._closing:
            return
        print(f"xmig: rank {self.rank} lost its agent; stopping this worker", file=sys.stderr)
        sys.stderr.flush()
        os._exit(LOST_AGENT_EXIT_CODE)

    def report_step(self, step: int) -> None:
        """Tell the agent the rank entered ``step`` (one-way, microseconds)."""
        self.step = step
        try:
            self._client.notify("step", step=step, t=time.time())
        except WireError:
            self._on_lost()

    def announce_fault(self, spec: FaultSpec) -> None:
        """Tell the agent an injected fault is about to happen; returns once it knows."""
        self._client.call(
            "injecting", fault=spec.to_json(), step=self.step, t=time.time(), timeout=5.0
        )

    def report_error(self, exc: BaseException) -> None:
        """Report an exception that is about to end this worker."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        with contextlib.suppress(WireError, TimeoutError):
            self._client.call("error", error=text, step=self.step, t=time.time(), timeout=5.0)

    def report_comm_error(self, error: str, step: int | None, generation: int) -> None:
        """A collective failed in this (live) process; the proxy holds the framework."""
        try:
            self._client.notify(
                "comm_error", error=error, step=step, generation=generation, t=time.time()
            )
        except WireError:
            self._on_lost()

    def report(self, op: str, **fields: object) -> None:
        """A recovery report (parked, recovered, recovery_failed) for the coordinator."""
        try:
            self._client.notify(op, t=time.time(), **fields)
        except WireError:
            self._on_lost()

    def ready_for_dump(self, gpu: str | None, gpu_bytes: int = 0) -> None:
        """Tell the agent this process is quiet and may be checkpointed (``gpu``: the UUID of
        the GPU it holds state on, ``gpu_bytes`` of it); returns once it knows (the worker
        closes this link next: its end is not a fault)."""
        self._client.call("ready_for_dump", gpu=gpu, gpu_bytes=gpu_bytes, t=time.time(),
                          timeout=10.0)  # fmt: skip

    def report_done(self, steps: int, params_sha256: str | None, checksum: str | None) -> None:
        """Report that the training loop finished ``steps`` steps (``checksum``: of the
        parameters, when they are replicas every rank must agree on)."""
        self._client.call("done", steps=steps, params_sha256=params_sha256, checksum=checksum,
                          timeout=10.0)  # fmt: skip

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        self._client.close()
