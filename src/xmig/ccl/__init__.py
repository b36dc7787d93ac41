"""Flexible collective communication: builds the real communicators behind the proxy.

Each proxy group is served by one Communicator per generation, keyed in the job's store by
group name and generation, so a later generation can rebuild only the groups that changed.
"""

from xmig.ccl.communicator import (
    BACKENDS,
    Communicator,
    CommunicatorError,
    build_backend,
    store_namespace,
    store_prefix,
)

__all__ = [
    "BACKENDS",
    "Communicator",
    "CommunicatorError",
    "build_backend",
    "store_namespace",
    "store_prefix",
]
