"""Pure decisions on a job's membership: whether a fault can be recovered, where the
replacements go, whether a rank can move."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xmig.coord.migration import gpu_conflict
from xmig.protocol import FaultRecord

if TYPE_CHECKING:
    from xmig.coord.machine import Job


def idle_nodes(job: Job) -> list[int]:
    """Live nodes with no rank on them: spare nodes, or ones whose ranks moved away."""
    busy = {m.node for m in job.members.values()}
    return sorted(n for n in job.agents if n not in busy)


def placement(job: Job, replaced: list[int]) -> dict[int, int]:
    """Where each replacement starts: its own node while that lives, else an idle one (all
    ranks of one lost node go to the same idle node)."""
    placed: dict[int, int] = {}
    idle = idle_nodes(job)
    moved: dict[int, int] = {}
    for rank in replaced:
        node = job.members[rank].node
        if node in job.agents:
            placed[rank] = node
        else:
            if node not in moved:
                moved[node] = idle.pop(0)
            placed[rank] = moved[node]
    return placed


def nodes_without_spare(job: Job, replaced: list[int]) -> bool:
    """Whether the lost nodes of ``replaced`` outnumber the idle nodes that could take them."""
    homeless = {job.members[r].node for r in replaced if r in job.members} - job.agents
    return len(homeless) > len(idle_nodes(job))


def why_no_recovery(job: Job, primary: FaultRecord, replaced: list[int],
                    shrinking: bool = False) -> str | None:  # fmt: skip
    """Why the fault cannot be recovered in place (None: it can); ``shrinking``: without
    replacements, the world going on without ``replaced``."""
    homeless = {job.members[r].node for r in replaced if r in job.members} - job.agents
    if not shrinking and len(homeless) > len(idle_nodes(job)):
        return (f"node {sorted(homeless)[0]} was lost and there is no spare node to take its "
                "ranks (--spare-nodes)")  # fmt: skip
    if len(job.recoveries) >= job.spec.max_recoveries:
        return f"the job already recovered {len(job.recoveries)} times (--max-recoveries)"
    unmanaged = sorted(set(range(job.world_size)) - job.joined - set(replaced))
    if unmanaged:
        return f"rank {unmanaged[0]} never called xmig.init(), so it cannot be parked"
    missing = sorted(r for r in replaced if r not in job.members)
    if missing and not shrinking:
        return f"rank {missing[0]} never started, so there is nothing to replace"
    gone = sorted(job.exited - set(replaced))
    if gone:
        return (f"ranks {gone} finished and exited before the fault, so they cannot serve the "
                "state or replay the last step with a replacement")  # fmt: skip
    if len(replaced) >= job.world_size:
        return "every rank failed: no peer holds the state"
    for done in job.recoveries[-2:]:
        if replaced and done["ranks"] == replaced and done["step"] == primary.step:
            return (f"rank {replaced[0]} failed again at step {primary.step}: a crash that "
                    "repeats is not a fault to recover from")  # fmt: skip
    return None


def unexplained_error(errors: list[FaultRecord], replaced: list[int]) -> str | None:
    """Why the replaced ranks' deaths do not explain a collective that failed (None: they
    do): it failed on a rank that lives on, in a group that holds none of ``replaced``. Its
    group is not one a replay rebuilds, and its ops there may never have gone out: only a
    rollback, which rebuilds every group, brings that group back."""
    if not replaced:
        return None  # nobody replaced: every group is rebuilt anyway
    for error in sorted(errors, key=lambda r: r.t_fault):
        group = error.group
        if (error.kind == "comm_error" and group and error.rank not in replaced
                and not set(group) & set(replaced)):  # fmt: skip
            return (f"a collective failed on rank {error.rank} in the group of ranks "
                    f"{sorted(group)}, which holds none of the replaced ranks")  # fmt: skip
    return None


def why_no_checkpoint(job: Job, holders: list[int]) -> str | None:
    """Why the ranks ``holders`` cannot save the job's state (None: they can try)."""
    if not holders:
        return "no rank that holds the state is left"
    unmanaged = sorted(set(holders) - job.joined)
    if unmanaged:
        return f"rank {unmanaged[0]} never called xmig.init(), so it cannot save its state"
    if job.spec.checkpoint_dir is None:
        return "no folder to write it to"
    return None


def migration_problem(job: Job, rank: int, target: int | None) -> tuple[str | None, int]:
    """Why ``rank`` cannot move to ``target`` now (None: it can), and the target."""
    from xmig.coord.machine import JobState

    if job.state is not JobState.RUNNING:
        what = "handling a fault" if job.state is JobState.SETTLING else job.state.value
        return f"the job is {what}, not running", -1
    if not 0 <= rank < job.world_size:
        return f"rank {rank} does not exist (world size {job.world_size})", -1
    member = job.members.get(rank)
    if member is None or rank not in job.progress:
        return f"rank {rank} has not started training yet", -1
    if target is None:
        idle = idle_nodes(job)
        if not idle:
            return ("no idle node to move to: name one with --to, or start the job with "
                    "--spare-nodes", -1)  # fmt: skip
        target = idle[0]
    if not 0 <= target < job.spec.all_nodes:
        return f"node {target} does not exist (nodes 0..{job.spec.all_nodes - 1})", target
    if target not in job.agents:
        return f"node {target} is lost", target
    if target == member.node:
        return f"rank {rank} is already on node {target}", target
    for node in (member.node, target):
        status = job.criu.get(node)
        if status is None:
            return f"node {node} has not reported whether CRIU works there yet", target
        if not status.usable:
            return f"CRIU is not usable on node {node}: {status.detail}", target
    gpus = {node: status.gpus for node, status in job.criu.items()}
    nodes = {r: m.node for r, m in job.members.items()}
    return gpu_conflict(rank, target, nodes, gpus, job.spec.nproc_per_node), target


def differing_replicas(sums: dict[int, str],
                       replicas: dict[int, list[int] | None]) -> dict[int, str] | None:  # fmt: skip
    """The checksums of the first set of replicas whose members disagree (None: every set
    agrees). ``replicas``: each rank's set (None: every rank is one set)."""
    sets: dict[tuple[int, ...] | None, dict[int, str]] = {}
    for rank, checksum in sorted(sums.items()):
        members = replicas.get(rank)
        sets.setdefault(tuple(sorted(members)) if members else None, {})[rank] = checksum
    for found in sets.values():
        if len(set(found.values())) > 1:
            return found
    return None
