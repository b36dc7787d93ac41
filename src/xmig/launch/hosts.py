"""Simulated hosts: one network namespace per node, on one machine, joined by a bridge.

``xmig run --simulate-hosts`` gives every node's agent (and so its workers) a network
namespace of its own with its own address on a private /24; the coordinator listens on the
bridge's address in the launcher's namespace, reachable from all of them. Only the network
namespace changes (not the mount namespace), so processes stay checkpointable with CRIU.
Needs root and iproute2's ``ip``; everything is removed when the job ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xmig.migrate import netif

NETNS_DIR = Path("/run/netns")
INNER_IFNAME = "xmig0"  # the node's interface, the same name in every namespace
CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 20.0
RANK_ADDRESS_BASE = 100  # rank r's own interface has the subnet's address 100 + r


class HostSetupError(RuntimeError):
    """The simulated hosts could not be created (not root, no ``ip``, a failing command)."""


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise HostSetupError(
            f"`ip {' '.join(args)}` did not finish in {IP_TIMEOUT_S:.0f} s"
        ) from None
    if done.returncode != 0:
        raise HostSetupError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def enter_netns(path: str) -> Callable[[], None]:
    """A ``preexec_fn`` that moves the child into the network namespace at ``path``."""

    def enter_namespace() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns({path}) failed")
        finally:
            os.close(fd)

    return enter_namespace


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, from the driver's /proc entries (no CUDA needed)."""
    folder = Path("/proc/driver/nvidia/gpus")
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def check_can_simulate() -> None:
    """Raise HostSetupError saying why simulated hosts are impossible here, if they are."""
    if os.geteuid() != 0:
        raise HostSetupError("--simulate-hosts needs root: it creates network namespaces")
    if shutil.which("ip") is None:
        raise HostSetupError(
            "--simulate-hosts needs the `ip` command (Debian: apt install iproute2)"
        )


def _free_subnet(seed: str) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface of this machine uses, chosen from ``seed``."""
    used = []
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        parts = line.split()
        if "inet" in parts:
            used.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    start = int(hashlib.sha256(seed.encode()).hexdigest(), 16)
    for offset in range(4096):
        value = (start + offset) % (200 * 256)
        subnet = ipaddress.ip_network(f"10.{value // 256 + 40}.{value % 256}.0/24")
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise HostSetupError("no free 10.x.y.0/24 subnet for the simulated hosts")


@dataclass
class SimulatedHosts:
    """The namespaces of one job: node ``k`` lives in ``namespace(k)`` at ``address(k)``."""

    job_id: str
    count: int
    gpus_per_node: int = 1
    subnet: ipaddress.IPv4Network | None = None
    created: list[str] = field(default_factory=list)  # namespaces, to remove
    bridge: str = ""

    @property
    def tag(self) -> str:
        return hashlib.sha256(self.job_id.encode()).hexdigest()[:5]

    def namespace(self, node: int) -> str:
        return f"xmig-{self.tag}-n{node}"

    def address(self, node: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + node + 2)

    @property
    def bridge_address(self) -> str:
        """Where the coordinator listens: reachable from every node's namespace."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def rank_address(self, rank: int) -> str:
        """The address of rank ``rank``'s own interface (it moves with the rank)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + RANK_ADDRESS_BASE + rank)

    def create(self, ranks: list[int] | None = None) -> SimulatedHosts:
        """Make the namespaces, and for ``ranks[r]`` (the node of rank ``r``) each rank's
        interface in its node's namespace."""
        ranks = ranks or []
        if RANK_ADDRESS_BASE + len(ranks) > 254 or self.count + 2 > RANK_ADDRESS_BASE:
            raise HostSetupError(
                f"simulated hosts take at most {RANK_ADDRESS_BASE - 2} nodes and "
                f"{254 - RANK_ADDRESS_BASE} ranks (one /24), not {self.count} and {len(ranks)}"
            )
        check_can_simulate()
        self.subnet = _free_subnet(self.job_id)
        prefix = self.subnet.prefixlen
        self.bridge = f"xmb{self.tag}"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/{prefix}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in range(self.count):
                self._make_node(node)
            for rank, node in enumerate(ranks):
                inner, outer = netif.rank_interface(rank), f"xmr{self.tag}r{rank}"
                namespace = self.namespace(node)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns",
                    namespace)  # fmt: skip
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip("-n", namespace, "addr", "add", f"{self.rank_address(rank)}/{prefix}",
                    "dev", inner)  # fmt: skip
                _ip("-n", namespace, "link", "set", inner, "up")
        except BaseException:
            self.remove()
            raise
        return self

    def _make_node(self, node: int) -> None:
        assert self.subnet is not None
        prefix = self.subnet.prefixlen
        namespace, outer = self.namespace(node), f"xmv{self.tag}n{node}"
        _ip("netns", "add", namespace)
        self.created.append(namespace)
        _ip("link", "add", outer, "type", "veth", "peer", "name", INNER_IFNAME,
            "netns", namespace)  # fmt: skip
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{self.address(node)}/{prefix}", "dev",
            INNER_IFNAME)  # fmt: skip
        _ip("-n", namespace, "link", "set", INNER_IFNAME, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        # a process moved here (CRIU) brings sockets bound to its old node's address
        _ip("netns", "exec", namespace, "sh", "-c",
            "echo 1 > /proc/sys/net/ipv4/ip_nonlocal_bind")  # fmt: skip

    def add_node(self, node: int) -> None:
        """One more node (``xmig scale --add-node``), on the same bridge."""
        if self.subnet is None or not self.bridge:
            raise HostSetupError("the simulated hosts were not created")
        if node + 2 >= RANK_ADDRESS_BASE:
            raise HostSetupError(f"simulated hosts take at most {RANK_ADDRESS_BASE - 2} nodes")
        if self.namespace(node) in self.created:
            raise HostSetupError(f"node {node} exists already")
        self._make_node(node)
        self.count = max(self.count, node + 1)

    def enter(self, node: int) -> Callable[[], None]:
        """A ``preexec_fn`` that moves the child into node ``node``'s network namespace."""
        return enter_netns(str(NETNS_DIR / self.namespace(node)))

    def environment(self, node: int) -> dict[str, str]:
        """What a process in node ``node``'s namespace needs: the interface its communication
        libraries must use (gloo and NCCL would otherwise pick by host name) and, on a GPU
        machine, the GPUs of that node (in turn, ``gpus_per_node`` each), unless the user
        chose them. NCCL is told that each node is a host of its own, so that it talks
        between them over the node's network as between real hosts: its same-host transports
        would pass handles over Unix sockets, which do not cross network namespaces."""
        env = {"GLOO_SOCKET_IFNAME": INNER_IFNAME, "NCCL_SOCKET_IFNAME": INNER_IFNAME,
               netif.NETNS_ENV: self.namespace(node)}  # fmt: skip
        gpus = gpu_count()
        if gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
            first = node * self.gpus_per_node
            visible = [str((first + i) % gpus) for i in range(self.gpus_per_node)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        if gpus:
            defaults = {"NCCL_HOSTID": self.namespace(node), "NCCL_IB_DISABLE": "1"}
            env.update({k: v for k, v in defaults.items() if k not in os.environ})
        return env

    def remove(self) -> None:
        """Delete the namespaces (their veth pairs go with them) and the bridge."""
        for namespace in self.created:
            with contextlib.suppress(HostSetupError):
                _ip("netns", "del", namespace)
        self.created.clear()
        if self.bridge:
            with contextlib.suppress(HostSetupError):
                _ip("link", "del", self.bridge)
            self.bridge = ""
