"""Random state that is a function of (seed, rank, step), so any step can be recomputed."""

from __future__ import annotations

import hashlib
import random
import sys

import torch


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed derived from the job seed, the rank and the step."""
    digest = hashlib.sha256(f"xmig:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int, rank: int, step: int) -> None:
    """Reseed Python's, torch's (CPU and CUDA) and, if loaded, NumPy's generators."""
    value = step_seed(seed, rank, step)
    random.seed(value)
    torch.manual_seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (2**32))
