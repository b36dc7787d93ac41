"""Moving a rank's process to another node: the CRIU wrapper the agents use.

The protocol itself (pause every rank at a step boundary, checkpoint the moving rank on its
node, restore it on the target node, rejoin on a new generation's communicator) is driven by
the coordinator (``xmig.coord.migration``), carried out by the agents and, on the worker side,
by ``xmig.session``. Processes holding GPU state (the CUDA driver's checkpoint API) are not
moved yet.
"""

from xmig.migrate.criu import CriuError, criu_status, dump, find_criu, restore

__all__ = ["CriuError", "criu_status", "dump", "find_criu", "restore"]
