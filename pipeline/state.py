"""Per-key state and timers for ``Stream.process`` (see :mod:`onceflow.runtime.user_state`).

Declare state as specs and pass them to ``process(..., states=[...])``::

    from onceflow.state import BagSpec, ValueSpec

    COUNT = ValueSpec[int]("count")
    RECENT = BagSpec[float]("recent")
"""

from onceflow.runtime.user_state import (
    BagSpec,
    BagState,
    CombiningSpec,
    CombiningState,
    Context,
    MapSpec,
    MapState,
    StateSpec,
    Timer,
    Timers,
    TimestampedValue,
    ValueSpec,
    ValueState,
)

__all__ = [
    "BagSpec",
    "BagState",
    "CombiningSpec",
    "CombiningState",
    "Context",
    "MapSpec",
    "MapState",
    "StateSpec",
    "Timer",
    "Timers",
    "TimestampedValue",
    "ValueSpec",
    "ValueState",
]
