"""A sharded state (FSDP2, HSDP, tensor parallel: DTensor parameters and optimizer state) on
the wire as its local shards, and back into DTensors on the receiving rank, shaped like its
own: a replica holds the same shards, only its mesh objects are its own."""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and callable(getattr(value, "to_local", None)) \
        and hasattr(value, "device_mesh")  # fmt: skip


def has_dtensors(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def local_shards(value: Any) -> Any:
    """The same structure with every DTensor replaced by its local shard."""
    if is_dtensor(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local_shards(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local_shards(v) for v in value]
    if isinstance(value, tuple):
        return tuple(local_shards(v) for v in value)
    return value


def like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``template`` is (its mesh, placements and shape)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, template.device_mesh, template.placements,
                              run_check=False, shape=template.shape,
                              stride=template.stride())  # fmt: skip


def as_template(value: Any, template: Any) -> Any:
    """``value`` (local shards) with a DTensor wherever ``template`` has one."""
    if is_dtensor(template) and isinstance(value, torch.Tensor) and not is_dtensor(value):
        return like(value, template)
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: as_template(v, template.get(k)) for k, v in value.items()}
    if isinstance(value, list) and isinstance(template, list) and len(value) == len(template):
        return [as_template(v, t) for v, t in zip(value, template, strict=True)]
    return value


def optimizer_state_as_params(optimizer: Any) -> None:
    """After an optimizer loaded local shards: each state tensor shaped like its DTensor
    parameter's shard becomes a DTensor like that parameter (an optimizer that never stepped
    has no state to shape them by beforehand)."""
    for group in getattr(optimizer, "param_groups", []):
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state or not is_dtensor(param):
                continue
            shard = param.to_local()
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and not is_dtensor(value) \
                        and value.shape == shard.shape:  # fmt: skip
                    state[key] = like(value, param)
