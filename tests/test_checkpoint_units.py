"""The just-in-time checkpoint without processes: the plan (which step, which writers, what is
lost), the coordinator's machine phase by phase, and the files on disk (written, sealed, read
back, and refused when they are not what the manifest says)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from xmig.coord.checkpoint import (
    CHECKPOINT_TRANSITIONS,
    Checkpoint,
    CheckpointPhase,
    Sealed,
    plan_checkpoint,
    replica_sets,
)
from xmig.coord.orders import Saved, Seal, ToAll
from xmig.jobspec import JobSpec
from xmig.protocol import CheckpointWritten, Park, Parked, Position, WriteCheckpoint
from xmig.state import ReplacementPayload
from xmig.state.checkpoint import (
    CheckpointError,
    Manifest,
    Shard,
    check_resumable,
    read_shard,
    seal,
    write_shard,
)


def parked(step, replicas=None, stepped=False):
    return Position(
        step=step,
        state_step=step + 1 if stepped else step,
        log_from=step - 1,
        keep_log=True,
        signatures={},
        replicas=replicas,
    )


# ---- the plan ------------------------------------------------------------------------------


def test_ddp_over_the_world_is_one_shard_written_by_the_lowest_survivor():
    plan = plan_checkpoint({0: parked(5), 2: parked(5), 3: parked(5)}, world_size=4)
    assert plan.step == 5 and plan.shards == {0: [0, 1, 2, 3]}
    assert plan.writers == {0: 0} and plan.missing == [] and plan.why is None


def test_hsdp_has_a_shard_per_set_of_replicas_each_written_once():
    # rank 1 died: its shard ({1, 3}) is written by rank 3
    positions = {0: parked(4, [0, 2]), 2: parked(4, [0, 2]), 3: parked(4, [1, 3])}
    plan = plan_checkpoint(positions, world_size=4)
    assert plan.shards == {0: [0, 2], 1: [1, 3]}
    assert plan.writers == {0: 0, 3: 1} and plan.step == 4 and not plan.missing


def test_a_shard_without_a_live_holder_is_named_and_nothing_is_written_for_it():
    # ranks 1 and 3 both gone: no survivor says that they were replicas of each other
    positions = {0: parked(4, [0, 2]), 2: parked(4, [0, 2])}
    plan = plan_checkpoint(positions, world_size=4)
    assert plan.writers == {0: 0} and plan.missing == [1, 2]
    assert plan.shards == {0: [0, 2], 1: [1], 2: [3]}
    assert plan.why == (
        "no live copy of shard 1 (rank 1); shard 2 (rank 3) is left: nothing is saved for it"
    )


def test_the_saved_step_is_the_latest_every_shard_has_a_holder_at():
    positions = {0: parked(4, [0, 2], stepped=True), 2: parked(4, [0, 2]), 1: parked(4, [1, 3])}
    plan = plan_checkpoint(positions, world_size=4)
    assert plan.step == 4 and plan.writers == {2: 0, 1: 1}
    positions[2] = parked(4, [0, 2], stepped=True)  # shard 0 only at 5, shard 1 only at 4
    plan = plan_checkpoint(positions, world_size=4)
    assert plan.step is None and plan.writers == {}
    assert "different steps (shard 0 at step 5; shard 1 at step 4)" in plan.why


def test_a_rank_before_its_step_loop_has_nothing_to_save():
    plan = plan_checkpoint({0: replace(parked(0), step=None, state_step=None)}, world_size=2)
    assert plan.step is None and "rank 0 has not reached session.steps()" in plan.why


def test_replica_sets_cover_every_rank_once():
    assert replica_sets({0: parked(1, [0, 1])}, 4) == [[0, 1], [2], [3]]
    assert replica_sets({}, 2) == [[0], [1]]


# ---- the machine ---------------------------------------------------------------------------


def spec(tmp_path, world=4):
    return JobSpec(
        job_id="job1",
        script="train.py",
        args=("--steps", "9"),
        cwd=str(tmp_path),
        nproc_per_node=world,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


def machine(tmp_path, holders=(0, 2, 3)):
    saving = Checkpoint(
        spec(tmp_path),
        generation=3,
        reason="no spare node",
        holders=list(holders),
        started=100.0,
        deadline=200.0,
    )
    return saving, saving.start(100.0)


def written(rank, shard, error=None):
    return CheckpointWritten(
        generation=3,
        shard=shard,
        file=f"shard-{shard:05d}.safetensors",
        bytes=10,
        sha256="ab" * 32,
        seconds=0.1,
        objects=["model"],
        first_step=0,
        error=error,
        rank=rank,
    )


def test_every_phase_has_its_transitions():
    assert set(CHECKPOINT_TRANSITIONS) == set(CheckpointPhase)


def test_the_holders_park_then_the_writers_write_then_it_is_sealed(tmp_path):
    saving, orders = machine(tmp_path)
    (park,) = [o.msg for o in orders if isinstance(o, ToAll)]
    assert park == Park(generation=3, replaced=[1])
    saving.on(Parked(generation=3, position=parked(6), rank=0), 101.0)
    assert saving.phase is CheckpointPhase.PARKING  # until every holder has parked
    saving.on(Parked(generation=3, position=parked(6), rank=2), 101.0)
    orders = saving.on(Parked(generation=3, position=parked(6), rank=3), 101.0)
    assert saving.phase is CheckpointPhase.WRITING
    (order,) = [o.msg for o in orders if isinstance(o, ToAll)]
    assert order == WriteCheckpoint(
        generation=3,
        folder=str(tmp_path / "ckpt" / ".job1-step6.partial"),
        step=6,
        writers={"0": 0},
    )
    orders = saving.on(written(0, 0), 102.0)
    (sealing,) = [o for o in orders if isinstance(o, Seal)]
    assert sealing.final == str(tmp_path / "ckpt" / "job1-step6")
    assert sealing.manifest.step == 6 and sealing.manifest.shards[0].ranks == [0, 1, 2, 3]
    assert sealing.manifest.script == str(tmp_path / "train.py")
    (saved,) = [o for o in saving.on(Sealed(3), 103.0) if isinstance(o, Saved)]
    assert saved.record["path"] == sealing.final and saved.record["complete"]
    assert saving.phase is CheckpointPhase.DONE


def test_a_holder_lost_while_parking_is_left_out(tmp_path):
    saving, _ = machine(tmp_path)
    saving.on(Parked(generation=3, position=parked(6), rank=0), 101.0)
    saving.on(Parked(generation=3, position=parked(6), rank=3), 101.0)
    orders = saving.lost([2], 101.5)
    assert saving.phase is CheckpointPhase.WRITING and saving.plan.writers == {0: 0}
    assert any(isinstance(o, ToAll) for o in orders)


def test_a_writer_lost_or_failing_fails_the_checkpoint(tmp_path):
    saving, _ = machine(tmp_path)
    for rank in (0, 2, 3):
        saving.on(Parked(generation=3, position=parked(6), rank=rank), 101.0)
    (saved,) = [o for o in saving.lost([0], 102.0) if isinstance(o, Saved)]
    assert saved.record["path"] is None and "rank 0 was lost while it wrote" in saved.record["why"]
    saving, _ = machine(tmp_path)
    for rank in (0, 2, 3):
        saving.on(Parked(generation=3, position=parked(6), rank=rank), 101.0)
    (saved,) = [o for o in saving.on(written(0, 0, "disk full"), 102.0) if isinstance(o, Saved)]
    assert "could not write shard 0: disk full" in saved.record["why"]


def test_a_checkpoint_past_its_deadline_fails(tmp_path):
    saving, _ = machine(tmp_path)
    saving.on(Parked(generation=3, position=parked(6), rank=0), 101.0)
    (saved,) = [
        o
        for o in saving.on(Parked(generation=3, position=parked(6), rank=2), 250.0)
        if isinstance(o, Saved)
    ]
    assert "ranks [2, 3] did not park for the checkpoint in time" in saved.record["why"]
    assert saving.phase is CheckpointPhase.FAILED


def test_nothing_to_save_ends_at_once(tmp_path):
    saving, _ = machine(tmp_path, holders=(0,))
    orders = saving.on(
        Parked(generation=3, position=replace(parked(0), step=None, state_step=None), rank=0), 101.0
    )
    (saved,) = [o for o in orders if isinstance(o, Saved)]
    assert saved.record["path"] is None and saving.phase is CheckpointPhase.DONE


# ---- on disk -------------------------------------------------------------------------------


def _state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    shared = torch.arange(6.0)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "views": [shared[:3], shared[3:]],
        "half": torch.ones(2, dtype=torch.bfloat16),
    }


def _sealed(tmp_path, world=2):
    partial, final = tmp_path / ".c.partial", tmp_path / "c"
    payload = ReplacementPayload(step=7, mode="resume", first_step=0, state=_state())
    info = write_shard(partial, 0, payload.to_wire())
    shard = Shard(
        shard=0,
        ranks=list(range(world)),
        file=info["file"],
        bytes=info["bytes"],
        sha256=info["sha256"],
        writer=0,
    )
    manifest = Manifest(
        job_id="j",
        step=7,
        first_step=0,
        world_size=world,
        nnodes=1,
        nproc_per_node=world,
        script="/s.py",
        args=["-x"],
        shards=[shard],
    )
    seal(partial, final, manifest)
    return final, payload


def test_a_shard_comes_back_as_it_was_written(tmp_path):
    final, payload = _sealed(tmp_path)
    assert not (tmp_path / ".c.partial").exists()
    back = ReplacementPayload.from_wire(
        read_shard(final / "shard-00000.safetensors", torch.device("cpu"))
    )
    assert back.step == 7 and back.mode == "resume"
    for key, value in payload.state["model"].items():
        assert torch.equal(back.state["model"][key], value)
    assert back.state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert [v.tolist() for v in back.state["views"]] == [[0, 1, 2], [3, 4, 5]]
    assert back.state["half"].dtype == torch.bfloat16
    manifest = check_resumable(final, 2, 1, 2, "/s.py", ["-x"])
    assert manifest.step == 7 and manifest.complete


def test_a_checkpoint_that_is_not_what_its_manifest_says_is_refused(tmp_path):
    final, _ = _sealed(tmp_path)
    shard = final / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum differs"):
        check_resumable(final, 2, 1, 2, "/s.py", ["-x"])
    shard.write_bytes(bytes(data[:-5]))
    with pytest.raises(CheckpointError, match="truncated"):
        check_resumable(final, 2, 1, 2, "/s.py", ["-x"])


def test_a_checkpoint_of_another_job_or_an_unfinished_one_is_refused(tmp_path):
    final, _ = _sealed(tmp_path)
    with pytest.raises(CheckpointError, match="another world layout: 2 ranks"):
        check_resumable(final, 4, 1, 4, "/s.py", ["-x"])
    with pytest.raises(CheckpointError, match="other script arguments"):
        check_resumable(final, 2, 1, 2, "/s.py", ["-y"])
    with pytest.raises(CheckpointError, match="exists already"):
        seal(
            tmp_path / ".other.partial",
            final,
            Manifest.from_json(json.loads((final / "manifest.json").read_text()), "m"),
        )
    (tmp_path / ".half.partial").mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        check_resumable(tmp_path / "half", 2, 1, 2, "/s.py", ["-x"])
    data = json.loads((final / "manifest.json").read_text())
    data["missing"] = [{"shard": 1, "ranks": [1]}]
    data["shards"][0]["ranks"] = [0]
    (final / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=r"incomplete: no live copy of shard 1 \(ranks \[1\]\)"
    ):
        check_resumable(final, 2, 1, 2, "/s.py", ["-x"])


def test_what_the_ranks_saved_without_a_coordinator_becomes_one_checkpoint(tmp_path):
    """Each rank wrote its own state: one file per set of replicas, of one step, is kept."""
    from xmig.coord.checkpoint import seal_saved_states
    from xmig.state.checkpoint import lost_coordinator_folder, rank_file

    job = spec(tmp_path)  # 4 ranks
    folder = Path(lost_coordinator_folder(job.checkpoint_dir, job.job_id))
    for rank, step, replicas in ((0, 5, [0, 2]), (2, 6, [0, 2]), (1, 5, [1, 3]), (3, 5, [1, 3])):
        payload = ReplacementPayload(
            step=step, mode="resume", first_step=0, state={"x": torch.full((2,), float(rank))}
        )
        extra = {
            "rank": str(rank),
            "step": str(step),
            "first_step": "0",
            "replicas": json.dumps(replicas),
            "objects": '["model"]',
        }
        write_shard(folder, rank, payload.to_wire(), name=rank_file(rank), extra=extra)
    record = seal_saved_states(job, "the coordinator was lost", 1.0)
    assert record["step"] == 5 and record["complete"] and record["shards"] == 2
    final = Path(record["path"])
    assert final.name == "job1-step5" and not folder.exists()
    manifest = check_resumable(final, 4, 1, 4, job.script_path, list(job.args))
    assert [(s.ranks, s.writer) for s in manifest.shards] == [([0, 2], 0), ([1, 3], 1)]
    assert sorted(p.name for p in final.iterdir()) == [
        "manifest.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    back = read_shard(final / "shard-00001.safetensors", torch.device("cpu"))
    assert back["state"]["x"].tolist() == [1.0, 1.0]


def test_ranks_that_saved_nothing_leave_nothing_to_seal(tmp_path):
    from xmig.coord.checkpoint import seal_saved_states

    record = seal_saved_states(spec(tmp_path), "lost", 1.0)
    assert record["path"] is None and record["why"] == "no rank saved its state"
