"""What a rank's state is made of, and how it moves to a replacement or to disk.

The names below load on first use: the launcher reads checkpoint manifests
(``xmig.state.checkpoint``) without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "params_checksum": "fingerprint",
    "params_sha256": "fingerprint",
    "tensors_sha256": "fingerprint",
    "DdpPayload": "payload",
    "PayloadError": "payload",
    "ReplacementPayload": "payload",
    "reseed": "rng",
    "step_seed": "rng",
    "TransferStats": "transfer",
    "pack": "transfer",
    "recv_state": "transfer",
    "send_state": "transfer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
