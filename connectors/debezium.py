"""Debezium's change events as :class:`~onceflow.kernel.changes.Change` records.

Debezium (on Kafka Connect) writes one event per row change, keyed by the row's primary key;
its value is an envelope ``{"before", "after", "source", "op", "ts_ms", "transaction"}``
(wrapped as ``{"schema", "payload"}`` when the converter writes schemas, the default). This
module reads an envelope already decoded by the source's codec (JSON, or Avro through a schema
registry) into a ``Change``, and says what identifies it:

- a change streamed from the database's log is identified by its place in that log (PostgreSQL:
  the change's LSN and transaction id; MySQL: binlog file, position and row; SQL Server: the
  change and commit LSNs and the event's serial number; other connectors: the ``source`` block
  but for its version and clock fields), its table, key and operation. A connector that
  restarts re-sends the changes after its last flushed offset with the same places: copies.
- a snapshot's row (``op`` ``r``) is identified by its table, key and row: a snapshot begun
  again after a restart reads its rows again at another log position, and an unchanged row
  read twice is a copy; a row that changed in between is a new fact.

The envelope's own ``ts_ms`` (when the connector handled the event) differs between a change
and its re-sent copy, so it is neither in the ID nor in the content checksum that tells an ID
conflict from a copy. Debezium's tombstones (a ``None`` value after each delete, for log
compaction) carry nothing the delete did not: the source skips them.
"""

from __future__ import annotations

import json
from typing import Any

from onceflow.kernel import changes
from onceflow.kernel.changes import Change, change_id, change_time, content_print

__all__ = ["OPS", "change_id", "change_time", "content_print", "to_change", "unwrap"]

OPS = {
    "c": changes.INSERT,
    "u": changes.UPDATE,
    "d": changes.DELETE,
    "r": changes.READ,
    "t": changes.TRUNCATE,
    "m": changes.MESSAGE,
}
# Where each connector's events sit in the database's log (the ``source`` fields).
_PLACES = {
    "postgresql": ("lsn", "txId"),
    "mysql": ("file", "pos", "row", "gtid"),
    "mariadb": ("file", "pos", "row", "gtid"),
    "sqlserver": ("change_lsn", "commit_lsn", "event_serial_no"),
}
# ``source`` fields that differ between an event and its re-sent copy, or between versions.
_UNSTABLE = frozenset(("version", "ts_us", "ts_ns", "snapshot", "sequence"))


def unwrap(document: Any) -> Any:
    """The payload of a ``{"schema", "payload"}`` document (JsonConverter with schemas)."""
    if isinstance(document, dict) and len(document) == 2 and "payload" in document:
        if "schema" in document:
            return document["payload"]
    return document


def to_change(key: Any, value: Any) -> Change:
    """The change a decoded Debezium event stands for; ValueError says why it is none."""
    event = unwrap(value)
    if not isinstance(event, dict) or "op" not in event:
        found = sorted(event)[:6] if isinstance(event, dict) else type(event).__name__
        msg = (
            f"not a Debezium change event (found {found}, expected before, after, source, op): "
            "read the topic without format='debezium', or leave the connector's "
            "ExtractNewRecordState transform off"
        )
        raise ValueError(msg)
    op = OPS.get(event["op"])
    if op is None:
        msg = f"unknown Debezium operation {event['op']!r} (known: {', '.join(OPS)})"
        raise ValueError(msg)
    source = event.get("source") or {}
    if not isinstance(source, dict):
        msg = f"a Debezium event's source is a {type(source).__name__}, not an object"
        raise ValueError(msg)  # noqa: TRY004 - a dead letter's reason, not a type error
    where = (source.get("schema") or source.get("db"), source.get("table"))
    table = ".".join(str(p) for p in where if p)
    ts = source.get("ts_ms", event.get("ts_ms"))
    if not isinstance(ts, int) or isinstance(ts, bool):
        msg = f"a Debezium event without a commit time (source.ts_ms is {ts!r})"
        raise ValueError(msg)
    transaction = (event.get("transaction") or {}).get("id") or source.get("txId")
    key = unwrap(key)
    return Change(
        op,
        table,
        key if isinstance(key, dict) or key is None else {"key": key},
        event.get("before"),
        event.get("after"),
        ts,
        _position(source),
        None if transaction is None else str(transaction),
    )


def _position(source: dict[str, Any]) -> str:
    """Where the event is in its database's log, as text (see the module docstring)."""
    fields = _PLACES.get(str(source.get("connector")))
    if fields is not None:
        return ",".join(f"{f}={source.get(f)}" for f in fields)
    stable = {k: v for k, v in source.items() if k not in _UNSTABLE}
    return json.dumps(stable, sort_keys=True, separators=(",", ":"), default=str)
