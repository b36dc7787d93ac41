"""The worker's exceptions, and its way out when it cannot go on."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


class XmigError(RuntimeError):
    """A misuse of xmig's worker API, with what to do about it."""


class RecoveryFailed(RuntimeError):
    """This worker could not take part in a recovery; the job stops."""


def exit_now(code: int) -> NoReturn:
    """End the process at once (no exit handlers: a finished rank's would wait to be
    released), the lines already logged written out first."""
    for handler in logging.getLogger("xmig").handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)
