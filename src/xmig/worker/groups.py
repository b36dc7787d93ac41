"""Every process group of a worker: the world, and each one the script makes (``new_group``,
``split_group``, a ``DeviceMesh``), each a proxy of its own with its own op log, over a
communicator named after the group. A recovery rebuilds the groups that hold a replaced rank
and keeps the rest."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

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
    found = []
    for group in list(getattr(c10d._world, "pg_map", {})):
        name = _backend_of(group)
        if "xmig" not in name:
            found.append(f"{getattr(group, 'group_name', '?')} ({name})")
    return found


def _backend_of(group: dist.ProcessGroup) -> str:
    """The backend c10d made ``group`` with, lower case."""
    # c10d's private table: (backend, store) in every version seen (2.11-2.13)
    entry = c10d._world.pg_map.get(group)
    backend = entry[0] if isinstance(entry, tuple) and entry else entry
    return str(backend).lower()


class Groups:
    """This rank's groups, in the order they were made; the world's is first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[Group] = []
        self._made_locally: Counter[tuple[int, ...]] = Counter()
        self.sequence = OpSequence()  # one order of issue across the groups

    def name_for(self, c10d_name: str, ranks: list[int] | None) -> str:
        """xmig's name for a group its members agree on (``ranks`` None: the default group,
        ``world``). c10d numbers the groups every rank makes (``new_group``, a mesh) in the
        order they are made, so ``pg<number>``. A group made by its members alone
        (``split_group``, ``new_group(use_local_synchronization=True)``) has a hashed c10d
        name that also counts every group this process holds, which its members need not
        agree on; it is named after its members and how many groups of exactly those
        members this process made before, which they do agree on (a replacement, running
        the same script, makes them in the same order)."""
        if ranks is None:
            return WORLD
        if c10d_name.isdigit():
            return f"pg{c10d_name}"
        with self._lock:
            key = tuple(ranks)
            earlier = self._made_locally[key]
            self._made_locally[key] += 1
        digest = hashlib.sha1(f"{list(key)}#{earlier}".encode()).hexdigest()[:12]
        return f"pgm{digest}"

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


# torch's own split_group, for parents that are not xmig's
_torch_split_group = c10d.split_group


def split_group(
    parent_pg: dist.ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: timedelta | None = None,
    pg_options: Any | None = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> dist.ProcessGroup | None:
    """``torch.distributed.split_group`` for a parent that xmig serves: this rank's split
    (parent group ranks, as torch takes them) becomes a group made with local
    synchronization, so it is proxied like any other and only its members take part. torch's
    own needs a backend that splits communicators (NCCL) and a device bound to the default
    group; xmig's groups are built anew from the store, so a split is a new group of the same
    members. Returns None on a rank in no split, as torch does."""
    parent = parent_pg if parent_pg is not None else c10d._get_default_group()
    if not _is_xmig(parent):
        return _torch_split_group(parent_pg, split_ranks, timeout, pg_options, group_desc,
                                  backend)  # fmt: skip
    if backend is not None and "xmig" not in str(backend).lower():
        raise ValueError(
            f"split_group(backend={backend!r}): a split of an xmig group is an xmig group"
        )
    members = dist.get_process_group_ranks(parent)  # group rank -> global rank
    mine = _my_split(split_ranks, len(members), dist.get_rank(parent))
    if mine is None:
        return None
    return dist.new_group([members[r] for r in mine], timeout=timeout, pg_options=pg_options,
                          use_local_synchronization=True, group_desc=group_desc)  # fmt: skip


def _my_split(splits: list[list[int]] | None, size: int, me: int) -> list[int] | None:
    """The split that holds group rank ``me``, sorted, after checking ``splits`` as torch
    documents them: disjoint, non-empty lists of ranks of a parent of ``size``."""
    if not splits:
        raise ValueError("split_ranks cannot be None or empty")
    seen: set[int] = set()
    for split in splits:
        if len(split) == 0:
            raise ValueError("the split group cannot be empty")
        if len(split) != len(set(split)):
            raise ValueError(f"the split group {list(split)} has duplicate ranks")
        outside = [r for r in split if not 0 <= r < size]
        if outside:
            raise ValueError(f"split_ranks {list(split)}: ranks {outside} are not in the parent "
                             f"group of {size}")  # fmt: skip
        if seen & set(split):
            raise ValueError(f"split_ranks overlap: {sorted(seen & set(split))} in two splits")
        seen |= set(split)
    return next((sorted(split) for split in splits if me in split), None)


def _is_xmig(group: dist.ProcessGroup) -> bool:
    return "xmig" in _backend_of(group)


def install_split_group() -> None:
    """Route ``dist.split_group`` through :func:`split_group` (a parent of another backend
    still gets torch's)."""
    dist.split_group = split_group
    c10d.split_group = split_group
