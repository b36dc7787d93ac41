"""xmig: keep distributed PyTorch jobs running through GPU, driver, process and node faults."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from xmig.session import (
        Batches,
        RecoveryFailed,
        ReplayMismatch,
        Session,
        Shards,
        XmigError,
        init,
    )

__all__ = [
    "Batches",
    "RecoveryFailed",
    "ReplayMismatch",
    "Session",
    "Shards",
    "XmigError",
    "__version__",
    "init",
]

_FROM_SESSION = (
    "init",
    "Session",
    "XmigError",
    "RecoveryFailed",
    "ReplayMismatch",
    "Batches",
    "Shards",
)


def __getattr__(name: str):  # the launcher and agents must not pay for importing torch
    if name in _FROM_SESSION:
        from xmig import session

        return getattr(session, name)
    raise AttributeError(f"module 'xmig' has no attribute {name!r}")
