"""A change of the world size, as a worker lives it: paused at a step boundary (no collective
in flight), a rank that leaves ends; a rank that stays takes its new rank, makes the default
process group again at the new size (c10d keeps a group's rank and size in the group itself,
and DDP's reducer divides by the size it read when it was made), builds its DDP's reducer
over it with the bucket layout it had, and moves its data streams to its new share. When the
world grows, the new ranks (started meanwhile, ``worker/replacement.py``) make the new world
with them, and each is served the state of the pause step's start by one of them."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from xmig import protocol
from xmig.proxy import ProxyProcessGroup
from xmig.state import ReplacementPayload
from xmig.state import ddp as ddp_state
from xmig.worker import pull
from xmig.worker.backend import GroupFactory, init_process_group
from xmig.worker.context import WorkerContext
from xmig.worker.data import Batches
from xmig.worker.errors import RecoveryFailed, exit_now
from xmig.worker.groups import WORLD, Groups
from xmig.worker.layout import DdpLayout
from xmig.worker.shards import Shards
from xmig.worker.verify import Verifier

logger = logging.getLogger(__name__)

# the old worlds' groups, kept: gloo's destructor waits for (or crashes on) an op abandoned
# in its communicator, and nothing may wait for that
_RETIRED: list[ProxyProcessGroup] = []


class Resizer:
    def __init__(self, ctx: WorkerContext, layout: DdpLayout, verifier: Verifier,
                 make_group: GroupFactory,
                 on_world: Callable[[ProxyProcessGroup], None]) -> None:  # fmt: skip
        self._ctx = ctx
        self._layout = layout
        self._verifier = verifier
        self._make_group = make_group
        self._on_world = on_world  # the Session hears of its new default group

    def why_not(self) -> str | None:
        """Why this rank's world cannot change size now (None: it can)."""
        ctx = self._ctx
        others = [g.label for g in ctx.groups.all() if g.name != WORLD]
        if others:
            return (f"the script made process groups of its own ({', '.join(others)}): only "
                    "a world whose DDP trains over the default group can change size")  # fmt: skip
        for name, stream in ctx.registry.streams.items():
            if isinstance(stream, Shards) and stream.pre_loop:
                return (f"the data stream {name!r} was drawn before the step loop: the script "
                        "draws ahead of its steps, and a batch drawn ahead at the old size "
                        "would be trained at the new one (draw each step's batch in its "
                        "step)")  # fmt: skip
            if isinstance(stream, Batches):
                return (
                    f"the data stream {name!r} is drawn through session.batches(), whose "
                    "position is each rank's own: the samples of a rank that leaves could "
                    "not be given to the others (session.shards() splits a global stream)"
                )
        ddp = ctx.registry.ddp
        if ddp is not None and ddp.process_group is not c10d._get_default_group():
            return "the registered DDP does not train over the default process group"
        if ctx.registry.model() is not None and ctx.replicas() is not None:
            return "the model's parameters are sharded (FSDP2 or tensor parallel)"
        return None

    def apply(self, order: protocol.Resize) -> None:
        """Carry out ``order`` (every rank is paused at ``order.step``): leave, or go on in
        the new world. Ends with ``Resumed`` from a rank that stays."""
        ctx = self._ctx
        started = time.monotonic()
        if not 0 <= ctx.rank < len(order.ranks):
            raise RecoveryFailed(f"the resize has no place for rank {ctx.rank}")
        new_rank = order.ranks[ctx.rank]
        if new_rank < 0:
            self._leave(order)
        old_rank, old_world = ctx.rank, ctx.world_size
        self._renumber(new_rank, order)
        proxy = self._new_world(order.generation)
        self._rebuild_ddp()
        for stream in ctx.registry.streams.values():
            stream.resize(order.world_size, new_rank)  # type: ignore[union-attr]
        ctx.keep_replicas()
        took = time.monotonic() - started
        logger.info("rank %d is rank %d of %d from step %d (was of %d): rebuilt in %.3f s",
                    old_rank, new_rank, order.world_size, order.step, old_world,
                    took)  # fmt: skip
        targets = order.served_by(new_rank)
        if targets:  # the state as of now: the pause step's start, at the new size
            report = pull.serve(ctx, order.generation, targets,
                                lambda _target: self._joining_payload(order.step))  # fmt: skip
            logger.info("rank %d served ranks %s the state of step %d: %.2f MB in %.3f s",
                        new_rank, targets, order.step, report["bytes"] / 1e6,
                        report["seconds"])  # fmt: skip
        if order.world_size > old_world:  # the new ranks' parameters are checked against ours
            self._verifier.expect(order.generation, order.step)
        self._on_world(proxy)
        ctx.send(protocol.Resumed(generation=order.generation, t=time.time()))

    def _joining_payload(self, step: int) -> ReplacementPayload:
        """What a rank the world grows by starts from: the state of ``step``'s start."""
        ctx = self._ctx
        return ReplacementPayload(step=step, mode="join", first_step=ctx.first_step,
                                  state=ctx.recovery_state(),
                                  ddp=self._layout.outgoing(step, False))  # fmt: skip

    def _leave(self, order: protocol.Resize) -> None:
        """This rank is not in the new world: it ends, nothing lost (its peers hold the same
        state, and its share of the samples goes to them from this step on)."""
        ctx = self._ctx
        logger.info("rank %d leaves the world at step %d (%d ranks from now on)", ctx.rank,
                    order.step, order.world_size)  # fmt: skip
        if ctx.link is not None:
            ctx.link.close()
            ctx.link = None
        exit_now(0)

    def _renumber(self, new_rank: int, order: protocol.Resize) -> None:
        ctx = self._ctx
        ctx.env = dataclasses.replace(ctx.env, rank=new_rank, world_size=order.world_size,
                                      generation=order.generation)  # fmt: skip
        ctx.comms.env = dataclasses.replace(ctx.comms.env, rank=new_rank,
                                            world_size=order.world_size)  # fmt: skip
        ctx.rank, ctx.world_size = new_rank, order.world_size
        ctx.orders.rank = new_rank

    def _new_world(self, generation: int) -> ProxyProcessGroup:
        """The default group made again over a communicator of the new size (its own
        generation); c10d's table of groups starts over."""
        ctx = self._ctx
        _RETIRED.extend(ctx.groups.proxies())
        dist.destroy_process_group()
        ctx.groups = Groups()
        ctx.proxy = init_process_group(ctx.comms, self._make_group)
        assert ctx.proxy.generation == generation
        return ctx.proxy

    def _rebuild_ddp(self) -> None:
        """DDP's reducer made again over the new default group, as DDP itself does when it
        is unpickled, then given the bucket layout it had (every rank has the same): served
        locally, so no rank broadcasts it again."""
        ctx = self._ctx
        ddp = ctx.registry.ddp
        if ddp is None:
            return
        ddp.process_group = c10d._get_default_group()
        parameters, expect_sparse = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(parameters)
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
        if ddp.static_graph:
            ddp.reducer._set_static_graph()
            ddp.logger._set_static_graph()
        layout = self._layout.layout
        if layout is not None and ddp_state.rebuilds(ddp):
            proxy = ctx.proxy
            proxy.serve_broadcasts(layout)
            with proxy.locally():
                if not ddp_state.rebuild_now(ddp):
                    raise RecoveryFailed("DDP refused its own bucket layout at the new size")
