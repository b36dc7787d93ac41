"""A bit-exact fingerprint of a model's parameters."""

from __future__ import annotations

import hashlib

import torch


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, in registration order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = param.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
