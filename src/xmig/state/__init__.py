"""What a rank's state is made of, and how it moves to a replacement."""

from xmig.state.fingerprint import params_checksum, params_sha256, tensors_sha256
from xmig.state.payload import DdpPayload, PayloadError, ReplacementPayload
from xmig.state.rng import reseed, step_seed
from xmig.state.transfer import TransferStats, pack, recv_state, send_state

__all__ = [
    "DdpPayload",
    "PayloadError",
    "ReplacementPayload",
    "TransferStats",
    "pack",
    "params_checksum",
    "params_sha256",
    "recv_state",
    "reseed",
    "send_state",
    "step_seed",
    "tensors_sha256",
]
