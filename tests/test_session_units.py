"""Small pure functions of the worker side."""

import os
import subprocess
import sys

import pytest

from xmig.session import is_sticky_cuda_error


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: an illegal memory access was encountered",
        "RuntimeError: CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
    ],
)
def test_sticky_cuda_errors_need_a_new_process(text):
    assert is_sticky_cuda_error(text)


@pytest.mark.parametrize(
    "text",
    [
        "NCCL error in: ProcessGroupNCCL.cpp, remote process exited or there was a network error",
        "Connection reset by peer",
        "injected communication error in allreduce on rank 1 (simulated ncclRemoteError)",
        "Watchdog caught collective operation timeout",
    ],
)
def test_communication_errors_are_retried_in_place(text):
    assert not is_sticky_cuda_error(text)


DDP_SCRIPT = """
import sys, torch
import xmig
from torch.nn.parallel import DistributedDataParallel
session = xmig.init()
trained, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
ddp = DistributedDataParallel(trained, process_group=session.process_group)
session.register(model={which})
try:
    for step in session.steps(1):
        pass
except xmig.XmigError as exc:
    print("refused:", exc)
    sys.exit(3)
print("found:", session._ctx.registry.ddp is ddp)
"""


@pytest.mark.parametrize("which, code, expected", [
    ("trained", 0, "found: True"),  # the bare module: its DDP is found
    ("ddp", 0, "found: True"),
    ("other", 3, "refused: session.register(model=...) got a module that no"),
])  # fmt: skip
def test_the_ddp_of_a_registered_module(tmp_path, which, code, expected):
    """A registered bare module is trained through the DDP that wraps it; a module no DDP
    wraps while the script trains with one is refused with what to pass."""
    script = tmp_path / "worker.py"
    script.write_text(DDP_SCRIPT.format(which=which))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XMIG_", "MASTER_"))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert expected in proc.stdout


UNFIRED_SCRIPT = """
import xmig
session = xmig.init()
for step in session.steps(2):
    pass
print("phase:", session.phase.value)
"""


@pytest.mark.parametrize("level, shown", [("INFO", True), ("ERROR", False)])
def test_worker_lines_go_to_stderr_with_the_xmig_prefix(tmp_path, level, shown):
    """Without an agent, a fault the loop never reaches is said on stderr, through the
    ``xmig`` logger at the level ``XMIG_LOG_LEVEL`` names."""
    script = tmp_path / "worker.py"
    script.write_text(UNFIRED_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XMIG_", "MASTER_"))}
    env["XMIG_INJECT"] = '[{"kind": "kill", "rank": 0, "step": 9, "at": "boundary"}]'
    env["XMIG_LOG_LEVEL"] = level
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "phase: finished" in proc.stdout
    line = "xmig: rank 0: faults never reached: kill:rank=0:step=9:at=boundary"
    assert (line in proc.stderr.splitlines()) is shown, proc.stderr


TWICE_SCRIPT = """
import xmig
session = xmig.init()
for step in session.steps(2):
    pass
try:
    for step in session.steps(2):
        pass
except xmig.XmigError as exc:
    print("refused:", exc)
"""


def test_a_second_step_loop_is_refused(tmp_path):
    """The step loop runs once per process: a second one would report the job done again."""
    script = tmp_path / "worker.py"
    script.write_text(TWICE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XMIG_", "MASTER_"))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "refused: session.steps() runs once per process" in proc.stdout
    assert "(it is finished)" in proc.stdout
