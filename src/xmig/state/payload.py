"""What the serving survivor sends a rank that pulls its state, as one typed value.

It travels through ``state.transfer`` as plain containers (the receiver's restricted unpickler
builds nothing else): ``to_wire`` before ``send_state``, ``from_wire`` after ``recv_state``,
which also checks the structure a peer sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# resume: from a checkpoint on disk; join: a rank a resize added, which starts at ``step``
MODES = ("replay", "rollback", "resume", "join")


class PayloadError(ValueError):
    """What a peer sent is not a replacement payload."""


@dataclass
class DdpPayload:
    """DDP's bucket layout as the survivors have it (see ``state.ddp``).

    ``layout``: the two payloads of DDP's layout broadcasts, when the survivors took them in an
    earlier step; ``in_step``: the ones of the resumed step, from op ``in_step_index`` on, when
    they rebuild in it; ``ready_order``: the server's first gradient order, which the receiver
    must find its own equal to when ``verify_ready_order``.
    """

    layout: list[torch.Tensor] | None = None
    in_step: list[torch.Tensor] | None = None
    in_step_index: int = 0
    ready_order: list[int] | None = None
    verify_ready_order: bool = False


@dataclass
class ReplacementPayload:
    """The state of the step a recovery resumes at, and how to resume it."""

    step: int
    mode: str  # one of MODES
    first_step: int | None
    state: dict[str, Any]  # registered name -> its state_dict()
    ddp: DdpPayload = field(default_factory=DdpPayload)
    # the step's ops as the survivors logged them, per process group (replay)
    signatures: dict[str, list[str]] | None = None
    # the results the ops the survivors replay had before the fault ("group:step:index" -> its
    # output tensors): the replacement's ops end with these (every rank goes on from the same)
    results: dict[str, list[torch.Tensor]] | None = None
    check_after: int | None = None  # the step after which to report the replica checksum

    def to_wire(self) -> dict[str, Any]:
        """Plain containers for ``send_state`` (no copy of the tensors)."""
        ddp = self.ddp
        return {
            "step": self.step,
            "mode": self.mode,
            "first_step": self.first_step,
            "state": self.state,
            "ddp": {
                "layout": ddp.layout,
                "in_step": ddp.in_step,
                "in_step_index": ddp.in_step_index,
                "ready_order": ddp.ready_order,
                "verify_ready_order": ddp.verify_ready_order,
            },
            "signatures": self.signatures,
            "results": self.results,
            "check_after": self.check_after,
        }

    @classmethod
    def from_wire(cls, data: Any) -> ReplacementPayload:
        """The payload ``to_wire`` made, checked; PayloadError if it is not one."""
        body = _object(data, "payload", ("step", "mode", "first_step", "state", "ddp",
                                         "signatures", "results", "check_after"))  # fmt: skip
        ddp = _object(body["ddp"], "ddp", ("layout", "in_step", "in_step_index",
                                           "ready_order", "verify_ready_order"))  # fmt: skip
        mode = body["mode"]
        if mode not in MODES:
            raise PayloadError(f"unknown mode {str(mode)[:20]!r}")
        if not isinstance(body["state"], dict):
            raise PayloadError("state is not a mapping")
        return cls(
            step=_int(body["step"], "step"),
            mode=mode,
            first_step=_int(body["first_step"], "first_step", optional=True),
            state=body["state"],
            ddp=DdpPayload(
                layout=_tensors(ddp["layout"], "ddp.layout"),
                in_step=_tensors(ddp["in_step"], "ddp.in_step"),
                in_step_index=_int(ddp["in_step_index"], "ddp.in_step_index"),
                ready_order=_ints(ddp["ready_order"], "ddp.ready_order"),
                verify_ready_order=_bool(ddp["verify_ready_order"], "ddp.verify_ready_order"),
            ),
            signatures=_signatures(body["signatures"]),
            results=_results(body["results"]),
            check_after=_int(body["check_after"], "check_after", optional=True),
        )


def _object(value: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(keys):
        raise PayloadError(f"{where} does not have the fields {', '.join(keys)}")
    return value


def _int(value: Any, where: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise PayloadError(f"{where} is not an integer")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PayloadError(f"{where} is not a boolean")
    return value


def _tensors(value: Any, where: str) -> list[torch.Tensor] | None:
    if value is not None and not (
        isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value)
    ):
        raise PayloadError(f"{where} is not a list of tensors")
    return value


def _results(value: Any) -> dict[str, list[torch.Tensor]] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PayloadError("results is not a mapping")
    for key, tensors in value.items():
        group, step, index = result_key(key)
        if not (group and step.isdigit() and index.isdigit()):
            raise PayloadError(f"results: {str(key)[:40]!r} is not group:step:index")
        _tensors(tensors, f"results[{key}]")
    return value


def result_key(key: Any) -> tuple[str, str, str]:
    """A results key's (group, step, index), as text."""
    group, _, rest = str(key).partition(":")
    step, _, index = rest.partition(":")
    return group, step, index


def _signatures(value: Any) -> dict[str, list[str]] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PayloadError("signatures is not a mapping of groups")
    for group, signatures in value.items():
        if _strings(signatures, f"signatures[{str(group)[:20]}]") is None:
            raise PayloadError(f"signatures[{str(group)[:20]}] is not a list of strings")
    return value


def _ints(value: Any, where: str) -> list[int] | None:
    if value is not None:
        if not isinstance(value, list):
            raise PayloadError(f"{where} is not a list of integers")
        for item in value:
            _int(item, where)
    return value


def _strings(value: Any, where: str) -> list[str] | None:
    if value is not None and not (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    ):
        raise PayloadError(f"{where} is not a list of strings")
    return value
