"""A migration, as a worker lives it: pause at a step boundary, be checkpointed and moved
(the rank that moves), and go on on a new generation's communicator."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from xmig import protocol
from xmig.procs import die_with_parent, outlive_parent
from xmig.worker.context import WorkerContext
from xmig.worker.errors import exit_now
from xmig.worker.phase import WorkerPhase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continue:
    """Not an order from the wire: a pause superseded by one at a later step."""

    generation: int


class Migration:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._pause_at: protocol.Pause | None = None
        self._boundary: int | None = None  # the last step the loop started
        self._paused_at: int | None = None

    def on_pause(self, order: protocol.Pause) -> None:
        """From the order consumer: pause at the start of ``order.step``, or say this rank has
        already begun it."""
        with self._lock:
            started = self._boundary
            if started is not None and started >= order.step:
                self._ctx.send(protocol.PauseRefused(generation=order.generation, step=started,
                                                     t=time.time()))  # fmt: skip
                return
            self._pause_at = order
            if self._paused_at is not None and self._paused_at < order.step:
                # paused at an earlier boundary of a superseded order: go on to this one
                self._ctx.orders.boundary.hand(Continue(order.generation))

    def at_boundary(self, step: int) -> None:
        """The step loop is at the start of ``step``: pause here if told to."""
        with self._lock:
            self._boundary = step
            order = self._pause_at
            if order is None or order.step != step:
                return
            self._pause_at = None
            self._paused_at = step
        try:
            self._paused(step, order)
        finally:
            with self._lock:
                self._paused_at = None

    def _paused(self, step: int, pause: protocol.Pause) -> None:
        """Wait at this boundary, every collective of the last step complete, until the
        coordinator resumes the job on a new generation's communicator."""
        ctx = self._ctx
        generation = pause.generation
        ctx.phase.move(WorkerPhase.PAUSED)
        if ctx.backend == "nccl":
            # the communicator is replaced on resume; aborting it now frees the peers' mappings
            # of each other's GPU memory, which a GPU checkpoint of a moving rank needs
            for proxy in ctx.groups.proxies():
                proxy.abort_communicator(wait=True)
        ctx.send(protocol.Paused(generation=generation, step=step, t=time.time()))
        while True:
            order = ctx.orders.boundary.next(generation, ctx.env.recovery_timeout)
            if order is None:
                ctx.die(f"paused for migration and no order came within "
                        f"{ctx.env.recovery_timeout:.0f} s")  # fmt: skip
            if isinstance(order, Continue):
                break
            if isinstance(order, protocol.Dump):
                self._be_moved(order)
            elif isinstance(order, protocol.Resume):
                for group in ctx.groups.all():  # the moved rank's connections are closed
                    group.proxy.switch(ctx.comms.communicator(
                        group.name, generation, group.proxy.communicator.rank,
                        group.proxy.communicator.size))  # fmt: skip
                ctx.send(protocol.Resumed(generation=generation, t=time.time()))
                break
        ctx.phase.move(WorkerPhase.TRAINING)

    def _be_moved(self, order: protocol.Dump) -> None:
        """This rank is the one moving: close the connections that cannot move, let the
        agent checkpoint this process, and, restored on the target node, reconnect there."""
        ctx = self._ctx
        assert ctx.link is not None
        ctx.phase.move(WorkerPhase.MOVING)
        # before the agent hears of it: its dump may come at once. The restorer becomes the
        # parent for a moment, then exits
        outlive_parent()
        gpu, gpu_bytes = None, 0
        if ctx.backend == "nccl":
            torch.cuda.synchronize(ctx.device)
            # cached free blocks would be checkpointed, copied and restored for nothing
            torch.cuda.empty_cache()
            gpu = str(torch.cuda.get_device_properties(ctx.device).uuid)
            free, total = torch.cuda.mem_get_info(ctx.device)
            gpu_bytes = total - free  # this GPU's use: this process's, one process per GPU
        ctx.link.ask(protocol.ReadyForDump(gpu=gpu, gpu_bytes=gpu_bytes, t=time.time()),
                     timeout=10.0)  # fmt: skip
        ctx.link.close()
        deadline = time.monotonic() + ctx.env.recovery_timeout
        while not os.path.exists(order.rejoin_file):  # the process is frozen and moved meanwhile
            if time.monotonic() > deadline:
                logger.error("rank %d: not moved within %.0f s", ctx.rank,
                             ctx.env.recovery_timeout)  # fmt: skip
                exit_now(1)
            time.sleep(0.01)
        with open(order.rejoin_file) as source:
            where = json.load(source)
        os.unlink(order.rejoin_file)
        # the restorer is still the parent for a moment; then the target node's agent (its
        # child subreaper) adopts this process, and this process must die with that agent
        while os.getppid() != int(where["agent_pid"]):
            if time.monotonic() > deadline:
                exit_now(1)
            time.sleep(0.002)
        die_with_parent()
        env = dataclasses.replace(ctx.env, agent_addr=where["agent_addr"],
                                  node_rank=int(where["node"]))  # fmt: skip
        ctx.connect(env)
        # the store's connection came back closed: a new one, from this node's address
        ctx.comms.reconnect(env)
        netns = os.stat("/proc/self/ns/net").st_ino
        ctx.send(protocol.Rejoined(generation=order.generation, netns=netns, t=time.time()))
        ctx.phase.move(WorkerPhase.PAUSED)
