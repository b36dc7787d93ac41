"""The objects a script hands xmig (``session.register``): the state a replacement pulls."""

from __future__ import annotations

import copy
from typing import Any

import torch

from xmig.state import ddp as ddp_state
from xmig.state import dtensors
from xmig.worker.data import Batches
from xmig.worker.errors import RecoveryFailed, XmigError
from xmig.worker.shards import Shards


class Registry:
    """Registered objects by name: ``model`` (a module, DDP or bare), ``optimizer``, and any
    other object with ``state_dict``/``load_state_dict``; and the script's data streams
    (``session.batches``), whose position at a step boundary is part of the state."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.streams: dict[str, Batches | Shards] = {}
        self.ddp: Any = None  # the DDP that trains the registered model, once the loop starts
        self._snapshots: dict[str, Any] = {}
        # the optimizer's hyperparameters as the step began: a scheduler stepped in a step
        # that is rolled back has already written its next learning rate into them (a
        # chainable one, StepLR, multiplies it), which restoring the scheduler does not undo
        self._hyperparameters: list[dict[str, Any]] = []
        # a sharded model's state as the step began (references, not copies): inside a step
        # FSDP2 swaps in unsharded parameters, whose memory it frees between uses
        self._model_state: dict[str, Any] | None = None
        self._has_dtensors: tuple[Any, bool] | None = None  # (the model, whether it has any)

    def register(self, **objects: Any) -> None:
        for name, obj in objects.items():
            if name in self.streams:
                raise XmigError(f"{name!r} already names a data stream (session.batches)")
            if name == "model" and not isinstance(obj, torch.nn.Module):
                raise XmigError(f"model= must be a torch.nn.Module, got {type(obj).__name__}")
            if name != "model" and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
            ):
                hint = ""
                if hasattr(obj, "__iter__") or hasattr(obj, "__next__"):
                    hint = f" (for data, draw it through session.batches({name}) instead)"
                raise XmigError(f"{name}= needs state_dict() and load_state_dict(){hint}")
            self.objects[name] = obj

    def add_stream(self, stream: Batches | Shards) -> None:
        if stream.name in self.objects or stream.name in self.streams:
            raise XmigError(
                f"{stream.name!r} is already registered: give the data stream another "
                "name (session.batches(..., name=...))"
            )
        self.streams[stream.name] = stream

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
        # sharded parts travel as this rank's shards (a replica holds the same ones)
        state = {
            name: dtensors.local_shards(self._model_state if name == "model" and
                                        self._model_state is not None else obj.state_dict())
            for name, obj in self.objects.items()
        }  # fmt: skip
        state.update({name: stream.state_dict() for name, stream in self.streams.items()})
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Load the registered objects' state (the data streams: ``resume_streams``)."""
        for name, obj in self.objects.items():
            if name not in state:
                raise RecoveryFailed(f"the peer's state has no {name!r}")
            obj.load_state_dict(dtensors.as_template(state[name], obj.state_dict()))
            dtensors.optimizer_state_as_params(obj)

    def resume_streams(self, state: dict[str, Any], step: int, *, fresh: bool) -> None:
        """Put every data stream where the one in ``state`` was at the start of ``step``
        (``fresh``: in a replacement, whose script has yet to draw what it draws before its
        loop)."""
        for name, stream in self.streams.items():
            if not isinstance(state.get(name), dict):
                raise RecoveryFailed(f"the peer's state has no data stream {name!r}")
            stream.resume(state[name], step, fresh=fresh)

    def at_boundary(self, step: int) -> None:
        """A step starts: its data streams' positions are recorded, and the state of what is
        neither model nor optimizer (a scheduler) copied, for a step rolled back and redone
        by this rank to start from again."""
        for stream in self.streams.values():
            stream.at_boundary(step)
        for name, obj in self.objects.items():
            if name not in ("model", "optimizer"):
                self._snapshots[name] = copy.deepcopy(obj.state_dict())
        optimizer = self.optimizer()
        if optimizer is not None and hasattr(optimizer, "param_groups"):
            self._hyperparameters = [_hyperparameters(group) for group in optimizer.param_groups]
        model = self.objects.get("model")
        if model is not None and self._sharded(model):
            self._model_state = model.state_dict()

    def _sharded(self, model: Any) -> bool:
        """``has_dtensors(model)``, looked up once per model (not at every boundary)."""
        known = self._has_dtensors
        if known is None or known[0] is not model:
            known = self._has_dtensors = (model, dtensors.has_dtensors(model))
        return known[1]

    def restore_others(self, step: int) -> None:
        """Back to the start of ``step``, the one this rank redoes."""
        for name, saved in self._snapshots.items():
            self.objects[name].load_state_dict(saved)
        optimizer = self.optimizer()
        if optimizer is not None and len(self._hyperparameters) == len(
            getattr(optimizer, "param_groups", ())
        ):
            for group, saved in zip(optimizer.param_groups, self._hyperparameters, strict=True):
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and isinstance(group.get(key), torch.Tensor):
                        group[key].copy_(value)  # a tensor lr stays the same tensor
                    else:
                        group[key] = value
        for stream in self.streams.values():
            stream.rewind(step)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer's parameter group without its parameters."""
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.copy(value)
            for key, value in group.items() if key != "params"}  # fmt: skip
