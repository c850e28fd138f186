"""Shipping the user's own modules (those next to the pipeline file) to Spark's workers.

A pipeline file may import helper modules from its folder; functions from them are pickled
by reference, so every Python worker must be able to import them too, on this machine or on
a cluster's executors. The folder's top-level ``.py`` files and packages are zipped and added
with ``SparkContext.addPyFile`` (what ``spark-submit --py-files`` does). They cannot shadow
Onceflow's own modules: those all live under ``onceflow.``.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from typing import TYPE_CHECKING

from onceflow.kernel.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MAX_SHIPPED_BYTES = 50 << 20
_SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".venv", "venv", "node_modules", "build"})
_shipped: set[tuple[int, str]] = set()


def user_modules(folder: str) -> list[tuple[str, str]]:
    """``(path, name in the zip)`` of the folder's top-level modules and packages."""
    found: list[tuple[str, str]] = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.startswith(".") or entry in _SKIPPED_DIRS:
            continue
        if os.path.isfile(path) and entry.endswith(".py"):
            found.append((path, entry))
        elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
            for root, dirs, files in os.walk(path):
                dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith(".")]
                for name in files:
                    if name.endswith(".py"):
                        full = os.path.join(root, name)
                        found.append((full, os.path.relpath(full, folder)))
    return found


def ship_code(session: SparkSession, folder: str) -> str | None:
    """Zip the folder's modules and add them to every worker's path; return the zip's path."""
    key = (id(session), os.path.abspath(folder))
    if key in _shipped:
        return None
    files = user_modules(folder)
    if not files:
        return None
    size = sum(os.path.getsize(p) for p, _ in files)
    if size > MAX_SHIPPED_BYTES:
        msg = (
            f"the modules next to the pipeline file ({folder}) hold {size:,} bytes, more than "
            f"{MAX_SHIPPED_BYTES:,}: move the pipeline file to a folder of its own"
        )
        raise ConfigError(msg)
    target = os.path.join(tempfile.mkdtemp(prefix="onceflow-code-"), "user_modules.zip")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, name in files:
            zf.write(path, name)
    session.sparkContext.addPyFile(target)
    _shipped.add(key)
    return target
