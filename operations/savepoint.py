"""Savepoints: a stopped pipeline's whole state to files, and back, anywhere.

``onceflow savepoint create`` writes, while the pipeline is stopped and nothing is in flight,
every key of its namespace (the namespace's own hash tag and every partition scope: keyed
state, timers, windows, seen-IDs within the horizon, Bloom snapshots, counters, the batch
clock, source lanes, settings and plan) and a copy of its Spark checkpoint (the source
positions) into a new folder. ``onceflow savepoint restore`` writes them back, into the same
namespace or another, on the same Redis or another (a Redis Cluster too), beside a copy of the
checkpoint where the restored pipeline will keep it. The restored pipeline continues where the
savepoint was taken, exactly once: copies of records it had counted are still dropped, and a
run of the original pipeline after the savepoint, if there was one, is not the restored one's
history (its outputs are written again, with the same IDs: a downstream Onceflow drops them).

Format (version 1), a folder:

* ``manifest.json``: ``format`` ("onceflow-savepoint"), ``version``, ``namespace``,
  ``created_ms``, ``acked`` (the last acknowledged micro-batch), ``parallelism``,
  ``scoped_stages``, ``records``, ``keys`` and ``sha256`` (of ``redis.msgpack``);
* ``redis.msgpack``: MessagePack arrays, one after the other: ``[scope, name, type, data,
  first]`` — ``scope`` the partition scope of the key ('' for the namespace's own tag),
  ``name`` the key after ``of:{<tag>}:``, ``type`` one of ``string``, ``hash``, ``zset``,
  ``list``, ``data`` bytes, ``[[field, value], ...]``, ``[[member, score], ...]`` or ``[item,
  ...]``, and ``first`` 1 on a key's first record: a big key takes several records, in order.
  Nothing is pickled;
* ``checkpoint/``: the Spark checkpoint folder as it was.

Left out: the driver's heartbeat, a rescale's lock, and backups of acknowledged micro-batches
(garbage). A savepoint is written to ``<folder>.partial-<pid>`` and renamed when whole, so a
create killed midway leaves no savepoint. A restore copies the checkpoint first (with a file
``onceflow-restoring`` in it), then every key but the namespace's settings, then the settings
(a namespace without them is one no run resumes: the checkpoint's identity would be refused),
then removes the file; a restore killed midway is run again and starts over (or, killed after
the settings, only removes the file). Restored into another namespace (a copy beside the
original), the pipeline gets a new run identity, in its settings and its checkpoint, so that
its sinks' delivery marks are never taken for the original's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import msgpack

from onceflow.backup.store import acknowledged
from onceflow.dedup.durability import DEFAULT_TIMEOUT_MS
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.keyspace import Keyspace, Kind
from onceflow.kernel.scopes import Connect, Scopes, distinct, read_scopes
from onceflow.kernel.store import store_for
from onceflow.runtime.driver.checkpoint import IDENTITY_FILE
from onceflow.runtime.driver.pinning import CHECKPOINT_FIELD, IDENTITY_FIELD
from onceflow.runtime.driver.rescale_checks import (
    refuse_unfinished,
    underway,
    wait_for_driver,
)

FORMAT = "onceflow-savepoint"
VERSION = 1
MANIFEST = "manifest.json"
DATA = "redis.msgpack"
CHECKPOINT = "checkpoint"
RESTORING = "onceflow-restoring"
_STEP = 1000  # SCAN count, and fields per record of a big key
_SKIPPED = {Kind.DRIVER, Kind.RESCALE}


@dataclass
class SavepointReport:
    """What a savepoint holds (or a restore wrote)."""

    namespace: str
    folder: str
    keys: int
    records: int
    seconds: float


def _local(path: str, what: str) -> str:
    parsed = urlparse(path)
    if parsed.scheme not in ("", "file"):
        msg = (
            f"{what} {path} is not a local folder: savepoints copy local checkpoints only "
            "(copy it with your storage's tools into a local folder first)"
        )
        raise ConfigError(msg)
    return parsed.path if parsed.scheme == "file" else path


def create(
    client: Any,
    namespace: str,
    folder: str,
    checkpoint: str,
    *,
    connect: Connect | None = None,
) -> SavepointReport:
    """Write a stopped pipeline's state and checkpoint to the new folder ``folder``."""
    started = time.monotonic()
    home = Keyspace(namespace)
    tag = connect if connect is not None else (lambda _t: client)
    scopes = read_scopes(client, home)
    if scopes.parallelism < 1:
        msg = f"namespace {namespace!r} holds no pipeline (nothing to save)"
        raise ConfigError(msg)
    if underway(client, home) is not None:
        msg = f"a rescale of namespace {namespace!r} was cut short: finish it first"
        raise ConfigError(msg)
    wait_for_driver(client, home, 0.0, False, lambda _line: None, what="savepoint")
    refuse_unfinished(client, home, tag, scopes, what="create the savepoint")
    source = _local(checkpoint, "checkpoint")
    if not os.path.isdir(source):
        msg = f"checkpoint {checkpoint} does not exist: give the pipeline's --checkpoint"
        raise ConfigError(msg)
    if os.path.exists(folder):
        msg = f"{folder} exists: a savepoint goes to a new folder"
        raise ConfigError(msg)
    partial = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    acked = acknowledged(client, home)
    keys = records = 0
    digest = hashlib.sha256()
    with open(os.path.join(partial, DATA), "wb") as out:
        for ks in scopes.keyspaces():
            for record in _records(tag(ks.tag), ks, acked):
                blob = msgpack.packb(record, use_bin_type=True)
                out.write(blob)
                digest.update(blob)
                records += 1
                keys += record[4]
        out.flush()
        os.fsync(out.fileno())
    shutil.copytree(source, os.path.join(partial, CHECKPOINT))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "namespace": namespace,
        "created_ms": int(time.time() * 1000),
        "acked": acked,
        "parallelism": scopes.parallelism,
        "scoped_stages": sorted(scopes.stages),
        "records": records,
        "keys": keys,
        "sha256": digest.hexdigest(),
    }
    _write_json(os.path.join(partial, MANIFEST), manifest)
    os.rename(partial, folder)
    return SavepointReport(namespace, folder, keys, records, time.monotonic() - started)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _records(client: Any, ks: Keyspace, acked: int) -> Iterator[list[Any]]:
    """The records of one hash tag's keys (the last field: 1 on a key's first record)."""
    scope = ks.scope or ""
    head = len(ks.root) + 1
    for raw in client.scan_iter(match=ks.pattern(), count=_STEP):
        name = raw.decode()
        q = ks.parse(name)
        if q is not None and (
            q.kind in _SKIPPED or (q.kind is Kind.BACKUP and (q.batch or 0) <= acked)
        ):
            continue
        first = 1
        for kind, data in _contents(client, name):
            yield [scope, name[head:], kind, data, first]
            first = 0


