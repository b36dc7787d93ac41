"""Moving a rank's process to another node (CRIU, CUDA checkpoint API).

Not available yet: ``xmig run`` refuses migration requests with a clear error.
"""
