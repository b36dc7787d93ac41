"""A worker's container's init: ``python -m xmig.container.entry SCRIPT ARGS...`` runs the
script in this very process, PID 1 of the container's PID namespace."""

from __future__ import annotations

import os
import signal
import sys


def become_init() -> None:
    """PID 1 of a PID namespace gets only the signals it handles (and SIGKILL, SIGSTOP from
    outside): a SIGTERM, its agent's stop, ends it at once as it would end any process."""
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, lambda signum, _frame: os._exit(128 + signum))


def main() -> None:
    from xmig.agent.spare import run_script

    if len(sys.argv) < 2:
        sys.exit("usage: python -m xmig.container.entry SCRIPT [ARGS...]")
    become_init()
    run_script(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
