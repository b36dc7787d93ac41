"""The process group the framework talks to: logs, intercepts and replays collectives."""

from xmig.proxy.oplog import OpRecord, signature_digest, signature_of
from xmig.proxy.process_group import (
    FORWARDED_OPS,
    OpSequence,
    ProxyProcessGroup,
    ReplayCheck,
    ReplayDiverged,
    ReplayMismatch,
    replay_groups,
    wait_for_aborts,
    wait_let_go,
)

__all__ = [
    "FORWARDED_OPS",
    "OpRecord",
    "OpSequence",
    "ProxyProcessGroup",
    "ReplayCheck",
    "ReplayDiverged",
    "ReplayMismatch",
    "signature_digest",
    "replay_groups",
    "signature_of",
    "wait_for_aborts",
    "wait_let_go",
]
