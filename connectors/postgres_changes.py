"""PostgreSQL's row changes as a stream, without Kafka: a logical replication slot per pipeline.

``sources.PostgresChanges(["public.users"], conninfo=...)`` reads the tables' existing rows
first (a *snapshot*), then every insert, update, delete and truncate committed after it, as
:class:`~onceflow.kernel.changes.Change` records (the same records as Debezium's through
``KafkaSource(format="debezium")``).

**How.** At the first run the source creates a publication of the tables and a logical
replication slot (``pgoutput``) through a replication connection, exporting the snapshot the
slot starts from; the first micro-batch reads the tables under that snapshot (so the snapshot
and the changes after it meet exactly at the slot's start). Each later micro-batch is a range
of the log, ``[start, end)`` in LSNs, fixed in Spark's checkpoint before it runs: its task
reads the transactions whose commit lies in the range with
``pg_logical_slot_peek_binary_changes`` (peeking: the slot is not consumed), so a retry or a
replay after a crash reads the same changes. Only once Spark has committed a micro-batch (its
outputs durable) is the slot advanced past it (``pg_replication_slot_advance``), which lets
PostgreSQL recycle that log. A micro-batch ends at the server's flushed log position: a commit
below it is durable and decodable, never skipped by a batch planned too early.

**IDs.** A change's ID is its table, key, operation and place (the commit's LSN, the
transaction and the change's number in it): a replay reads the same IDs. A snapshot's row is
identified by its table, key and row. The first micro-batch replayed after a crash (the
exported snapshot died with the run) reads a new snapshot, while the slot still starts where
the first one did: no change is lost, an unchanged row is a copy, a row changed in between is
read in its new state besides its changes being streamed, one deleted in between is not read
again (its delete is streamed). The slot is made when missing
and never dropped by a run: a new checkpoint finds an old slot of the same name and reads on
from where it stands, nothing lost (``pg_drop_replication_slot`` it to start over).

**What it needs.** ``wal_level=logical``; a user with the ``REPLICATION`` attribute (or a
superuser) who may create the publication (or one created beforehand, named ``publication=``,
that publishes the tables); tables with a primary key (or a replica identity) for their
updates and deletes to be published. A slot keeps the log from its position on: a pipeline
stopped for long makes PostgreSQL keep that log (drop the slot, ``onceflow reset``, to let go).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import SourceCapabilities, SourceConnector
from onceflow.connectors.decoded import Decoded, Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.file_stream import RANGE_COLUMNS
from onceflow.connectors.pgoutput import SNAPSHOT_PREFIX, lsn_text, value_of
from onceflow.connectors.pgoutput import Decoder as Messages
from onceflow.connectors.postgres_table import connect
from onceflow.kernel import changes, ids
from onceflow.kernel.changes import Change
from onceflow.kernel.records import Record

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

FETCH_ROWS = 5000  # rows per round trip of a server-side cursor
PEEK = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
    "'proto_version', '1', 'publication_names', %s)"
)
_NAME = re.compile(r"[^a-z0-9_]")


def slot_name(pipeline: str) -> str:
    """The default slot and publication name of a pipeline: ``onceflow_<pipeline>``."""
    return ("onceflow_" + _NAME.sub("_", pipeline.lower()))[:63]


class PostgresChanges(SourceConnector):
    """Row changes of PostgreSQL tables, read through a logical replication slot.

    ``tables``: ``schema.table`` names (``public`` when no schema is given); ``conninfo`` and
    ``connection`` as for :class:`~onceflow.connectors.postgres.PostgresSink` (the password in
    ``PGPASSWORD`` or ``connection={"password": ...}``, never printed); ``slot`` and
    ``publication``: their names (default ``onceflow_<pipeline>``); ``snapshot``: read the
    tables' existing rows first (default) or only the changes after the slot's creation;
    ``max_batch_bytes``: the most log a micro-batch covers.
    """

    bounded = False

    def __init__(  # noqa: PLR0913 - each is a setting users name
        self,
        tables: str | Sequence[str],
        *,
        conninfo: str = "",
        connection: dict[str, Any] | None = None,
        slot: str | None = None,
        publication: str | None = None,
        snapshot: bool = True,
        max_batch_bytes: int = 64 << 20,
    ) -> None:
        names = [tables] if isinstance(tables, str) else list(tables)
        if not names:
            msg = "PostgresChanges needs at least one table"
            raise ConnectorError(msg)
        self.tables = [t if "." in t else f"public.{t}" for t in names]
        self.conninfo = conninfo
        self.connection = dict(connection or {})
        self.slot = slot
        self.publication = publication
        self.snapshot = snapshot
        self.max_batch_bytes = max_batch_bytes

    def describe(self) -> str:
        """One line for plans (never the password)."""
        return f"postgres changes {','.join(self.tables)} (slot {self.slot or '<pipeline>'})"

    def capabilities(self) -> SourceCapabilities:
        """Its task reads the range; a replayed snapshot may read other rows (content IDs)."""
        return SourceCapabilities(
            reads_in_task=True, stable_partitions=False, python_data_source=True
        )

    def connect_db(self, **extra: Any) -> Any:
        """A new connection (psycopg 3) with the source's settings; one line if it fails."""
        return connect(self.conninfo, self.connection, self.describe(), **extra)

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Name the slot and publication; check the server and tables; create the publication."""
        if not streaming:
            msg = "PostgresChanges is a stream: run the pipeline as a streaming run"
            raise ConnectorError(msg)
        self.slot = self.slot or slot_name(pipeline)
        self.publication = self.publication or self.slot
        with self.connect_db(autocommit=True) as conn:
            level = conn.execute("SHOW wal_level").fetchone()[0]
            if level != "logical":
                msg = (
                    f"PostgreSQL runs with wal_level={level}: change data capture needs "
                    "wal_level=logical (postgresql.conf, then a restart of the server)"
                )
                raise ConnectorError(msg)
            for table in self.tables:
                if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
                    msg = f"PostgreSQL has no table {table!r} (PostgresChanges reads it)"
                    raise ConnectorError(msg)
            ensure_publication(conn, self.publication, self.tables)

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """One range row per micro-batch: the snapshot, or a range of the log.

        The password goes in an option of its own, which Spark redacts wherever it shows
        options (``spark.redaction.regex``).
        """
        from onceflow.connectors.postgres_changes_reader import FORMAT, register

        register(session)
        connection = dict(self.connection)
        password = connection.pop("password", None)
        config = {
            "conninfo": self.conninfo,
            "connection": connection,
            "slot": self.slot,
            "publication": self.publication,
            "snapshot": self.snapshot,
            "max_batch_bytes": self.max_batch_bytes,
            "describe": self.describe(),
        }
        reader = session.readStream.format(FORMAT).option("config", json.dumps(config))
        if password is not None:
            reader = reader.option("password", password)
        return reader.load()

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Range rows to the changes they hold, read here in the task."""
        reading = _Reading(self, source, with_ids)

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            columns = batch.to_pydict()
            rows = zip(*(columns[c] for c in RANGE_COLUMNS), strict=True)
            for topic, _part, lo, hi in rows:
                if topic.startswith(SNAPSHOT_PREFIX):
                    yield from reading.snapshot(topic.removeprefix(SNAPSHOT_PREFIX))
                else:
                    yield from reading.log(int(lo), int(hi))

        return decode


