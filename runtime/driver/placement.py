"""Whether a run's tasks may touch the driver's own disk: only when they run on its machine.

File connectors read and write with plain file I/O on the workers. In local mode the workers
are on the driver's machine; on a cluster each writes to its own disk, so a sink's parts
would be scattered and a source's files missing. Such a run is refused before it starts,
unless the connector says its path is shared (see :mod:`onceflow.connectors.files`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from onceflow.kernel.errors import ConfigError


def runs_on_one_machine(master: str) -> bool:
    """Whether every task of a session with this master runs on the driver's machine."""
    return master.startswith("local")


def check_paths(connectors: Iterable[Any], master: str | None) -> None:
    """Refuse a cluster run whose connectors use paths on the driver's own disk."""
    master = master or "local"
    if runs_on_one_machine(master):
        return
    for connector in connectors:
        paths = connector.local_paths()
        if not paths:
            continue
        msg = (
            f"{connector.describe()} uses {paths[0]} on each worker's own disk, "
            f"but master {master} runs tasks on other machines: its files would be scattered "
            "over (or missing from) them. Put the path on storage every machine mounts at the "
            "same place and pass shared=True (or list the folder in $ONCEFLOW_SHARED_DIRS), "
            "or run with --master local[N]"
        )
        raise ConfigError(msg)
