import atexit
import os
import signal
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


LONG = os.environ.get("XMIG_LONG_TESTS") == "1"


def _stopped(signum, _frame):
    """pytest stopped from outside (a timeout's SIGTERM): the jobs its tests started end too,
    where they would go on in sessions of their own."""
    from helpers import kill_started_jobs

    kill_started_jobs()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: a wider sample of a matrix CI covers in part (XMIG_LONG_TESTS=1 runs it)"
    )
    signal.signal(signal.SIGTERM, _stopped)
    from helpers import kill_started_jobs

    atexit.register(kill_started_jobs)


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    skip = pytest.mark.skip(reason="a long matrix's wider sample: XMIG_LONG_TESTS=1 runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
