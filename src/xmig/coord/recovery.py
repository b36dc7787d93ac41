"""Recovery plans: from where the survivors are parked, choose the step to resume at, the
peer that serves the state, and whether the step is replayed or rolled back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# how a survivor came by DDP's bucket layout, as it reports when it parks (xmig.state.ddp)
LAYOUT_LOCAL = "local"
LAYOUT_INCONSISTENT = "inconsistent"


class RecoveryImpossible(Exception):
    """No plan can bring the job back; the message says why."""


def _consistent(lists: list[list[str]]) -> bool:
    """True when every list is a prefix of the longest one."""
    longest = max(lists, key=len, default=[])
    return all(lst == longest[: len(lst)] for lst in lists)


def plan_rebuild(
    positions: dict[int, dict[str, Any]], replaced: list[int], generation: int
) -> dict[str, Any]:
    """The ``rebuild`` order for generation ``generation``.

    ``positions`` maps each survivor to what it reported when it parked: ``step``,
    ``state_step`` (the step whose start its state is: its step, or the next one once its
    optimizer has stepped), ``log_from`` (the first step it still holds the log of),
    ``keep_log`` and ``signatures`` (step → its logged ops' signatures).
    """
    if not positions:
        raise RecoveryImpossible("no rank survived to serve the state")
    early = sorted(r for r, p in positions.items() if p.get("state_step") is None)
    if early:
        raise RecoveryImpossible(
            f"rank {early[0]} has not reached session.steps(): in-place recovery needs the "
            "step boundary"
        )
    layouts = {p["ddp_layout"] for p in positions.values() if p.get("ddp_layout")}
    if len(layouts) > 1:
        raise RecoveryImpossible(
            "the survivors hold different DDP bucket layouts: no replacement can match them all"
        )
    sources = {p.get("ddp_layout_source") for p in positions.values()}
    if LAYOUT_INCONSISTENT in sources:
        raise RecoveryImpossible(
            "rank 0 died while sending DDP's bucket layout, and the part its peers received "
            "differs from their own layout: the rest of it is lost with rank 0"
        )
    # the survivors made the layout themselves: whether it is rank 0's shows in its replacement
    verify_ready_order = LAYOUT_LOCAL in sources
    state_steps = {r: int(p["state_step"]) for r, p in positions.items()}
    low = min(state_steps.values())
    reasons = []
    if not all(p.get("keep_log") for p in positions.values()):
        reasons.append("the replay log is off")
    elif any(p.get("log_from") is None or int(p["log_from"]) > low for p in positions.values()):
        reasons.append(f"a survivor no longer holds the log of step {low}")
    else:
        steps = {int(s) for p in positions.values() for s in p.get("signatures", {})}
        for step in sorted(s for s in steps if s >= low):
            lists = [p.get("signatures", {}).get(str(step), []) for p in positions.values()]
            if not _consistent(lists):
                reasons.append(f"the survivors logged different ops in step {step}")
                break
    if not reasons:
        candidates = [r for r, s in state_steps.items() if s == low]
        source = max(
            candidates,
            key=lambda r: (len(positions[r].get("signatures", {}).get(str(low), [])), -r),
        )
        return {
            "op": "rebuild", "generation": generation, "mode": "replay", "step": low,
            "source": source, "pulls": sorted(replaced), "why": None,
            "verify_ready_order": verify_ready_order,
        }  # fmt: skip
    high = max(state_steps.values())
    source = min(r for r, s in state_steps.items() if s == high)
    laggards = [r for r, s in state_steps.items() if s < high]
    return {
        "op": "rebuild", "generation": generation, "mode": "rollback", "step": high,
        "source": source, "pulls": sorted([*replaced, *laggards]), "why": reasons[0],
        "verify_ready_order": verify_ready_order,
    }  # fmt: skip


@dataclass
class Recovery:
    """One recovery in progress (and, once done, its record)."""

    generation: int
    primary: dict[str, Any]
    replaced: list[int]
    survivors: list[int]
    started: float = field(default_factory=time.time)  # the decision
    parked: dict[int, dict[str, Any]] = field(default_factory=dict)
    parked_at: float | None = None
    plan: dict[str, Any] | None = None
    joined: dict[int, float] = field(default_factory=dict)
    recovered: dict[int, dict[str, Any]] = field(default_factory=dict)
    from_spare: dict[int, bool] = field(default_factory=dict)
    placement: dict[int, int] = field(default_factory=dict)  # replaced rank -> its node

    @property
    def expected(self) -> set[int]:
        return set(self.survivors) | set(self.replaced)

    def record(self) -> dict[str, Any]:
        assert self.plan is not None
        fault = self.primary
        survivors = [self.recovered[r] for r in self.survivors if r in self.recovered]
        everyone = list(self.recovered.values())

        def longest(role_reports: list[dict[str, Any]], phase: str) -> float:
            return max((float(r.get("phases", {}).get(phase, 0.0)) for r in role_reports),
                       default=0.0)  # fmt: skip

        pulls = [r["pull"] for r in everyone if r.get("pull")]
        pull_bytes = max((int(p["bytes"]) for p in pulls), default=0)
        pull_s = max((float(p["seconds"]) for p in pulls), default=0.0)
        setup_s = max((float(p.get("setup_seconds", 0.0)) for p in pulls), default=0.0)
        respawn = max((t - self.started for r, t in self.joined.items() if r in self.replaced),
                      default=0.0)  # fmt: skip
        resumed = max((float(r["t_resumed"]) for r in everyone), default=time.time())
        if self.plan["mode"] == "rollback":
            mode = "rollback"
        else:
            mode = "respawn" if self.replaced else "in-place retry"
        phases = {
            "detect": float(fault.get("detected_after_s") or 0.0),
            "park": (self.parked_at or self.started) - self.started,
            "respawn": respawn,
            "rebuild": longest(survivors, "rebuild"),
            "pull": max(pull_s, longest(everyone, "pull")),
            "replay": longest(survivors, "replay"),
        }
        return {
            "generation": self.generation,
            "rank": fault["rank"],
            "ranks": list(self.replaced),
            "fault_kind": fault["kind"],
            "step": fault.get("step"),
            "mode": mode,
            "resume_step": self.plan["step"],
            "source": self.plan["source"],
            "why_rollback": self.plan.get("why"),
            "phases": {k: round(v, 4) for k, v in phases.items()},
            "total_s": round(resumed - float(fault["t_fault"]), 4),
            "from_spare": [self.from_spare.get(r, False) for r in self.replaced],
            "nodes": {str(r): n for r, n in sorted(self.placement.items())},
            "pull_bytes": pull_bytes,
            "pull_gb_per_s": round(pull_bytes / pull_s / 1e9, 3) if pull_s > 0 else None,
            "pull_setup_s": round(setup_s, 4),
        }


def describe_recovery(record: dict[str, Any]) -> str:
    """One human line for a recovery record."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in record["phases"].items())
    ranks = ",".join(str(r) for r in record["ranks"]) or str(record["rank"])
    text = (
        f"recovered rank {ranks} ({record['fault_kind']} at step {record['step']}) by "
        f"{record['mode']} in {record['total_s']:.2f} s; resumed at step "
        f"{record['resume_step']} with state from rank {record['source']} [{phases}]"
    )
    if record.get("why_rollback"):
        text += f"; rolled back because {record['why_rollback']}"
    return text
