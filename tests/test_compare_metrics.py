"""The side-by-side benchmark's columns, read from synthetic step lines (the peers themselves
are optional extras, not installed in CI)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import compare  # noqa: E402


def _run(system, lines, kills=(), launched=0.0, ended=None, world=2, killed=1):
    ended = ended if ended is not None else max(r["t"] for r in lines) + 1.0
    return compare.Run(system, "x", launched, ended, 0, sorted(lines, key=lambda r: r["t"]),
                       sorted(kills), world=world, killed=killed)  # fmt: skip


def _steps(rank, steps, start, every, **extra):
    return [{"rank": rank, "step": s, "t": start + i * every, **extra}
            for i, s in enumerate(steps)]  # fmt: skip


def test_a_recovery_without_rollback():
    # both ranks step every 0.1 s; rank 1 killed at 1.05 s, step 10 done by both at 3.0 s
    lines = _steps(0, range(10), 0.1, 0.1) + _steps(1, range(10), 0.1, 0.1)
    lines += _steps(0, range(10, 20), 3.0, 0.1) + _steps(1, range(10, 20), 3.0, 0.1)
    run = _run("xmig", lines, kills=[1.05])
    assert compare.step_time(run) == pytest.approx(0.1)
    assert compare.survivor_stall(run, 1.05) == pytest.approx(3.0 - 1.0)
    assert compare.back_to_full(run, 1.05) == pytest.approx(3.0 - 1.05)
    assert compare.steps_lost(run) == 0
    assert compare.goodput(run) == pytest.approx(20 / run.ended)


def test_a_rollback_counts_the_steps_trained_again():
    # torchrun: killed in step 8, restarted from the checkpoint after step 4: 5..7 again
    lines = _steps(0, range(8), 0.1, 0.1) + _steps(1, range(8), 0.1, 0.1)
    again = range(5, 12)
    lines += _steps(0, again, 5.0, 0.1, attempt=1) + _steps(1, again, 5.0, 0.1, attempt=1)
    run = _run("torchrun", lines, kills=[0.85])
    assert compare.steps_lost(run) == 3
    assert compare.back_to_full(run, 0.85) == pytest.approx(5.0 - 0.85)
    assert compare.goodput(run) == pytest.approx(12 / run.ended)  # each step counts once


def test_steps_without_a_ranks_batch_are_lost_and_count_by_their_share():
    full = {"participants": 2, "committed": True}
    alone = {"participants": 1, "committed": True}
    lines = _steps(0, range(4), 0.1, 0.1, **full) + _steps(1, range(4), 0.1, 0.1, **full)
    lines += [{"rank": 0, "step": 4, "t": 0.6, "participants": 2, "committed": False}]
    lines += _steps(0, range(4, 8), 1.0, 0.1, **alone)  # the survivor goes on alone
    lines += _steps(0, range(8, 10), 2.0, 0.1, **full) + _steps(1, range(8, 10), 2.0, 0.1, **full)
    run = _run("torchft", lines, kills=[0.55], ended=3.0)
    assert compare.steps_lost(run) == 4
    assert compare.back_to_full(run, 0.55) == pytest.approx(2.0 - 0.55)
    assert compare.goodput(run) == pytest.approx((4 + 4 * 0.5 + 2) / 3.0)
    assert compare.full_world_times(run)[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_four_ranks_count_a_step_only_when_all_four_trained_it():
    # rank 2 of 4 killed at 1.05 s; ranks 0, 1, 3 wait; all four train step 10 at 3.0 s
    lines = [line for rank in range(4) for line in _steps(rank, range(10), 0.1, 0.1)]
    lines += [line for rank in (0, 1, 3) for line in _steps(rank, [10], 3.0, 0.1)]
    lines += _steps(2, [10], 3.2, 0.1)  # the replacement is the last to finish step 10
    run = _run("xmig", lines, kills=[1.05], world=4, killed=2)
    assert compare.back_to_full(run, 1.05) == pytest.approx(3.2 - 1.05)
    assert compare.survivor_stall(run, 1.05) == pytest.approx(3.0 - 1.0)
    assert compare.steps_lost(run) == 0
    assert compare.goodput(run) == pytest.approx(11 / run.ended)
    # a rollback of all four ranks by 3 steps loses 3 steps, not 3 per rank
    again = [line for rank in range(4) for line in _steps(rank, range(7, 10), 5.0, 0.1)]
    assert compare.steps_lost(_run("torchrun", lines + again, world=4, killed=2)) == 3
    # without the replacement's line, three ranks' step 10 is not a full-world step
    partial = [line for line in lines if not (line["rank"] == 2 and line["step"] == 10)]
    assert compare.back_to_full(_run("xmig", partial, kills=[1.05], world=4, killed=2),
                                1.05) is None  # fmt: skip


def test_fault_steps_are_spread_evenly():
    args = type("A", (), {"steps": 60, "faults": 3, "model": "gpt", "preset": "tiny",
                          "batch_size": 8, "step_sleep": 0.0})()  # fmt: skip
    bench = compare.Bench(args, Path("."))
    assert bench.fault_steps("fault-free") == []
    assert bench.fault_steps("one fault") == [30]
    assert bench.fault_steps("3 faults") == [15, 30, 45]


def test_a_step_the_killed_rank_finished_before_dying_is_not_full_world_again():
    # the survivor finishes step 5 just after the kill; the killed rank had finished it before
    full = {"participants": 2, "committed": True}
    lines = _steps(0, range(6), 0.1, 0.1, **full) + _steps(1, range(6), 0.05, 0.1, **full)
    lines += _steps(0, range(6, 9), 2.0, 0.1, participants=1, committed=True)
    lines += _steps(0, range(9, 12), 4.0, 0.1, **full) + _steps(1, range(9, 12), 4.0, 0.1, **full)
    run = _run("torchft", lines, kills=[0.58])
    assert compare.back_to_full(run, 0.58) == pytest.approx(4.0 - 0.58)
