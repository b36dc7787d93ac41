"""Random state that is a function of (seed, rank, step), so any step can be recomputed."""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
from collections.abc import Iterator

import torch


def step_seed(seed: int, rank: int, step: int) -> int:
    """A 63-bit seed derived from the job seed, the rank and the step."""
    digest = hashlib.sha256(f"xmig:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int, rank: int, step: int) -> None:
    """Reseed Python's, torch's (CPU and CUDA) and, if loaded, NumPy's generators."""
    value = step_seed(seed, rank, step)
    random.seed(value)
    _seed_torch(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value % (2**32))


def _seed_torch(value: int) -> None:
    """``torch.manual_seed(value)``, without its cost at every step boundary: it also looks
    for every other kind of device and, before CUDA is initialized, formats a stack trace
    for a lazy call (most of a boundary's time on CPU)."""
    if torch.cuda.is_initialized():
        torch.default_generator.manual_seed(value)
        for generator in torch.cuda.default_generators:
            generator.manual_seed(value)
    elif torch.cuda.is_available():
        torch.manual_seed(value)  # seeds CUDA's generators when it is initialized
    else:
        torch.default_generator.manual_seed(value)


def derived_seed(seed: int, rank: int, *parts: object) -> int:
    """A 63-bit seed for something other than a step (a data stream's epoch or position)."""
    text = ":".join(str(p) for p in ("xmig", seed, rank, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def controlled(value: int) -> Iterator[None]:
    """Run the body with Python's, torch's (CPU, and the current CUDA device once CUDA is in
    use) and NumPy's generators seeded from ``value``; put their states back afterwards, so
    that what the body draws is a function of ``value`` and the code around it sees no
    draw at all."""
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cpu_state = torch.get_rng_state()
    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    cuda_state = torch.cuda.get_rng_state(cuda) if cuda is not None else None
    try:
        random.seed(value)
        torch.default_generator.manual_seed(value)
        if cuda is not None:
            torch.cuda.manual_seed(value)  # the current device only
        if numpy is not None:
            numpy.random.seed(value % (2**32))
        yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        torch.set_rng_state(cpu_state)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda_state, cuda)
