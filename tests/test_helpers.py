"""The tests' own shortcut: a fault-free reference is shared only between jobs that differ in
options that cannot change their numbers."""

from helpers import DEMO, FAST, PATTERNS, reference_args


def test_pacing_options_are_dropped_and_everything_else_is_kept() -> None:
    launch = ["--nproc-per-node", "2", "--hot-spares", "1", "--heartbeat-interval", "0.5"]
    paced = [*launch, str(DEMO), "--preset", "tiny", "--steps", "16", "--step-sleep", "0.3",
             "--quiet"]  # fmt: skip
    plain = ["--nproc-per-node", "2", str(DEMO), "--preset", "tiny", "--steps", "16"]
    assert reference_args(paced) == reference_args(plain) == [*FAST, *plain]
    # what changes the numbers stays apart: the world, the steps, the script's own options
    assert reference_args(["--nproc-per-node", "3", *plain[2:]]) != reference_args(plain)
    assert reference_args([*plain[:-1], "17"]) != reference_args(plain)
    patterns = ["--nproc-per-node", "2", str(PATTERNS), "--pattern", "scheduler"]
    assert reference_args([*patterns, "--slow-backward"]) == [*FAST, *patterns]


def test_a_script_of_its_own_keeps_its_options() -> None:
    """Another script's ``--step-sleep`` may mean something else: only DEMO's and PATTERNS'
    are known to be sleeps."""
    args = ["--nproc-per-node", "2", "/tmp/worker.py", "--step-sleep", "0.3", "--quiet"]
    assert reference_args(args) == [*FAST, *args]
