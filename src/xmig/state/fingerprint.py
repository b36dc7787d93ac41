"""Fingerprints of a model's parameters: a bit-exact SHA-256 (the run's result) and a cheap
checksum computed where the parameters live (ranks comparing their replicas)."""

from __future__ import annotations

import hashlib

import torch

# the integer type of each element size, to read a parameter's bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per pass: bounds the temporaries on a GPU
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads positions over 64 bits


def local_part(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard (FSDP2, tensor parallel), else
    the parameter itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes (this rank's part of it),
    in registration order."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = local_part(param.detach()).to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensors_sha256(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the dtype, shape and bytes of each tensor, in order (copied to the host)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{host.dtype}|{tuple(host.shape)}|".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def params_checksum(model: torch.nn.Module) -> str:
    """A checksum of every parameter's bits for replicas to compare, computed where the
    parameter lives: SHA-256 of the bytes on the host; on a GPU (no copy to the host) two
    sums per tensor, one weighted by position, so that a changed, swapped or moved element
    changes it. Not a defence against an adversary on the GPU: the state a replacement
    pulls is checked with SHA-256."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            part = local_part(param.detach())
            flat = part.reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(part.shape)}|".encode())
            if flat.device.type == "cpu":
                digest.update(flat.contiguous().view(torch.uint8).numpy())
                continue
            bits = flat.view(_BITS[flat.element_size()]) if flat.numel() else flat
            plain = weighted = 0
            for start in range(0, bits.numel(), _CHUNK):
                part = bits[start : start + _CHUNK].to(torch.int64)
                positions = torch.arange(start, start + part.numel(), device=part.device)
                plain += int(part.sum())
                weighted += int((part * (positions * _GOLDEN + 1)).sum())
            digest.update(f"{plain}|{weighted}|".encode())
    return digest.hexdigest()[:32]
