"""Real communicators (gloo on CPU, NCCL on GPU), one per group and generation."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def store_prefix(group: str, generation: int) -> str:
    """Keys of one group's communicator in one generation live under this prefix."""
    return f"xmig/ccl/{group}/g{generation}"


def build_backend(
    kind: str, store: dist.Store, rank: int, size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """Build one real communicator over ``store`` (already prefixed for its group)."""
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unknown communication backend {kind!r} (expected one of {BACKENDS})")


class Communicator:
    """The real communicator behind one proxy group, for one generation."""

    def __init__(
        self,
        kind: str,
        group: str,
        generation: int,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
    ) -> None:
        self.kind = kind
        self.group = group
        self.generation = generation
        self.rank = rank
        self.size = size
        self.backend = build_backend(
            kind, dist.PrefixStore(store_prefix(group, generation), store), rank, size, timeout
        )
