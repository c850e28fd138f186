"""Onceflow's kernel: what every layer shares, importing nothing of Onceflow's above it.

Errors, the record codec, record IDs and shapes, durations, connection settings, and the
commit protocol's two halves that every layer must agree on: the Redis keyspace (built and
parsed in :mod:`~onceflow.kernel.keyspace`) and the Lua script registry
(:mod:`~onceflow.kernel.scripts`).
"""
