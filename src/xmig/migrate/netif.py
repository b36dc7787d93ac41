"""A rank's own network interface, which moves with the rank's process.

NCCL looks its network interfaces up once per process and keeps their addresses: a process
moved to another node would go on advertising its old node's address. So on simulated hosts
every rank gets an interface of its own (``xr<rank>``, a veth whose other end is on the
hosts' bridge) with an address of its own, and NCCL is told to use it; when the rank moves,
the interface moves into the target node's network namespace with it, keeping its address
and its MAC (the bridge end stays where it was), so the peers reach it as before.
"""

from __future__ import annotations

import os
import socket
import subprocess

IP_TIMEOUT_S = 20.0
NETNS_ENV = "XMIG_NETNS"  # the agent's network namespace's name, on simulated hosts


class InterfaceError(RuntimeError):
    """An ``ip`` command on a rank's interface failed."""


def rank_interface(rank: int) -> str:
    return f"xr{rank}"


def exists(name: str) -> bool:
    """Whether this process's network namespace has interface ``name``."""
    try:
        socket.if_nametoindex(name)
    except OSError:
        return False
    return True


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True,
                              timeout=IP_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InterfaceError(f"`ip {' '.join(args)}`: {exc}") from None
    if done.returncode != 0:
        raise InterfaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def address_of(name: str) -> str:
    """The IPv4 address (with its prefix length) of interface ``name`` here."""
    for line in _ip("-o", "-4", "addr", "show", "dev", name).splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1]
    raise InterfaceError(f"interface {name} has no IPv4 address")


def take(name: str, address: str, source_netns: str) -> None:
    """Move interface ``name`` from namespace ``source_netns`` into this process's (whose name
    is in ``XMIG_NETNS``) and give it ``address`` again (a move clears addresses)."""
    here = os.environ.get(NETNS_ENV)
    if not here:
        raise InterfaceError(f"{NETNS_ENV} is not set: this agent is not on a simulated host")
    _ip("-n", source_netns, "link", "set", name, "netns", here)
    _ip("addr", "add", address, "dev", name)
    _ip("link", "set", name, "up")
