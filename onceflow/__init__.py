"""Onceflow's kernel: what every layer shares.

Errors, the record codec, record IDs and the Redis keyspace live here, below every other
package, so that ``pipeline`` -> ``graph_optimizer`` -> ``backup``/``dedup``/``connectors``
can all use them without importing upwards.
"""

from __future__ import annotations

__version__ = "0.1.0"
