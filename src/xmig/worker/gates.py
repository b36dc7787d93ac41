"""What the GPU gate (``xmig.proxy.gate``) asks of the worker: the CPU may run ahead of a
collective that a fault can still break, as far as the step's end.

- The step boundary waits until every gate of the step is open: no op of a step ends, or
  fails, once the next step began.
- An optimizer update issued while a gate is shut is queued on the GPU behind it: it counts
  as not taken until the gate opens, and what the update changed on the host (AdamW's step
  counts, a scheduler stepped after it) is read from a snapshot taken as it began.
- A recovery runs on a stream of its own (the framework's may be held by a shut gate) and
  first waits for the framework's work up to the first shut gate, or for all of it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from xmig.proxy.gate import side_stream

if TYPE_CHECKING:
    from xmig.worker.context import WorkerContext

RECOVERY_STREAM = "recovery"


@dataclass
class QueuedUpdate:
    """An optimizer update issued behind shut gates: the numbers that open them, and what
    the update and the code after it change on the host, as they were when it began
    (``host_side``). What is on the GPU needs no copy: the update has not run there while a
    gate is shut."""

    gates: list[tuple[Any, int]]
    host: dict[str, Any]

    def pending(self) -> bool:
        """Whether the update still waits behind a gate (and so has not happened). Asked in
        a recovery, once its halt has closed the gates: an open gate lets the update through
        on the GPU before the host has seen the collective end, and the halt releases what
        the GPU had let through."""
        return any(gate.released < number for gate, number in self.gates)

    def state(self, current: dict[str, Any]) -> dict[str, Any]:
        """``current`` (the registered state read now) as it was when the update began."""
        state = dict(current)
        for name, taken in self.host.items():
            if name not in state:
                continue
            if isinstance(taken, OptimizerHost):
                state[name] = taken.over(state[name])
            else:
                state[name] = taken
        return state


@dataclass
class OptimizerHost:
    """An optimizer's host-side state: its per-parameter host tensors (AdamW's step counts,
    by the index ``state_dict`` gives each parameter) and its groups' settings."""

    tensors: dict[int, dict[str, torch.Tensor]]
    groups: list[dict[str, Any]]

    @classmethod
    def of(cls, optimizer: Any) -> OptimizerHost:
        tensors: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        index = 0
        for group in optimizer.param_groups:
            groups.append(copy.deepcopy({k: v for k, v in group.items() if k != "params"}))
            for param in group["params"]:
                entries = optimizer.state.get(param)
                if entries:
                    host = {k: v.detach().clone() for k, v in entries.items()
                            if isinstance(v, torch.Tensor) and v.device.type == "cpu"}  # fmt: skip
                    if host:
                        tensors[index] = host
                index += 1
        return cls(tensors, groups)

    def over(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer's ``state_dict`` with these host values in."""
        per_param = {i: dict(entries) for i, entries in state.get("state", {}).items()}
        for index, host in self.tensors.items():
            if index in per_param:
                per_param[index].update(host)
        groups = [{**taken, "params": group["params"]}
                  for taken, group in zip(self.groups, state.get("param_groups", []),
                                          strict=False)]  # fmt: skip
        return {**state, "state": per_param, "param_groups": groups}


def host_side(registry: Any) -> dict[str, Any]:
    """What an optimizer's update, and what a script does after it in the same step (a
    scheduler stepped, a data stream drawn), changes on the host, as it is now: the model
    has none; the optimizer its host tensors and settings; the rest (schedulers, data
    streams: small) their state with host tensors copied."""
    taken: dict[str, Any] = {}
    for name, obj in registry.objects.items():
        if name == "model":
            continue
        if isinstance(obj, torch.optim.Optimizer):
            taken[name] = OptimizerHost.of(obj)
        else:
            taken[name] = snapshot(obj.state_dict())
    for name, stream in registry.streams.items():
        taken[name] = snapshot(stream.state_dict())
    return taken


def queue_update(ctx: WorkerContext) -> QueuedUpdate | None:
    """At the optimizer's start: the update it is about to queue, if a gate is shut."""
    gates = [(gate, gate.issued) for proxy in ctx.groups.proxies()
             for gate in proxy.shut_gates()]  # fmt: skip
    if not gates:
        return None
    return QueuedUpdate(gates, host_side(ctx.registry))


def snapshot(value: Any) -> Any:
    """``value`` with host tensors copied, GPU tensors kept by reference, the rest copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.device.type == "cpu" else value
    if isinstance(value, dict):
        return type(value)((k, snapshot(v)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(snapshot(v) for v in value)
    return copy.deepcopy(value)


def clone_state(value: Any) -> Any:
    """``value`` with every tensor copied (on the current stream)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, clone_state(v)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(clone_state(v) for v in value)
    return copy.deepcopy(value)


@contextlib.contextmanager
def recovery_stream(ctx: WorkerContext) -> Iterator[None]:
    """A recovery's GPU work goes on a stream of its own."""
    if ctx.device.type != "cuda":
        yield
        return
    with torch.cuda.stream(side_stream(ctx.device, RECOVERY_STREAM)):
        yield


def after_framework(ctx: WorkerContext) -> None:
    """Ops complete on the host from now on (until ``resume_gating``), and the current stream
    waits for the framework's work up to the first shut gate (what lies behind it has not
    run and will not, until the recovery opens it), or for all of it when none is shut."""
    proxies = ctx.groups.proxies()
    for proxy in proxies:
        proxy.suspend_gating()
    if ctx.device.type != "cuda":
        return
    shut = [r for r in (p.first_closed() for p in proxies) if r is not None]
    current = torch.cuda.current_stream(ctx.device)
    if shut:
        first = min(shut, key=lambda r: r.seq)
        if first.logged_event is not None:
            current.wait_event(first.logged_event)
        return
    current.wait_stream(torch.cuda.default_stream(ctx.device))


def resume_gating(ctx: WorkerContext) -> None:
    for proxy in ctx.groups.proxies():
        proxy.resume_gating()
