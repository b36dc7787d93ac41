"""The process group the framework talks to: logs, intercepts and replays collectives."""

from xmig.proxy.oplog import OpRecord, signature_digest, signature_of
from xmig.proxy.process_group import (
    FORWARDED_OPS,
    ProxyProcessGroup,
    ReplayCheck,
    ReplayDiverged,
    ReplayMismatch,
)

__all__ = [
    "FORWARDED_OPS",
    "OpRecord",
    "ProxyProcessGroup",
    "ReplayCheck",
    "ReplayDiverged",
    "ReplayMismatch",
    "signature_digest",
    "signature_of",
]
