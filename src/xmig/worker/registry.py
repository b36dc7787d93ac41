"""The objects a script hands xmig (``session.register``): the state a replacement pulls."""

from __future__ import annotations

import copy
from typing import Any

import torch

from xmig.state import ddp as ddp_state
from xmig.worker.errors import RecoveryFailed, XmigError


class Registry:
    """Registered objects by name: ``model`` (a module, DDP or bare), ``optimizer``, and any
    other object with ``state_dict``/``load_state_dict``."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.ddp: Any = None  # the DDP that trains the registered model, once the loop starts
        self._snapshots: dict[str, Any] = {}

    def register(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if name == "model" and not isinstance(obj, torch.nn.Module):
                raise XmigError(f"model= must be a torch.nn.Module, got {type(obj).__name__}")
            if name != "model" and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            ):
                raise XmigError(f"{name}= needs state_dict() and load_state_dict()")
            self.objects[name] = obj

    def model(self) -> torch.nn.Module | None:
        """The user's module (hashed and hooked), not a DDP wrapper around it."""
        model = self.objects.get("model")
        return getattr(model, "module", model) if model is not None else None

    def optimizer(self) -> Any:
        return self.objects.get("optimizer")

    def find_ddp(self) -> None:
        """Find the DDP that trains the registered model (it may have been handed over bare:
        its DDP's bucket layout is part of the state all the same)."""
        model = self.objects.get("model")
        self.ddp = ddp_state.find_ddp(model)
        if self.ddp is None and model is not None and ddp_state.live_ddps():
            raise XmigError(
                "session.register(model=...) got a module that no DistributedDataParallel "
                "wraps, but this process trains with one: register that DDP "
                "(session.register(model=ddp, ...))"
            )

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.objects.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        for name, obj in self.objects.items():
            if name not in state:
                raise RecoveryFailed(f"the peer's state has no {name!r}")
            obj.load_state_dict(state[name])

    def snapshot_others(self) -> None:
        """Copy the state of what is neither model nor optimizer (a scheduler, a sampler) at
        a step's start: a step rolled back and redone by this rank starts from it again."""
        for name, obj in self.objects.items():
            if name not in ("model", "optimizer"):
                self._snapshots[name] = copy.deepcopy(obj.state_dict())

    def restore_others(self) -> None:
        for name, saved in self._snapshots.items():
            self.objects[name].load_state_dict(saved)
