"""Starting a pipeline over: delete its Redis namespace and its Spark checkpoint together.

A pipeline's progress has two halves, the namespace (what it did) and the checkpoint (which
input it read); one without the other is refused at start. ``onceflow reset`` deletes both,
after saying what it will delete; it refuses while a driver of the namespace is running (its
heartbeat, :mod:`onceflow.runtime.driver.heartbeat`, is in Redis) unless forced.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.scopes import Connect, Scopes, read_scopes, tag_client
from onceflow.operations.gc import DEFAULT_DELETE_BATCH, DEFAULT_SCAN_COUNT, scan_steps
from onceflow.runtime.driver.heartbeat import running_driver
from onceflow.runtime.driver.rescale import scopes_reach


@dataclass
class ResetReport:
    """What a reset deleted (or, in a dry run, would delete)."""

    namespace: str
    keys: int
    checkpoint: str | None
    checkpoint_deleted: bool
    driver: dict[str, Any] | None = None  # a driver that says it runs the namespace


def reset(
    client: Any,
    namespace: str,
    checkpoint: str | None,
    *,
    dry_run: bool = False,
    scan_count: int = DEFAULT_SCAN_COUNT,
    delete_batch: int = DEFAULT_DELETE_BATCH,
    connect: Connect | None = None,
    force: bool = False,
) -> ResetReport:
    """Delete every key of ``namespace`` and the local ``checkpoint`` folder.

    The partition scopes go first and the namespace's own tag (its meta, which names the
    scopes) last, so a reset that stops halfway can be run again. ``connect`` gives a
    scope's client (on a Redis Cluster); without it ``client`` serves every tag. A running
    driver of the namespace makes it refuse, unless ``force``.
    """
    home = Keyspace(namespace)
    driver = running_driver(client, home)
    if driver is not None and not dry_run and not force:
        raise ConfigError(running_message(namespace, driver))
    keys = 0
    stored = read_scopes(client, home)  # with the scopes a rescale cut short may have made
    scopes = Scopes(namespace, stored.stages, scopes_reach(client, home))
    for ks in [*scopes.partition_keyspaces(), home]:
        scoped = tag_client(client, ks, connect)
        for step in scan_steps(scoped, ks.pattern(), scan_count):
            keys += len(step)
            if not dry_run:
                for start in range(0, len(step), delete_batch):
                    scoped.unlink(*step[start : start + delete_batch])
    deleted = False
    if checkpoint:
        parsed = urlparse(checkpoint)
        if parsed.scheme not in ("", "file"):
            msg = (
                f"checkpoint {checkpoint} is not a local folder: delete it with your storage's "
                "tools (hdfs dfs -rm -r, aws s3 rm --recursive ...), then run reset without it"
            )
            raise ConfigError(msg)
        path = parsed.path if parsed.scheme == "file" else checkpoint
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
            deleted = True
    return ResetReport(namespace, keys, checkpoint, deleted, driver)


def running_message(namespace: str, driver: dict[str, Any]) -> str:
    """Why a reset is refused while a driver runs, and what to do."""
    who = f"process {driver.get('pid', '?')} on {driver.get('host', '?')}"
    return (
        f"a driver of namespace {namespace!r} is running ({who}, driver epoch "
        f"{driver.get('epoch', '?')}): resetting under it would mix its writes with a new "
        "start. Stop it first (Ctrl-C or SIGTERM); if it is gone for good (its machine was "
        "lost), its heartbeat expires within 30 s, or pass --force"
    )