def ensure_publication(conn: Any, name: str, tables: list[str]) -> None:
    """The publication of ``tables``: created if missing, else checked to publish them."""
    found = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,)).fetchone()
    if found is None:
        import psycopg

        listed = ", ".join(_quoted(t) for t in tables)
        try:
            conn.execute(f"CREATE PUBLICATION {_quoted(name)} FOR TABLE {listed}")
        except psycopg.Error as exc:
            first = str(exc).strip().splitlines()[0]
            msg = (
                f"cannot create the publication {name!r} ({first}): create it as the tables' "
                f"owner (CREATE PUBLICATION {name} FOR TABLE {', '.join(tables)}) and pass "
                "publication=, or grant the user ownership of the tables"
            )
            raise ConnectorError(msg) from None
        return
    published = {
        f"{schema}.{table}"
        for schema, table in conn.execute(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (name,)
        ).fetchall()
    }
    missing = [t for t in tables if t not in published]
    if missing:
        msg = (
            f"publication {name!r} does not publish {', '.join(missing)}: "
            f"ALTER PUBLICATION {name} ADD TABLE {', '.join(missing)}"
        )
        raise ConnectorError(msg)


def _quoted(name: str) -> str:
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


class _Reading:
    """What a source stage's task reads: a snapshot or a range of the log (picklable)."""

    def __init__(self, source: PostgresChanges, stage: str, with_ids: bool) -> None:
        self.source, self.stage, self.with_ids = source, stage, with_ids
        self.lane = f"postgres:{source.slot}"

    def record(self, change: Change, size: int) -> Record:
        rid = ids.from_user_key(changes.change_id(change)) if self.with_ids else b""
        printed = changes.content_print(change) if self.with_ids else 0
        return Record(rid, change.ts_ms, change, self.lane, None, False, size, printed)

    def log(self, lo: int, hi: int) -> Iterator[Record]:
        """The changes of transactions committed in ``[lo, hi)``, peeked from the slot."""
        messages = Messages()
        with self.source.connect_db() as conn, conn.cursor(name="onceflow_peek") as cur:
            cur.itersize = FETCH_ROWS
            cur.execute(PEEK, (self.source.slot, lsn_text(hi), self.source.publication))
            sizes: list[int] = []

            def raw() -> Iterator[bytes]:
                for (data,) in cur:
                    sizes.append(len(data))
                    yield data

            for change in messages.changes(raw(), lo, hi):
                yield self.record(change, sizes[-1])

    def snapshot(self, name: str) -> Iterator[Record]:
        """Every row of the tables as the exported snapshot ``name`` saw them (a new one: "")."""
        with self.source.connect_db() as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                if name:
                    conn.execute(f"SET TRANSACTION SNAPSHOT '{name}'")
            except Exception as exc:  # noqa: BLE001 - one line for a snapshot gone
                msg = (
                    f"the snapshot {name} of slot {self.source.slot} is gone (its run stopped "
                    f"while the task ran; the next start takes a new one): {exc}"
                )
                raise ConnectorError(msg) from None
            now = int(conn.execute("SELECT extract(epoch FROM now()) * 1000").fetchone()[0])
            for table in self.source.tables:
                yield from self._table(conn, table, now)
            conn.rollback()

    def _table(self, conn: Any, table: str, ts_ms: int) -> Iterator[Record]:
        columns, types, keys = table_columns(conn, table)
        listed = ", ".join(f'"{c}"::text' for c in columns)
        with conn.cursor(name="onceflow_snapshot") as cur:
            cur.itersize = FETCH_ROWS
            cur.execute(f"SELECT {listed} FROM {_quoted(table)}")  # noqa: S608 - quoted names
            for values in cur:
                row = {c: value_of(v, t) for c, v, t in zip(columns, values, types, strict=True)}
                key = {k: row[k] for k in keys} if keys else None
                change = Change(changes.READ, table, key, None, row, ts_ms, "snapshot")
                yield self.record(change, sum(len(v) for v in values if v is not None))


def table_columns(conn: Any, table: str) -> tuple[list[str], list[int], list[str]]:
    """A table's columns, their type OIDs and its primary key's columns, in order."""
    found = conn.execute(
        "SELECT a.attname, a.atttypid::int, coalesce(a.attnum = ANY(i.indkey), false) "
        "FROM pg_attribute a LEFT JOIN pg_index i "
        "ON i.indrelid = a.attrelid AND i.indisprimary "
        "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped "
        "ORDER BY a.attnum",
        (table,),
    ).fetchall()
    return [c for c, _, _ in found], [t for _, t, _ in found], [c for c, _, k in found if k]
