"""Fault specifications: ``KIND:rank=R:step=S[:at=POINT][:code=N]``, and the planned events
given the same way: ``migrate:rank=R:step=S[:to=N]``, ``resize:world=N:step=S``,
``add-node:step=S``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# node: the whole node of the rank is lost at once (its agent, its workers, its spares);
# migrate: not a fault, a planned move of the rank to another node (to=N) at a step boundary;
# resize: not a fault either, the world changed to world=N ranks at a step boundary;
# add-node: one more node started as the job reaches step S (``xmig scale --add-node``)
KINDS = ("kill", "exit", "raise", "hang", "node", "migrate", "resize", "add-node")
# what the coordinator carries out at a step boundary, not the workers' injector
PLANNED = ("migrate", "resize", "add-node")
POINTS = ("forward", "backward", "optimizer", "boundary", "pause")
# pause: as the rank waits at the step's start, paused for a migration or a resize (once it
# has said so): a fault there hits the world between its pause and its going on
# where a rank parked in ``step`` is in a peer's recovery, or in writing a just-in-time
# checkpoint: the fault fires as it begins that phase (``recovery record``'s phase names)
RECOVERY_POINTS = ("park", "rebuild", "pull", "replay", "checkpoint")
DEFAULT_POINT = "backward"


class FaultSpecError(ValueError):
    """A fault specification that cannot be understood."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject into one rank at one step.

    ``at`` is a point of the step (``forward``, ``backward``, ``optimizer``, ``boundary``;
    ``pause``: paused at the step's start for a migration or a resize),
    ``collective=K``: the K-th collective (counting from 0) that the rank issues in the step,
    ``completion=K`` (``raise`` only): that collective is launched and then fails, as one
    broken by a lost peer does (the error found once the rank has gone on past it),
    or a phase of a peer's recovery this rank takes part in while parked in the step
    (``park``, ``rebuild``, ``pull``, ``replay``; ``checkpoint``: writing its shard of a
    just-in-time checkpoint).
    ``step`` may be None only for a fault injected into a running job: the next step.
    """

    kind: str
    rank: int
    step: int | None
    at: str = DEFAULT_POINT
    code: int = 1
    to: int | None = None  # migrate: the target node (None: a spare node)
    world: int | None = None  # resize: the new world size

    @property
    def collective(self) -> int | None:
        """The collective index for ``at=collective=K``, else None."""
        if self.at.startswith("collective="):
            return int(self.at.split("=", 1)[1])
        return None

    @property
    def completion(self) -> int | None:
        """The collective index for ``at=completion=K``, else None."""
        if self.at.startswith("completion="):
            return int(self.at.split("=", 1)[1])
        return None

    def __str__(self) -> str:
        if self.kind == "resize":
            return f"resize:world={self.world}:step={self.step}"
        if self.kind == "add-node":
            return f"add-node:step={self.step}"
        text = f"{self.kind}:rank={self.rank}"
        if self.step is not None:
            text += f":step={self.step}"
        text += f":at={self.at}"
        if self.kind == "exit" and self.code != 1:
            text += f":code={self.code}"
        if self.to is not None:
            text += f":to={self.to}"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultSpec:
        return cls(**data)


def _int_field(name: str, value: str, spec: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultSpecError(f"{name}={value!r} is not a whole number in {spec!r}") from None
    if number < minimum:
        raise FaultSpecError(f"{name} must be >= {minimum} in {spec!r}")
    return number


def parse_fault(spec: str, require_step: bool = True) -> FaultSpec:
    """Parse one ``--inject`` value; raise FaultSpecError with the reason when malformed."""
    parts = spec.strip().split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {spec!r} (expected one of {', '.join(KINDS)})"
        )
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise FaultSpecError(f"expected key=value, got {part!r} in {spec!r}")
        if key in fields:
            raise FaultSpecError(f"{key} given twice in {spec!r}")
        fields[key] = value
    if kind == "resize":
        return _parse_resize(fields, spec, require_step)
    if kind == "add-node":
        return _parse_add_node(fields, spec, require_step)
    unknown = set(fields) - {"rank", "step", "at", "code", "to"}
    if unknown:
        raise FaultSpecError(f"unknown field {sorted(unknown)[0]!r} in {spec!r}")
    if "rank" not in fields:
        raise FaultSpecError(f"missing rank=R in {spec!r}")
    if require_step and "step" not in fields:
        raise FaultSpecError(f"missing step=S in {spec!r}")
    rank = _int_field("rank", fields["rank"], spec, 0)
    step = _int_field("step", fields["step"], spec, 0) if "step" in fields else None
    at = fields.get("at", DEFAULT_POINT)
    if at in ("collective", "completion"):
        raise FaultSpecError(f"at={at} needs an index, e.g. at={at}=2, in {spec!r}")
    if at.startswith("collective="):
        _int_field("collective", at.split("=", 1)[1], spec, 0)
    elif at.startswith("completion="):
        _int_field("completion", at.split("=", 1)[1], spec, 0)
        if kind != "raise":
            raise FaultSpecError(f"at=completion=K applies only to raise faults (a collective "
                                 f"that fails after its launch), in {spec!r}")  # fmt: skip
    elif at in RECOVERY_POINTS:
        if kind in ("raise", "migrate"):
            raise FaultSpecError(f"a {kind} cannot be injected into a recovery's {at} phase, "
                                 f"in {spec!r}")  # fmt: skip
    elif at == "pause" and kind in ("raise", "migrate"):
        raise FaultSpecError(f"a {kind} cannot be injected into a pause (a paused rank issues "
                             f"no collective), in {spec!r}")  # fmt: skip
    elif at not in POINTS:
        raise FaultSpecError(
            f"unknown point at={at!r} in {spec!r} (expected {', '.join(POINTS)}, collective=K, "
            f"completion=K or a recovery's phase: {', '.join(RECOVERY_POINTS)})"
        )
    code = 1
    if "code" in fields:
        if kind != "exit":
            raise FaultSpecError(f"code= applies only to exit faults, in {spec!r}")
        code = _int_field("code", fields["code"], spec, 1)
        if code > 255:
            raise FaultSpecError(f"code must be <= 255 in {spec!r}")
    to = None
    if "to" in fields:
        if kind != "migrate":
            raise FaultSpecError(f"to= applies only to migrate, in {spec!r}")
        to = _int_field("to", fields["to"], spec, 0)
    if kind == "migrate":
        if "at" in fields and at != "boundary":
            raise FaultSpecError(f"a migration happens at a step boundary, in {spec!r}")
        at = "boundary"
    return FaultSpec(kind=kind, rank=rank, step=step, at=at, code=code, to=to)


def _parse_resize(fields: dict[str, str], spec: str, require_step: bool) -> FaultSpec:
    unknown = set(fields) - {"world", "step"}
    if unknown:
        raise FaultSpecError(f"unknown field {sorted(unknown)[0]!r} in {spec!r} (a resize "
                             "takes world=N and step=S)")  # fmt: skip
    if "world" not in fields:
        raise FaultSpecError(f"missing world=N in {spec!r}")
    if require_step and "step" not in fields:
        raise FaultSpecError(f"missing step=S in {spec!r}")
    world = _int_field("world", fields["world"], spec, 1)
    step = _int_field("step", fields["step"], spec, 1) if "step" in fields else None
    return FaultSpec(kind="resize", rank=0, step=step, at="boundary", world=world)


def _parse_add_node(fields: dict[str, str], spec: str, require_step: bool) -> FaultSpec:
    unknown = set(fields) - {"step"}
    if unknown:
        raise FaultSpecError(f"unknown field {sorted(unknown)[0]!r} in {spec!r} (add-node "
                             "takes step=S)")  # fmt: skip
    if require_step and "step" not in fields:
        raise FaultSpecError(f"missing step=S in {spec!r}")
    step = _int_field("step", fields["step"], spec, 1) if "step" in fields else None
    return FaultSpec(kind="add-node", rank=0, step=step, at="boundary")


def parse_faults(specs: list[str], world_size: int) -> list[FaultSpec]:
    """Parse several specs and check their ranks against the world size."""
    faults = []
    for text in specs:
        fault = parse_fault(text)
        if fault.kind == "resize":
            if fault.world is not None and fault.world > world_size:
                raise FaultSpecError(f"world={fault.world} in {text!r} is larger than the "
                                     f"launch's world size {world_size}")  # fmt: skip
        elif fault.kind == "add-node":
            pass
        elif fault.rank >= world_size:
            raise FaultSpecError(
                f"rank {fault.rank} does not exist in {text!r} (world size {world_size})"
            )
        faults.append(fault)
    return faults
