"""PostgreSQL changes as a Spark Python data source, on the driver: the slot and the offsets.

An offset is ``{"snapshot": 0 or 1, "lsn": n}``: whether the snapshot was read, and where in
the log the micro-batches so far end (0: at the slot's start). The first micro-batch of a
pipeline with ``snapshot=True`` is the snapshot alone, ``{"snapshot": 0, ...}`` to
``{"snapshot": 1, "lsn": 0}``; the slot is created (when missing) through a replication
connection that exports the slot's starting snapshot, kept open (the snapshot lives as long as
it does) until Spark commits the micro-batch. A restart finds the snapshot gone and has the
task take a new one, the slot kept (see :mod:`.postgres_changes`). Later micro-batches end at the
server's flushed log position (at most ``max_batch_bytes`` past their start); Spark's commit
of one advances the slot to its end. This module imports PySpark; the source imports it when
a stream starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.datasource import range_row
from onceflow.connectors.kafka.worker import RANGE_SCHEMA
from onceflow.connectors.pgoutput import SNAPSHOT_PREFIX, lsn_text, parse_lsn
from onceflow.connectors.postgres_table import connect

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

FORMAT = "onceflow_postgres_changes"
_registered: set[int] = set()


def register(session: SparkSession) -> None:
    """Make the format known to ``session`` (once)."""
    if id(session) not in _registered:
        session.dataSource.register(PostgresChangesDataSource)
        _registered.add(id(session))


class PostgresChangesDataSource(DataSource):
    """``spark.readStream.format("onceflow_postgres_changes").option("config", json)``."""

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return FORMAT

    def schema(self) -> str:
        """One range row per micro-batch."""
        return RANGE_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:  # noqa: N802 - Spark's name
        """The micro-batch reader."""
        config = json.loads(self.options["config"])
        if "password" in self.options:
            config["connection"]["password"] = self.options["password"]
        return SlotReader(config)


class SlotReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets from the slot and the server's log; the snapshot's replication connection."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.slot: str = config["slot"]
        self.snapshot: bool = config["snapshot"]
        self.max_batch_bytes: int = config["max_batch_bytes"]
        self.exporting: Any = None  # the replication connection holding the snapshot
        self.snapshot_name: str | None = None
        self.target: int | None = None  # availableNow: where the log ended at the start

    # -- offsets --------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        """Where a query with no offsets yet starts: the snapshot, then the slot's start.

        Spark asks this at every start of a query, with offsets in its checkpoint or not: so
        the slot is made here when missing (exporting its starting snapshot), and an existing
        one is never dropped. A slot left by an earlier checkpoint of the same name is read
        from where it stands (nothing lost; ``pg_drop_replication_slot`` it to start over).
        """
        if not self._slot_exists():
            self._new_slot(export=self.snapshot)
        return {"snapshot": 0 if self.snapshot else 1, "lsn": 0}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        """Remember where the log ends now: the query stops there."""
        self.target = self._flushed()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802
        """The snapshot alone first; then up to the flushed log (capped)."""
        if not start.get("snapshot"):
            return {"snapshot": 1, "lsn": 0}
        lo = int(start.get("lsn", 0)) or self._slot_start()
        end = self._flushed()
        if self.target is not None:
            end = min(end, self.target)
        end = min(end, lo + self.max_batch_bytes)
        return {"snapshot": 1, "lsn": max(end, int(start.get("lsn", 0)))}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        """The snapshot, or the log range ``[start, end)``.

        The snapshot is the slot's exported one while this reader holds it; planned again
        after a restart (the export died with the run) it is a new one, taken by the task: the
        slot, kept, still starts before it, so no change is lost, and a row that changed in
        between is read in its new state as well as streamed.
        """
        if end.get("snapshot") and not (start or {}).get("snapshot"):
            self._slot_start()  # the slot is still there
            name = self.snapshot_name if self.exporting is not None else None
            return [InputPartition((SNAPSHOT_PREFIX + (name or ""), 0, 0, 0))]
        lo, hi = int((start or {}).get("lsn", 0)), int(end.get("lsn", 0))
        if hi <= lo:
            return []
        return [InputPartition((self.slot, 0, lo, hi))]

    def commit(self, end: dict[str, int]) -> None:
        """Spark committed the micro-batches up to ``end``: release the snapshot, advance."""
        if end.get("snapshot"):
            self._release()
        lsn = int(end.get("lsn", 0))
        if lsn:
            self._advance(lsn)

    def stop(self) -> None:
        """The query stops: let the snapshot go."""
        self._release()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The range itself: the source stage's task reads it (see ``PostgresChanges.decoder``)."""
        topic, part, lo, hi = partition.value
        return iter([range_row(topic, part, lo, hi)])

    # -- the server -----------------------------------------------------------------------

    def _flushed(self) -> int:
        with self._connect(autocommit=True) as conn:
            return parse_lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])

    def _slot_start(self) -> int:
        """Where the slot stands (its confirmed position): the stream's first range starts."""
        with self._connect(autocommit=True) as conn:
            row = conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (self.slot,),
            ).fetchone()
        if row is None or row[0] is None:
            msg = (
                f"the replication slot {self.slot!r} is gone: the changes since the last "
                "micro-batch cannot be read. Start the pipeline over (onceflow reset) to take "
                "a new snapshot"
            )
            raise ConnectorError(msg)
        return parse_lsn(row[0])

    def _connect(self, **extra: Any) -> Any:
        config = self.config
        return connect(config["conninfo"], config["connection"], config["describe"], **extra)

    def _slot_exists(self) -> bool:
        with self._connect(autocommit=True) as conn:
            return (
                conn.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
                ).fetchone()
                is not None
            )

    def _new_slot(self, export: bool) -> None:
        """The slot made, through a replication connection kept open if it exports a snapshot."""
        self._release()
        conn = self._connect(autocommit=True, replication="database")
        mode = "export" if export else "nothing"
        command = f"CREATE_REPLICATION_SLOT {self.slot} LOGICAL pgoutput (SNAPSHOT '{mode}')"
        result = conn.pgconn.exec_(command.encode())
        if result.status != 2:  # noqa: PLR2004 - PGRES_TUPLES_OK
            error = (result.error_message or b"").decode().strip()
            conn.close()
            msg = f"cannot create the replication slot {self.slot!r}: {error}"
            raise ConnectorError(msg)
        if export:
            self.exporting = conn
            self.snapshot_name = result.get_value(0, 2).decode()
        else:
            conn.close()

    def _advance(self, lsn: int) -> None:
        """Move the slot to ``lsn`` (never back); a slot busy for now is advanced next time."""
        import psycopg

        with self._connect(autocommit=True) as conn:
            try:
                conn.execute(
                    "SELECT pg_replication_slot_advance(%s, %s::pg_lsn) "
                    "FROM pg_replication_slots WHERE slot_name = %s "
                    "AND confirmed_flush_lsn < %s::pg_lsn",
                    (self.slot, lsn_text(lsn), self.slot, lsn_text(lsn)),
                )
            except psycopg.errors.ObjectInUse:
                pass  # a straggling task peeks: the next commit advances it further

    def _release(self) -> None:
        conn, self.exporting, self.snapshot_name = self.exporting, None, None
        if conn is not None and not conn.closed:
            conn.close()
