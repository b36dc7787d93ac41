"""``xmig run`` and the rest of the command line."""
