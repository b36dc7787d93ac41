"""Moving a rank's process to another node (CRIU, CUDA checkpoint API).

Not built yet: there is no ``xmig migrate`` command, and ``migrate`` is not a fault kind
(``--inject migrate:…`` is refused as an unknown kind).
"""
