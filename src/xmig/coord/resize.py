"""Pure decisions on changing the data-parallel world size: shrinking it when a lost node's
ranks have nowhere to run, growing it when a node joins, and a resize the job asked for.

Every plan numbers the ranks that stay 0..N-1 in their old order, and new ranks after them.
A rank's work then depends only on its new rank and the new world size (its share of each
step's samples, its random streams), never on which rank it was before: so a shrink forced by
the loss of any node ends bit-identical to a planned resize to the same size at the same step,
which drops the highest ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OnNoSpare(enum.Enum):
    """What a job does when a lost node's ranks have no node to run on."""

    SHRINK = "shrink"  # go on without them, at the smaller world size
    STOP = "stop"  # stop, the state saved through the just-in-time checkpoint


class ResizeCause(enum.Enum):
    PLANNED = "planned"  # asked for: ``xmig scale --world-size N`` or ``--inject resize:``
    NODE_LOST = "node lost"  # no spare node to take its ranks
    NODE_ADDED = "node added"  # ``xmig scale --add-node``, or a node that came back


@dataclass(frozen=True)
class ResizePlan:
    """A change of the world size at the start of ``step``.

    ``ranks``: each old rank that stays, to its new rank. ``added``: the new ranks, to the node
    each starts on. ``nodes``: every rank of the new world, to its node."""

    cause: ResizeCause
    step: int
    old_world: int
    new_world: int
    ranks: dict[int, int]
    added: dict[int, int]
    nodes: dict[int, int]

    @property
    def dropped(self) -> list[int]:
        """The old ranks that leave the world."""
        return sorted(set(range(self.old_world)) - set(self.ranks))

    def describe(self) -> str:
        """The recovery record's line: "shrunk from 3 to 2 at step 5 (node lost)"."""
        verb = "shrunk" if self.new_world < self.old_world else "grown"
        sizes = f"from {self.old_world} to {self.new_world}"
        return f"{verb} {sizes} at step {self.step} ({self.cause.value})"


@dataclass(frozen=True)
class Refusal:
    """Why the world cannot take that size; ``stop``: the job stops (its state saved)."""

    reason: str
    stop: bool


def _renumbered(nodes: dict[int, int], keep: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    ranks = {old: new for new, old in enumerate(sorted(keep))}
    return ranks, {ranks[old]: nodes[old] for old in keep}


def plan_shrink(nodes: dict[int, int], lost: set[int], step: int, min_world_size: int,
                policy: OnNoSpare) -> ResizePlan | Refusal:  # fmt: skip
    """The world without the ranks of the ``lost`` nodes, which have no spare to go to.
    ``nodes``: each rank of the world to its node."""
    gone = sorted(r for r, node in nodes.items() if node in lost)
    if not gone:
        raise ValueError(f"no rank is on the lost nodes {sorted(lost)}")
    keep = sorted(set(nodes) - set(gone))
    where = f"node {sorted(lost)[0]}" if len(lost) == 1 else f"nodes {sorted(lost)}"
    if policy is OnNoSpare.STOP:
        why = (f"{where} was lost and there is no spare node to take its ranks "
               "(--spare-nodes; --on-no-spare shrink goes on without them)")  # fmt: skip
        return Refusal(why, stop=True)
    if not keep:
        return Refusal(f"{where} was lost with every rank of the job", stop=True)
    if len(keep) < min_world_size:
        return Refusal(f"{where} was lost: {len(keep)} rank(s) would be left, below "
                       f"--min-world-size {min_world_size}", stop=True)  # fmt: skip
    ranks, new_nodes = _renumbered(nodes, keep)
    return ResizePlan(ResizeCause.NODE_LOST, step, len(nodes), len(keep), ranks, {}, new_nodes)


def free_slots(nodes: dict[int, int], live: list[int], nproc_per_node: int) -> dict[int, int]:
    """Each live node's room for more ranks (``nproc_per_node`` a node, less those it runs),
    in node order."""
    used: dict[int, int] = {}
    for node in nodes.values():
        used[node] = used.get(node, 0) + 1
    return {n: nproc_per_node - used.get(n, 0) for n in sorted(live)
            if used.get(n, 0) < nproc_per_node}  # fmt: skip


def plan_planned(nodes: dict[int, int], world_size: int, step: int, min_world_size: int,
                 free: dict[int, int]) -> ResizePlan | Refusal:  # fmt: skip
    """A resize the job asked for: to a smaller world the highest ranks leave; to a larger one
    new ranks start where ``free`` (node -> room for more ranks, ``free_slots``) has room,
    the nodes that run ranks already first, then in node order."""
    old = len(nodes)
    if world_size < 1:
        return Refusal(f"a world size of {world_size} is not possible", stop=False)
    if world_size == old:
        return Refusal(f"the world size is already {old}", stop=False)
    if world_size < min_world_size:
        return Refusal(f"world size {world_size} is below --min-world-size {min_world_size}",
                       stop=False)  # fmt: skip
    if world_size < old:
        ranks, new_nodes = _renumbered(nodes, list(range(world_size)))
        return ResizePlan(ResizeCause.PLANNED, step, old, world_size, ranks, {}, new_nodes)
    busy = set(nodes.values())
    order = sorted(free, key=lambda n: (n not in busy, n))
    return _grown(nodes, world_size - old, step, {n: free[n] for n in order},
                  ResizeCause.PLANNED)  # fmt: skip


def plan_grow(nodes: dict[int, int], node: int, step: int, idle: list[int],
              nproc_per_node: int, max_world_size: int) -> ResizePlan | Refusal:  # fmt: skip
    """``node`` joins the world with ``nproc_per_node`` new ranks, up to ``max_world_size``
    (the size the job is to have: more would change what it was asked to train)."""
    room = max_world_size - len(nodes)
    if room <= 0:
        return Refusal(f"the world has its {max_world_size} ranks: node {node} stays a spare",
                       stop=False)  # fmt: skip
    if node not in idle:
        return Refusal(f"node {node} is not an idle node of the job", stop=False)
    return _grown(nodes, min(room, nproc_per_node), step, {node: nproc_per_node},
                  ResizeCause.NODE_ADDED)  # fmt: skip


def _grown(nodes: dict[int, int], more: int, step: int, free: dict[int, int],
           cause: ResizeCause) -> ResizePlan | Refusal:  # fmt: skip
    """``more`` new ranks numbered after the world's, placed into ``free`` in its order."""
    if more > sum(free.values()):
        return Refusal(f"{more} more rank(s) need room on live nodes; the job has room for "
                       f"{sum(free.values())} (an idle node, or one running fewer ranks than "
                       "--nproc-per-node)", stop=False)  # fmt: skip
    old = len(nodes)
    if sorted(nodes) != list(range(old)):
        raise ValueError(f"the world's ranks are not 0..{old - 1}: {sorted(nodes)}")
    ranks = {r: r for r in range(old)}  # a world that was shrunk is numbered 0..old-1 already
    places = [n for n, room in free.items() for _ in range(room)]
    added = {old + i: places[i] for i in range(more)}
    return ResizePlan(cause, step, old, old + more, ranks, added, {**nodes, **added})