def _contents(client: Any, key: str) -> Iterator[tuple[str, Any]]:
    kind = client.type(key).decode()
    if kind == "string":
        yield kind, client.get(key)
    elif kind == "hash":
        cursor = 0
        while True:
            cursor, found = client.hscan(key, cursor, count=_STEP)
            if found:
                yield kind, [[f, v] for f, v in found.items()]
            if cursor == 0:
                return
    elif kind == "zset":
        for start in range(0, int(client.zcard(key)), _STEP):
            chunk = client.zrange(key, start, start + _STEP - 1, withscores=True)
            yield kind, [[m, s] for m, s in chunk]
    elif kind == "list":
        for start in range(0, int(client.llen(key)), _STEP):
            yield kind, client.lrange(key, start, start + _STEP - 1)
    elif kind != "none":  # gone since the scan
        msg = f"{key} is a Redis {kind}, which Onceflow does not write; this is an Onceflow bug"
        raise ConfigError(msg)


def read_manifest(folder: str) -> dict[str, Any]:
    """A savepoint's manifest, checked (format, version, the data's checksum)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as fh:
            manifest: dict[str, Any] = json.load(fh)
    except (OSError, ValueError) as exc:
        msg = f"{folder} is not a savepoint ({MANIFEST}: {exc})"
        raise ConfigError(msg) from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        msg = (
            f"{folder} holds a savepoint of format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this Onceflow reads {FORMAT!r} version {VERSION}"
        )
        raise ConfigError(msg)
    digest = hashlib.sha256()
    with open(os.path.join(folder, DATA), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != manifest.get("sha256"):
        msg = f"{folder}/{DATA} does not match its manifest's checksum: the savepoint is damaged"
        raise ConfigError(msg)
    return manifest


def restore(
    client: Any,
    folder: str,
    namespace: str,
    checkpoint: str,
    *,
    connect: Connect | None = None,
) -> SavepointReport:
    """Write a savepoint into ``namespace`` (empty) and its checkpoint to ``checkpoint``."""
    started = time.monotonic()
    manifest = read_manifest(folder)
    home = Keyspace(namespace)
    tag = connect if connect is not None else (lambda _t: client)
    target = _local(checkpoint, "checkpoint")
    scopes = Scopes(namespace, frozenset(manifest["scoped_stages"]), manifest["parallelism"])
    if client.exists(home.meta):
        if os.path.exists(os.path.join(target, RESTORING)):  # cut short after the settings
            os.remove(os.path.join(target, RESTORING))
            return SavepointReport(namespace, folder, 0, 0, time.monotonic() - started)
        msg = (
            f"namespace {namespace!r} holds a pipeline: restore into another namespace, or "
            f"delete it first (onceflow reset --namespace {namespace} --checkpoint CHECKPOINT)"
        )
        raise ConfigError(msg)
    _place_checkpoint(os.path.join(folder, CHECKPOINT), target)
    for ks in scopes.keyspaces():  # what a restore cut short wrote
        tagged = tag(ks.tag)
        for raw in list(tagged.scan_iter(match=ks.pattern(), count=_STEP)):
            tagged.unlink(raw)
    meta: list[list[Any]] = []
    keys = records = 0
    with open(os.path.join(folder, DATA), "rb") as fh:
        for record in msgpack.Unpacker(fh, raw=False, use_list=True, strict_map_key=False):
            scope, name = record[0], record[1]
            ks = Keyspace(namespace, scope or None)
            if not scope and name == Kind.META.value:
                meta.append(record)
                continue
            _write(tag(ks.tag), f"{ks.root}:{name}", record[2], record[3])
            records += 1
            keys += record[4]
    identity = None
    if namespace != manifest["namespace"]:  # a copy beside the original: its own identity
        identity = uuid.uuid4().hex
        with open(os.path.join(target, IDENTITY_FILE), "w", encoding="utf-8") as fh:
            fh.write(identity + "\n")
        with contextlib.suppress(FileNotFoundError):  # Hadoop's checksum of the old text
            os.remove(os.path.join(target, f".{IDENTITY_FILE}.crc"))
    for _ks, master in distinct([(ks, tag(ks.tag)) for ks in scopes.keyspaces()]):
        if store_for(master).waitaof(DEFAULT_TIMEOUT_MS) is False:
            msg = f"Redis did not confirm its fsync within {DEFAULT_TIMEOUT_MS // 1000} s"
            raise ConfigError(msg)
    for record in meta:  # last: a namespace without its settings is resumed by no run
        _write(client, home.meta, record[2], _moved_meta(record[3], checkpoint, identity))
    os.remove(os.path.join(target, RESTORING))
    return SavepointReport(
        namespace, folder, keys + 1, records + len(meta), time.monotonic() - started
    )


def _place_checkpoint(source: str, target: str) -> None:
    """Copy the savepoint's checkpoint to ``target`` (marked as being restored until the end)."""
    if os.path.exists(target):
        if not os.path.exists(os.path.join(target, RESTORING)):
            msg = (
                f"checkpoint {target} exists: give the restored pipeline a new --checkpoint "
                "(or delete that one)"
            )
            raise ConfigError(msg)
        shutil.rmtree(target)  # a restore cut short: start over
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    with open(os.path.join(partial, RESTORING), "w", encoding="utf-8") as fh:
        fh.write("a savepoint is being restored here; its namespace is not whole yet\n")
    os.rename(partial, target)


def _moved_meta(pairs: list[list[Any]], checkpoint: str, identity: str | None) -> list[list[Any]]:
    """The settings, with the checkpoint's new place (and a new identity, if given)."""
    new = {CHECKPOINT_FIELD.encode(): checkpoint.encode()}
    if identity is not None:
        new[IDENTITY_FIELD.encode()] = identity.encode()
    return [[f, v] for f, v in pairs if f not in new] + [[f, v] for f, v in new.items()]


def _write(client: Any, key: str, kind: str, data: Any) -> None:
    if kind == "string":
        client.set(key, data)
    elif kind == "hash":
        client.hset(key, mapping=dict(data))
    elif kind == "zset":
        client.zadd(key, {m: s for m, s in data})
    elif kind == "list":
        client.rpush(key, *data)
    else:
        msg = f"a savepoint record of type {kind!r} for {key}: the savepoint is damaged"
        raise ConfigError(msg)
