"""``bench/soak.py``'s report: the demo's random jobs and the layouts' are counted apart."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import soak  # noqa: E402


def test_the_layouts_jobs_are_counted_apart_from_the_demos():
    demo = soak.Outcome("--nproc-per-node 2 kill:rank=1:step=2", "bit-identical", 10.0, 1,
                        {"faults": 1})  # fmt: skip
    mesh = soak.Outcome("hsdp --nproc-per-node 4 exit:rank=3:step=3", "bit-identical", 30.0, 2,
                        {"faults": 2, "mesh": "hsdp"})  # fmt: skip
    own = soak.Outcome("coordinator", "bit-identical", 20.0, 0)
    args = argparse.Namespace(seed=7, layout_cases=1)
    lines = soak.report([demo, mesh, own], None, args, "now", 60.0)
    text = "\n".join(lines)
    assert "## Outcomes: 3 runs, 3 as they must be" in text
    assert "Fault matrix: 1 random jobs (seed 7), 1 faults drawn in all; 1 recoveries." in text
    assert "Layouts: 1 random jobs of FSDP2's HSDP and TP by DP (seed 7), 2 faults" in text
    assert "| coordinator | bit-identical | 20.0 |" in text
