"""The move-pairs benchmark's own logic (``bench/move_pairs.py``): variants as written on its
command line, the ABBA order, and each move paired with the baseline's nearest."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import move_pairs  # noqa: E402


def test_a_variant_as_written():
    variant = move_pairs.parse_variant(
        ["before", "src=/tmp/old/src", "env:XMIG_NCCL_WAKE=1", "env:A=b=c",
         "sysctl:fs.pipe-max-size=4194304", "remove=/run/criu.kdat", "remove=/run/x"]
    )  # fmt: skip
    assert variant.name == "before" and variant.src == "/tmp/old/src"
    assert variant.env == {"XMIG_NCCL_WAKE": "1", "A": "b=c"}
    assert variant.sysctl == {"fs.pipe-max-size": "4194304"}
    assert variant.remove == ("/run/criu.kdat", "/run/x")
    assert move_pairs.parse_variant(["now"]) == move_pairs.Variant("now")


@pytest.mark.parametrize(
    "tokens",
    [[], ["src=/x"], ["env:A=1"], ["a", "env:=1"], ["a", "env:A"], ["a", "src="], ["a", "what"],
     ["a", "sysctl:fs.x"]],
)  # fmt: skip
def test_a_bad_variant_is_refused(tokens):
    with pytest.raises(ValueError):
        move_pairs.parse_variant(tokens)


def test_abba_order():
    assert move_pairs.abba_order(["a", "b", "c"], 2) == list("abccbaabccba")
    assert move_pairs.abba_order(["a"], 1) == ["a", "a"]


def test_each_move_against_the_nearest_baseline_move():
    order = move_pairs.abba_order(["a", "b", "c"], 1)  # a b c c b a
    downtime = {0: 1.0, 1: 2.0, 2: 3.0, 3: 6.0, 4: 4.0, 5: 2.0}
    moves = [{"variant": name, "downtime_s": downtime[i]} for i, name in enumerate(order)]
    moves.append({"variant": "b"})  # a failed move: nothing to pair
    ratios = move_pairs.paired_ratios(moves, "a")
    # b at 1 and c at 2 against a at 0; c at 3 and b at 4 against a at 5
    assert ratios == {"b": [2.0, 2.0], "c": [3.0, 3.0]}
    between = [{"variant": v, "downtime_s": t} for v, t in (("a", 1.0), ("b", 3.0), ("a", 2.0))]
    assert move_pairs.paired_ratios(between, "a") == {"b": [3.0]}  # a tie: the earlier
    assert move_pairs.paired_ratios([{"variant": "b", "downtime_s": 1.0}], "a") == {}


def test_a_record_flattened():
    record = {
        "downtime_s": 1.5,
        "image_bytes": 2e9,
        "phases": {"stop": 0.1, "dump": 0.5},
        "dump_steps": {"criu_dump": 0.4},
        "restore_steps": {"criu_restore": 0.3},
        "criu_dump_stats": {"frozen_s": 0.35},
        "criu_restore_stats": {"restore_s": 0.25},
    }
    row = move_pairs.flatten(record)
    assert row == {"downtime_s": 1.5, "image_gb": 2.0, "stop": 0.1, "dump": 0.5,
                   "dump.criu_dump": 0.4, "restore.criu_restore": 0.3, "dump.frozen_s": 0.35,
                   "restore.restore_s": 0.25}  # fmt: skip
