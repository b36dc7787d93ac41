"""Fault specifications: what parses, what is refused and why."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xmig.faults import FaultSpec, FaultSpecError, parse_fault, parse_faults


def test_full_spec():
    spec = parse_fault("exit:rank=2:step=7:at=optimizer:code=5")
    assert spec == FaultSpec(kind="exit", rank=2, step=7, at="optimizer", code=5)


def test_defaults_and_collective():
    assert parse_fault("kill:rank=0:step=1").at == "backward"
    spec = parse_fault("raise:rank=1:step=3:at=collective=4")
    assert spec.collective == 4 and spec.at == "collective=4"
    late = parse_fault("raise:rank=1:step=3:at=completion=2")
    assert late.completion == 2 and late.collective is None and str(late).endswith("completion=2")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("boom:rank=0:step=1", "unknown fault kind"),
        ("kill:step=1", "missing rank"),
        ("kill:rank=0", "missing step"),
        ("kill:rank=x:step=1", "not a whole number"),
        ("kill:rank=-1:step=1", "must be >= 0"),
        ("kill:rank=0:step=1:at=sideways", "unknown point"),
        ("kill:rank=0:step=1:at=collective", "needs an index"),
        ("kill:rank=0:step=1:at=collective=z", "not a whole number"),
        ("raise:rank=0:step=1:at=completion", "needs an index"),
        ("kill:rank=0:step=1:at=completion=1", "only to raise"),
        ("kill:rank=0:step=1:code=3", "only to exit"),
        ("kill:rank=0:step=1:color=red", "unknown field"),
        ("kill:rank=0:rank=1:step=1", "given twice"),
        ("kill:rank0:step=1", "expected key=value"),
        ("exit:rank=0:step=1:code=300", "<= 255"),
        ("raise:rank=0:step=4:at=pause", "cannot be injected into a pause"),
    ],
)
def test_malformed(text, reason):
    with pytest.raises(FaultSpecError, match=reason):
        parse_fault(text)


def test_a_fault_at_a_pause():
    spec = parse_fault("kill:rank=2:step=5:at=pause")
    assert spec.at == "pause" and str(spec) == "kill:rank=2:step=5:at=pause"


def test_rank_outside_world():
    with pytest.raises(FaultSpecError, match="does not exist"):
        parse_faults(["kill:rank=2:step=1"], world_size=2)


def test_step_optional_for_running_jobs():
    assert parse_fault("hang:rank=0", require_step=False).step is None


@given(
    kind=st.sampled_from(["kill", "exit", "raise", "hang"]),
    rank=st.integers(0, 4096),
    step=st.integers(0, 10**9),
    at=st.one_of(
        st.sampled_from(["forward", "backward", "optimizer", "boundary"]),
        st.integers(0, 999).map(lambda k: f"collective={k}"),
    ),
    code=st.integers(1, 255),
)
def test_text_round_trip(kind, rank, step, at, code):
    spec = FaultSpec(kind, rank, step, at, code if kind == "exit" else 1)
    assert parse_fault(str(spec)) == spec
    assert FaultSpec.from_json(spec.to_json()) == spec


def test_a_planned_resize_names_the_world_and_the_step():
    spec = parse_fault("resize:world=2:step=5")
    assert (spec.kind, spec.world, spec.step, spec.at) == ("resize", 2, 5, "boundary")
    assert str(spec) == "resize:world=2:step=5"
    assert FaultSpec.from_json(spec.to_json()) == spec
    assert parse_faults(["resize:world=3:step=1"], world_size=3)[0].world == 3


@pytest.mark.parametrize("text, reason", [
    ("resize:step=5", "missing world=N"),
    ("resize:world=2", "missing step=S"),
    ("resize:world=0:step=5", "world must be >= 1"),
    ("resize:world=2:step=0", "step must be >= 1"),
    ("resize:world=2:step=5:rank=1", "unknown field 'rank'"),
])  # fmt: skip
def test_malformed_resizes(text, reason):
    with pytest.raises(FaultSpecError, match=reason):
        parse_fault(text)


def test_an_added_node_names_its_step_only():
    spec = parse_fault("add-node:step=7")
    assert (spec.kind, spec.step, spec.at) == ("add-node", 7, "boundary")
    assert str(spec) == "add-node:step=7" and parse_fault(str(spec)) == spec
    assert parse_faults(["add-node:step=7"], world_size=2) == [spec]
    with pytest.raises(FaultSpecError, match="add-node takes step=S"):
        parse_fault("add-node:step=7:rank=1")
    with pytest.raises(FaultSpecError, match="missing step=S"):
        parse_fault("add-node")


def test_a_resize_beyond_the_launch_size_is_refused():
    with pytest.raises(FaultSpecError, match="larger than the launch's world size 2"):
        parse_faults(["resize:world=3:step=2"], world_size=2)
