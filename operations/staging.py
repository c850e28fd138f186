"""Leftovers of file sinks: staged files no rename will ever take (part of ``onceflow gc``).

A file sink stages each delivery under ``<sink folder>/_onceflow_staging/<sink partition>/``
and renames the files into place at commit (see :mod:`onceflow.connectors.staged`). An
attempt killed before its rename leaves its staged files behind; the next attempt of the same
sink partition deletes them, but a partition that never runs again (fewer partitions, a sink
removed, a pipeline stopped for good) keeps them. GC deletes staged files older than an age
(an hour by default) — far longer than any delivery takes to commit. Deleting a file a paused
attempt still meant to rename is safe too: its rename fails, and the retry writes the delivery
again (the commit protocol never trusts a staged file).

The folders are those the namespace lists (the driver adds its file sinks' at every
exactly-once start); GC clears those it can see from where it runs (local disks of a one-host
deployment, or a shared mount).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

DEFAULT_STAGING_AGE_S = 3600.0


@dataclass
class Cleared:
    """What one pass did to the staging folders."""

    files: int = 0
    bytes: int = 0
    unseen: int = 0  # listed folders this host cannot see


def listed_folders(raw: str | None) -> list[str]:
    """The staging folders a namespace lists (its meta field; absent: none)."""
    if not raw:
        return []
    folders = json.loads(raw)
    return [f for f in folders if isinstance(f, str)]


def clear_staging(
    folders: list[str], older_than_s: float, dry_run: bool, now: float | None = None
) -> Cleared:
    """Delete staged files last written more than ``older_than_s`` ago; empty folders too."""
    cutoff = (time.time() if now is None else now) - older_than_s
    out = Cleared()
    for folder in folders:
        if not os.path.isdir(folder):
            out.unseen += 1
            continue
        for entry in os.scandir(folder):
            if entry.is_dir(follow_symlinks=False):
                _clear_partition(entry.path, cutoff, dry_run, out)
    return out


def _clear_partition(path: str, cutoff: float, dry_run: bool, out: Cleared) -> None:
    left = 0
    for entry in os.scandir(path):
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # the next attempt settled it meanwhile
            continue
        if not entry.is_file(follow_symlinks=False) or st.st_mtime >= cutoff:
            left += 1
            continue
        out.files += 1
        out.bytes += st.st_size
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        else:
            left += 1
    # an empty folder goes once nothing touched it for the age too (a pass that deleted its
    # files touched it): a writer between creating it and staging into it is never surprised
    if not left and not dry_run:
        with contextlib.suppress(OSError):  # gone, or not empty any more
            if os.stat(path).st_mtime < cutoff:
                os.rmdir(path)
