"""The worker side of xmig, by role: what ``xmig.session`` runs inside a training process.

- ``context``: what the parts share (environment, process groups, link, position, state lock)
- ``groups``: every process group of the worker (the world and those the script makes), each
  a proxy of its own; which a recovery rebuilds and which it keeps
- ``phase``: the worker's phases and the one table of transitions between them
- ``backend``: the ``xmig`` c10d backend, the job's store and the communicators built on it
- ``registry``: the objects a script registers (the state a replacement pulls)
- ``hooks``: fault-injection hooks, and the optimizer's update under the state lock
- ``loop``: the step loop behind ``session.steps()``
- ``orders``: the one dispatcher of the coordinator's orders (on the link's reader thread)
- ``trouble``: a failed collective, sticky CUDA errors, the watchdog
- ``survivor``: a survivor's recovery (park, position, rebuild, serve, replay or roll back)
- ``replacement``: a replacement's join (receive, check, load, match DDP)
- ``pull``: state served and received over a pair communicator, checked against its digest
- ``layout``: DDP's bucket layout as this rank knows it
- ``verify``: the replicas' checksum after a recovery
- ``migration``: prepare, pause at a boundary, be moved, rejoin
- ``parking``: a moving rank's tensors in a shared memory file while its process moves
- ``errors``: the worker's exceptions and its immediate exit
"""
