"""The agent's decisions that need no processes."""

import pytest

from xmig.agent.agent import spare_may_start


@pytest.mark.parametrize(
    ("cores", "workers", "spares", "starting", "expected"),
    [
        (2, 2, 1, True, False),  # a small node: the spare waits for the workers
        (2, 2, 1, False, True),  # ... and starts once they are up
        (32, 2, 3, True, True),  # a GPU node: spares warm up beside the starting workers
        (16, 8, 1, True, False),  # 8 workers on 16 cores: no room beside them
        (18, 8, 1, True, True),
    ],
)
def test_spare_warms_up_beside_starting_workers_only_where_cores_allow(
    cores, workers, spares, starting, expected
):
    assert spare_may_start(cores, workers, spares, starting) is expected
