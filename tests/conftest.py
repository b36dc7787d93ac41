import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

MEASUREMENTS: list[str] = []


@pytest.fixture
def measure():
    """Record a measured number; all of them are printed at the end of the run."""
    return MEASUREMENTS.append


def pytest_terminal_summary(terminalreporter):
    if MEASUREMENTS:
        terminalreporter.section("xmig measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)
