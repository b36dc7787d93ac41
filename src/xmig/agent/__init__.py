"""The node agent: spawns, watches and stops the workers of one node."""
