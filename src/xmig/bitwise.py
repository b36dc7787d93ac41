"""Whether a recovery can be the fault-free run: the verdict, and the words for it.

A recovery is ``verified`` (True) when the survivors' replay re-reduced at least one collective
that had completed before the fault and every one came out bit for bit as it first did (the
replacement put in what the failed rank had put in), and nothing else contradicts it; False when
anything contradicts it; ``"unverifiable"`` when nothing could be compared (the fault came
before any collective of the step completed, or the step was rolled back). The replicas'
checksums agreeing is no evidence either way: DDP makes them agree whatever the inputs were.
Shared by the coordinator and the workers (no torch here).
"""

from __future__ import annotations

from typing import Any

UNVERIFIABLE = "unverifiable"
README_SECTION = "see README, 'Bit-identical recovery'"


def replay_divergence(first: dict[str, Any], replaced: list[int]) -> str:
    """Why a replay whose results differ is not the fault-free run (``first``: the first
    op that differs, as ``ReplayCheck`` lists it)."""
    ranks = ", ".join(map(str, replaced)) or "?"
    step = first["step"]
    group = first.get("group", "world")
    where = f"of step {step}" if group == "world" else f"of group {group} in step {step}"
    return (
        f"the replayed step is not bit-identical: op {first['index']} {where} "
        f"({first['op']}) came out different, so rank {ranks}'s inputs for step {step} differ "
        f"from the failed rank's: its data or random state is not a function of the step "
        f"({README_SECTION})"
    )


def combine_replays(checks: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The survivors' replay checks of one recovery, as one."""
    found = [c for c in checks if c]
    return {
        "compared": sum(int(c.get("compared", 0)) for c in found),
        "unverifiable": sum(int(c.get("unverifiable", 0)) for c in found),
        "differ": next((list(c["differ"]) for c in found if c.get("differ")), []),
    }


def verdict(replay: dict[str, Any] | None, replicas_equal: bool | None,
            contradiction: str | None) -> bool | str:  # fmt: skip
    """True, False or ``"unverifiable"``, as the module says."""
    if contradiction or replicas_equal is False or (replay and replay.get("differ")):
        return False
    if replay and int(replay.get("compared", 0)) > 0:
        return True
    return UNVERIFIABLE


def describe_verdict(replay: dict[str, Any] | None, mode: str) -> str:
    """A few words on what a recovery's replay showed, for its line."""
    if mode == "rollback":
        return "unverifiable: the step was rolled back, nothing was replayed"
    if not replay or (not replay["compared"] and not replay["differ"]):
        return "unverifiable: no collective of the step had completed before the fault"
    if replay["differ"]:
        return "NOT bit-identical"
    return f"verified: {replay['compared']} replayed collective(s) bit-identical"
