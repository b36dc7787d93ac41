"""Real communicators (gloo on CPU, NCCL on GPU), one per group and generation."""

from __future__ import annotations

import hmac
from datetime import timedelta
from hashlib import sha256

import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


class CommunicatorError(RuntimeError):
    """A communicator could not be built; the message names the store it met through."""


def store_namespace(token: str) -> str:
    """The prefix of a job's keys in its c10d store. Anyone who reaches the store's port can
    read and write keys (c10d's store has no authentication), so the keys are derived from
    the job's token: without it they cannot be predicted, hence not overwritten to divert a
    communicator (a rank's state travels over them)."""
    return "xmig-" + hmac.new(token.encode(), b"xmig store keys", sha256).hexdigest()[:32]


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
    """The real communicator behind one proxy group, for one generation.

    ``where`` names the store for error messages (its address): a communicator that cannot be
    built because the store held something unexpected says which store that was."""

    def __init__(
        self,
        kind: str,
        group: str,
        generation: int,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        where: str = "the job's c10d store",
    ) -> None:
        self.kind = kind
        self.group = group
        self.generation = generation
        self.rank = rank
        self.size = size
        if kind not in BACKENDS:
            raise ValueError(f"unknown communication backend {kind!r} (expected one of {BACKENDS})")
        prefixed = dist.PrefixStore(store_prefix(group, generation), store)
        try:
            self.backend = build_backend(kind, prefixed, rank, size, timeout)
        except Exception as exc:  # gloo/NCCL read peers' addresses from the store
            raise CommunicatorError(
                f"building the {kind} communicator of group {group!r} (generation "
                f"{generation}, rank {rank} of {size}) through {where} failed: "
                f"{type(exc).__name__}: {str(exc).strip() or '?'} (the store holds every "
                "rank's address: something other than the job may have written to it)"
            ) from exc
