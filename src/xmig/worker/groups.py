"""Every process group of a worker: the world, and each one the script makes (``new_group``,
a ``DeviceMesh``), each a proxy of its own with its own op log, over a communicator named
after the group. A recovery rebuilds the groups that hold a replaced rank and keeps the rest."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch.distributed as dist

from xmig.proxy import OpSequence, ProxyProcessGroup

WORLD = "world"


@dataclass
class Group:
    """One of this rank's process groups: its xmig name, c10d's name, its members' global
    ranks (in group-rank order) and its proxy."""

    name: str
    c10d_name: str
    ranks: list[int]
    proxy: ProxyProcessGroup

    @property
    def label(self) -> str:
        """Its name and members, for the user: ``world``, ``pg2[1,3]``."""
        if self.name == WORLD:
            return WORLD
        return f"{self.name}[{','.join(map(str, self.ranks))}]"

    def holds_any(self, ranks: list[int]) -> bool:
        return any(r in self.ranks for r in ranks)


def unproxied_groups() -> list[str]:
    """c10d groups of this process that another backend than xmig's serves (``new_group(...,
    backend="gloo")``): their collectives do not go through xmig, so a fault in them is not
    recovered. Each as ``name (backend)``."""
    from torch.distributed import distributed_c10d as c10d

    found = []
    for group, entry in list(getattr(c10d._world, "pg_map", {}).items()):
        # c10d's private table: (backend, store) in every version seen (2.11-2.13)
        backend = entry[0] if isinstance(entry, tuple) and entry else entry
        name = str(backend).lower()
        if "xmig" not in name:
            found.append(f"{getattr(group, 'group_name', '?')} ({name})")
    return found


class Groups:
    """This rank's groups, in the order they were made; the world's is first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[Group] = []
        self.sequence = OpSequence()  # one order of issue across the groups

    @staticmethod
    def name_of(c10d_name: str, default: bool) -> str:
        """xmig's name for a group: ``world`` for the default group, else from c10d's own,
        which every member derives alike from the order groups are made in (a replacement,
        running the same script, makes them in the same order)."""
        return WORLD if default else f"pg{c10d_name}"

    def add(self, group: Group) -> None:
        with self._lock:
            if any(g.name == group.name for g in self._groups):
                raise ValueError(f"process group {group.name} made twice")
            self._groups.append(group)

    def all(self) -> list[Group]:
        with self._lock:
            return list(self._groups)

    def proxies(self) -> list[ProxyProcessGroup]:
        return [g.proxy for g in self.all()]

    def named(self, name: str) -> Group | None:
        return next((g for g in self.all() if g.name == name), None)

    def of(self, process_group: dist.ProcessGroup | None) -> Group | None:
        """The group behind a c10d process group (None: the default group's)."""
        if process_group is None:
            return self.named(WORLD)
        c10d_name = process_group.group_name
        return next((g for g in self.all() if g.c10d_name == c10d_name), None)

    def holding(self, ranks: list[int]) -> list[Group]:
        """The groups that hold any of ``ranks``: their communicators must be rebuilt."""
        return [g for g in self.all() if g.holds_any(ranks)]

    def kept(self, ranks: list[int]) -> list[Group]:
        return [g for g in self.all() if not g.holds_any(ranks)]
