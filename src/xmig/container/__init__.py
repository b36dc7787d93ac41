"""Container mode (``xmig run --container ROOTFS``): every worker in an OCI container of its own.

``rootfs`` checks a root filesystem and finds its Python; ``bundle`` builds a container's OCI
config from the job (pure); ``runc`` drives the runtime (run, kill, delete, checkpoint,
restore); ``process`` is a running container as an agent holds it: its init process (adopted:
the agent is the child subreaper), its output relayed, its state removed once it has ended.
"""
