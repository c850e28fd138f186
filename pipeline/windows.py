"""Event-time windows for ``Stream.window`` (see :mod:`onceflow.kernel.windows`)."""

from onceflow.kernel.windows import (
    Accumulation,
    Fixed,
    Global,
    Late,
    Pane,
    Sessions,
    Sliding,
    Timing,
    Trigger,
    WindowFn,
)

__all__ = [
    "Accumulation",
    "Fixed",
    "Global",
    "Late",
    "Pane",
    "Sessions",
    "Sliding",
    "Timing",
    "Trigger",
    "WindowFn",
]
