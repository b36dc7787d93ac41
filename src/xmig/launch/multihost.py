"""One launcher per host: the rendezvous endpoint, the job's id and its token.

Every host runs ``xmig run --nnodes N --node-rank I --rdzv-endpoint HOST:PORT --rdzv-id JOB``
(as under torchrun); node rank 0 hosts the coordinator at HOST:PORT, the others join it.

The token: each host derives it from a secret the user gives every host and the job's id,
``HMAC-SHA256(secret, "xmig job " + rdzv_id)``. The secret comes from ``--token-file FILE``
(owner-only: a Kubernetes Secret mounted with mode 0400, or a file in the user's home that a
Slurm allocation's hosts share) or from ``XMIG_SECRET`` (a Secret's key as an environment
variable; ``srun`` passes the submitter's environment on). Deriving it per job keeps one
cluster-wide secret usable for many jobs: a host started with another job's id cannot join
this job by mistake, and a job's token (in its job file, for ``xmig status``) is not the
secret itself. A token derived from the job's id alone could be guessed by anyone who can read
a process list, so a secret is required.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket
import stat
import time
from pathlib import Path

SECRET_ENV = "XMIG_SECRET"
RESOLVE_INTERVAL_S = 1.0
MIN_SECRET_CHARS = 16
RDZV_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class MultiHostError(ValueError):
    """A multi-host option that cannot work; the message is the line to print."""


def check_rdzv_id(text: str) -> str:
    """The job's id as every host names it (also its folder's name)."""
    if not RDZV_ID.fullmatch(text):
        raise MultiHostError(
            f"--rdzv-id must be 1-64 letters, digits, '.', '_' or '-' (not first), got {text!r}"
        )
    return text


def read_secret(token_file: Path | None) -> str:
    """The secret every host of the job holds: ``token_file``'s content, or ``XMIG_SECRET``."""
    if token_file is not None:
        try:
            info = token_file.stat()
            text = token_file.read_text().strip()
        except OSError as exc:
            raise MultiHostError(f"cannot read --token-file {token_file}: {exc}") from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise MultiHostError(
                f"--token-file {token_file} is readable by others (mode "
                f"{stat.S_IMODE(info.st_mode):03o}): make it owner-only (chmod 600; a "
                "Kubernetes Secret volume: defaultMode 0400)"
            )
        where = f"--token-file {token_file}"
    else:
        text = os.environ.get(SECRET_ENV, "").strip()
        where = SECRET_ENV
        if not text:
            raise MultiHostError(
                f"a job on several hosts needs a secret every host holds: --token-file FILE or "
                f"{SECRET_ENV} (e.g. `openssl rand -hex 32`)"
            )
    if len(text) < MIN_SECRET_CHARS:
        raise MultiHostError(f"the secret in {where} is too short: at least "
                             f"{MIN_SECRET_CHARS} characters")  # fmt: skip
    return text


def job_token(secret: str, rdzv_id: str) -> str:
    """The job's token: what every host derives from the secret and the job's id."""
    return hmac.new(secret.encode(), f"xmig job {rdzv_id}".encode(), hashlib.sha256).hexdigest()


def parse_endpoint(text: str, within: float = 0.0) -> tuple[str, int]:
    """``--rdzv-endpoint HOST:PORT`` as (the address HOST resolves to, PORT); a name that
    does not resolve yet (a pod's, until it has an address) is tried again for ``within``
    seconds."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise MultiHostError(f"--rdzv-endpoint must be HOST:PORT with a port 1..65535, got "
                             f"{text!r}")  # fmt: skip
    try:
        ipaddress.ip_address(host)
        return host, int(port_text)
    except ValueError:
        pass
    deadline = time.monotonic() + within
    while True:
        try:
            found = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
            return str(found[0][4][0]), int(port_text)
        except OSError as exc:
            if time.monotonic() + RESOLVE_INTERVAL_S > deadline:
                waited = f" (tried for {within:.0f} s)" if within else ""
                raise MultiHostError(f"--rdzv-endpoint: cannot resolve {host!r}: "
                                     f"{exc}{waited}") from None  # fmt: skip
            time.sleep(RESOLVE_INTERVAL_S)


def address_towards(host: str, port: int) -> str:
    """This machine's address on the way to ``host`` (where a coordinator of another host
    than node 0's listens, for the others to reach it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))  # no packet: it only picks the route
        except OSError as exc:
            raise MultiHostError(f"no route to {host}:{port}: {exc}") from None
        return str(probe.getsockname()[0])
