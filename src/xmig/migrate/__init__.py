"""Moving a rank's process to another node: the CRIU wrapper and the CUDA checkpoint API
wrapper the agents use.

The protocol (pause every rank at a step boundary, checkpoint the moving rank on its node,
restore it on the target node, rejoin on a new generation's communicator) is driven by the
coordinator (``xmig.coord.migration``), carried out by the agents and, on the worker side, by
``xmig.session``. A process with GPU state has its GPU memory checkpointed into host memory
before the dump and restored (onto the target node's GPU) after the restore; on simulated
hosts a rank's own network interface moves with it (``netif``).
"""

from xmig.migrate.criu import CriuError, criu_status, dump, find_criu, restore

__all__ = ["CriuError", "criu_status", "dump", "find_criu", "restore"]
