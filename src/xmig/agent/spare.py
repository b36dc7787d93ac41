"""A hot spare: an interpreter with torch already loaded, waiting to become a worker.

The agent starts it ahead of need (``python -m xmig.agent.spare``). It imports what every
worker imports (torch, torch.distributed, DDP, the optimizers and the compiler stack the
optimizers pull in lazily, xmig's worker side), writes one byte to the file descriptor
``XMIG_SPARE_READY_FD``, and waits for one JSON line on stdin: the worker's environment, its
script, arguments and working directory. Then it runs the script as ``__main__`` in this very
process, so a replacement starts in milliseconds instead of seconds.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

READY_FD = "XMIG_SPARE_READY_FD"


def warm_up(cuda: bool = True) -> None:
    """Import what a worker imports; with ``cuda``, also initialise CUDA where there is a GPU
    (a zygote must not: a process that did cannot fork)."""
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    # the first optimizer imports torch's compiler stack (about a second)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    if cuda and torch.cuda.is_available():
        torch.cuda.init()
    import xmig.session  # noqa: F401


def main() -> None:
    from xmig.container.entry import become_init

    become_init()
    warm_up()
    ready = os.environ.pop(READY_FD, None)
    if ready is not None:
        os.write(int(ready), b"1")
        os.close(int(ready))
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)  # the agent no longer needs this spare
    order = json.loads(line)
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the worker's stdin for its whole life)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    run_script(order["script"], order["args"])


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` with ``args`` as ``__main__`` in this process, as ``python script``
    would."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
