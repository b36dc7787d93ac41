"""The worker's end of its connection to the node agent: hello, heartbeat, reports, orders."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from xmig import protocol
from xmig.faults.spec import FaultSpec
from xmig.jobenv import WorkerEnv
from xmig.wire import Client, WireError, parse_address
from xmig.worker.errors import exit_now

logger = logging.getLogger(__name__)

LOST_AGENT_EXIT_CODE = 70
# how long the sender lets a step notice wait before it sends it (``XMIG_NOTICE_DELAY_MS``):
# at a step's start the GPU waits for the step's first kernels, and the sender's wake-up
# takes the interpreter from the thread that queues them
NOTICE_DELAY_ENV = "XMIG_NOTICE_DELAY_MS"


def notice_delay_s(value: str | None) -> float:
    """The sender's wait in seconds for ``XMIG_NOTICE_DELAY_MS``'s value: 0 when unset; a
    value that is not a number from 0 to 1000 is refused with a warning (no delay)."""
    if not value:
        return 0.0
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 <= ms <= 1000:
        logger.warning("%s=%r is not a delay from 0 to 1000 ms: none is used",
                       NOTICE_DELAY_ENV, value)  # fmt: skip
        return 0.0
    return ms / 1e3


NOTICE_DELAY_S = notice_delay_s(os.environ.get(NOTICE_DELAY_ENV))


def handle_push(
    frame: Any,
    on_inject: Callable[[FaultSpec], None],
    on_order: Callable[[protocol.Message], None] | None,
) -> None:
    """Decode one frame the agent pushed and hand it on: a fault to inject to the injector,
    any other order to ``on_order``. A frame that does not decode, or that its handler
    refuses, is logged and dropped: it never ends the link's reader."""
    try:
        msg = protocol.decode(frame, protocol.Party.WORKER, protocol.Party.AGENT)
    except protocol.ProtocolError as exc:
        logger.warning("dropped a message from the agent: %s", exc)
        return
    try:
        if isinstance(msg, protocol.InjectFault):
            on_inject(FaultSpec.from_json(msg.fault))
        elif on_order is not None:
            on_order(msg)
    except Exception as exc:
        logger.warning("dropped the agent's %r: %s: %s", msg.OP, type(exc).__name__, exc)


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
        on_order: Callable[[protocol.Message], None] | None = None,
    ) -> None:
        assert env.agent_addr and env.token
        self.rank = env.rank
        self.step: int | None = None  # the last step the rank said it entered
        self._closing = False
        # step notices wait here for the sender thread; every other message first sends them,
        # under ``_order``, so the agent hears everything in the order the rank said it
        self._order = threading.Lock()
        self._notices: list[protocol.Message] = []
        self._notice_ready = threading.Event()
        self._client = Client(
            parse_address(env.agent_addr),
            env.token,
            info={"role": "worker", "rank": env.rank, "pid": os.getpid()},
            on_push=lambda frame: handle_push(frame, on_inject, on_order),
            on_close=self._on_lost,
        )
        self.ask(protocol.Hello(rank=env.rank, pid=os.getpid(), attempt=env.attempt))
        self._interval = env.heartbeat_interval
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="xmig-heartbeat", daemon=True)
        self._beat.start()
        self._sender = threading.Thread(target=self._send_notices, name="xmig-notices",
                                        daemon=True)  # fmt: skip
        self._sender.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval):
            beat = protocol.Heartbeat(step=self.step, t=time.time())
            try:
                self._client.notify(beat.OP, **protocol.fields_of(beat))
            except WireError:
                return

    def _on_lost(self) -> None:
        if self._closing:
            return
        logger.error("rank %d lost its agent; stopping this worker", self.rank)
        exit_now(LOST_AGENT_EXIT_CODE)

    def send(self, msg: protocol.Message) -> None:
        """A one-way notice (a report for the agent or, through it, the coordinator)."""
        try:
            with self._order:
                self._flush_notices()
                self._client.notify(msg.OP, **protocol.fields_of(msg))
        except WireError:
            self._on_lost()

    def ask(self, msg: protocol.Message, timeout: float | None = 30.0) -> dict[str, Any]:
        """A request: returns the agent's reply once it has one (raises as ``Client.call``)."""
        with self._order:
            self._flush_notices()
        return self._client.call(msg.OP, timeout=timeout, **protocol.fields_of(msg))

    def started(self, step: int) -> None:
        """Tell the agent the rank entered ``step``: handed to the sender thread, since a send
        on the step loop's thread cost a step boundary 0.7 ms of its 0.9 (the socket call lets
        the process's other threads, and the agent, run first)."""
        self.step = step
        with self._order:
            self._notices.append(protocol.StepStarted(step=step, t=time.time()))
        self._notice_ready.set()

    def _flush_notices(self) -> None:
        """Send the step notices not yet sent (the caller holds ``_order``)."""
        notices, self._notices = self._notices, []
        for notice in notices:
            self._client.notify(notice.OP, **protocol.fields_of(notice))

    def _send_notices(self) -> None:
        while not self._stop.is_set():
            self._notice_ready.wait()
            if NOTICE_DELAY_S > 0:
                self._stop.wait(NOTICE_DELAY_S)
            self._notice_ready.clear()
            try:
                with self._order:
                    self._flush_notices()
            except WireError:
                if not self._closing:
                    self._on_lost()
                return

    def close(self) -> None:
        self._closing = True
        try:
            with self._order:
                self._flush_notices()
        except WireError:
            pass
        self._stop.set()
        self._notice_ready.set()
        self._client.close()
