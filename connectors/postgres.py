"""PostgreSQL tables, exactly once: each delivery one database transaction with its marker.

In an exactly-once streaming run each delivery (see
:class:`~onceflow.connectors.base.TransactionalWriter`) inserts or upserts its rows and a row
of the delivery table (``onceflow_deliveries``: the delivery's marker) in one transaction, so
whether a delivery happened is a question the database answers: the marker row is there.

A writer's session is named (``application_name``) after its sink partition. A retry of the
partition first ends every other session under that name (``pg_terminate_backend``: an
attempt that is paused, not dead, can then never commit what it began) and waits until they
are gone; only then does it ask whether the interrupted delivery's marker is in the table. The
database user needs to be allowed to end its own sessions (any user can, for sessions of the
same user) and to create the delivery table once (or have it created for it).

The sink never creates or alters the user's table: it must exist before the run. A row is a
dict (or a dataclass) element; on a keyed stream the key fills the ``key_columns`` the
element lacks, else the ``key`` column unless the element has it. ``mode="upsert"`` updates
rows whose ``key_columns`` exist (the last of a delivery's rows for a key wins; on a keyed
stream a ``None`` element deletes the row its key names: ``(key, None)``, the key being the
one key column's value or a tuple of them) and needs a unique constraint (or primary key) on
exactly those columns; ``"insert"`` adds rows.
Before the run the table's columns, their types and its unique constraints are read
(:mod:`.postgres_table`): a missing table, key column or upsert constraint stops the run with
one line. Each value is fitted to its column's type (a
``datetime``, or epoch milliseconds, for a ``timestamptz``; any JSON value for ``jsonb`` ...);
a row with a column the table lacks or a value its column cannot take is a dead letter before
anything is sent. A row the server refuses (a constraint, a value out of range) is found by
trying the delivery's rows one by one, and becomes a dead letter; the rest go again. An error
that is no row's fault (a permission, a table changed under the run) fails the task.

The password is never part of what is printed: give it in ``PGPASSWORD`` or ``password=``
(``connection``), TLS settings (``sslmode`` ...) in the conninfo or ``connection``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

from onceflow.connectors import keyed_rows
from onceflow.connectors.base import (
    DeliveryMark,
    PoisonInTransaction,
    Rejected,
    SinkConnector,
    SinkWriter,
    TaskInfo,
    TransactionalWriter,
    element_row,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.keyed_rows import check_mode, keyed_row
from onceflow.connectors.postgres_table import TableShape, check_upsert, connect, read_table
from onceflow.kernel.records import Record

DELIVERIES = "onceflow_deliveries"
MODES = ("insert", "upsert")
SETTLE_TIMEOUT_S = 30.0


class PostgresSink(SinkConnector):
    """Rows into a PostgreSQL table (see the module docstring)."""

    def __init__(
        self,
        table: str,
        *,
        conninfo: str = "",
        mode: str = "insert",
        key_columns: Sequence[str] = (),
        connection: dict[str, Any] | None = None,
    ) -> None:
        check_mode("PostgresSink", mode, MODES, key_columns)
        self.table = table
        self.conninfo = conninfo
        self.mode = mode
        self.key_columns = tuple(key_columns)
        self.connection = dict(connection or {})
        self.shape: TableShape | None = None  # the table's columns and constraints (prepare)

    def describe(self) -> str:
        """One line for plans (never the password)."""
        return f"postgres {self.table} ({self.mode})"

    def connect_db(self, **extra: Any) -> Any:
        """A new connection (psycopg 3), with the sink's settings."""
        return connect(self.conninfo, self.connection, self.describe(), **extra)

    @property
    def columns(self) -> tuple[str, ...]:
        """The table's column names (read by :meth:`prepare`)."""
        return self.shape.names if self.shape is not None else ()

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Check the table (columns, upsert constraint); create the delivery table if missing."""
        with self.connect_db() as conn:
            shape = read_table(conn, self.table)
            if shape is None:
                msg = (
                    f"PostgreSQL has no table {self.table!r} (the sink does not create it: "
                    "CREATE TABLE it before the run)"
                )
                raise ConnectorError(msg)
            missing = [c for c in self.key_columns if c not in shape.names]
            if missing:
                msg = f"table {self.table!r} has no key column(s) {', '.join(missing)}"
                raise ConnectorError(msg)
            if self.mode == "upsert":
                check_upsert(shape, self.key_columns)
            self.shape = shape
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {DELIVERIES} ("
                "marker text PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())"
            )

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer for one task: transactional in an exactly-once run."""
        return PostgresWriter(self, task)


class PostgresWriter(TransactionalWriter):
    """One task's deliveries, each one database transaction (see the module docstring)."""

    keeps_marks = True

    def __init__(self, sink: PostgresSink, task: TaskInfo) -> None:
        self.sink = sink
        self.task = task
        self.token = uuid.uuid4().hex[:12]
        self.rows: list[tuple[Record, dict[str, Any]]] = []
        self.deliveries = 0
        self.in_transaction = False
        self._conn: Any = None

    @property
    def identity(self) -> str:
        """The session name of the sink partition's writers (63 bytes at most)."""
        digest = hashlib.blake2b(
            f"{self.task.pipeline}\0{self.task.sink}\0{self.task.partition}".encode(),
            digest_size=12,
        )
        return f"onceflow {digest.hexdigest()}"

    @property
    def conn(self) -> Any:
        """The writer's session (opened on first use, named after the sink partition)."""
        if self._conn is None:
            self._conn = self.sink.connect_db(application_name=self.identity, autocommit=False)
        return self._conn

    # -- rows ----------------------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Turn records into rows; one with a column the table does not have is refused."""
        rejected: list[Rejected] = []
        for rec in records:
            try:
                self.rows.append((rec, self._row(rec)))
            except (TypeError, ValueError) as exc:
                rejected.append((rec, f"cannot be a row of {self.sink.table}: {exc}"))
        return rejected

    def _row(self, rec: Record) -> dict[str, Any]:
        elem = rec.elem
        key: Any = None
        if self.task.keyed:
            key, elem = elem
            if elem is None:
                return delete_row(self.sink, key)
        row = element_row(elem)
        if row is None:
            msg = f"a row must be a dict or a dataclass, got {type(elem).__name__}"
            raise TypeError(msg)
        if self.task.keyed:
            row = keyed_row(row, key, self.sink.key_columns)
        unknown = [c for c in row if c not in self.sink.columns]
        if unknown:
            msg = f"no column(s) {', '.join(map(repr, unknown))}"
            raise ValueError(msg)
        assert self.sink.shape is not None  # read by the sink's prepare, on the driver
        return self.sink.shape.fit(row)

    # -- the transaction -----------------------------------------------------------------

    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Send the rows and the delivery's marker in the open transaction (not committed).

        The marker is ``<pipeline>/<sink>/<partition>/<writer>/<n>``, then ``@`` and
        ``mark`` if there is one. Rows the table refuses are found one by one (savepoints)
        and raised as :class:`PoisonInTransaction` after a rollback: the runtime sends the
        rest again.
        """
        import psycopg

        marker = f"{self._prefix}{self.token}/{self.deliveries}"
        if mark is not None:
            marker += f"@{mark.text()}"
        rows, self.rows = self._last_per_key(self.rows), []
        self.in_transaction = True
        try:
            self._insert(rows)
        except (psycopg.DataError, psycopg.IntegrityError) as exc:
            self.conn.rollback()
            refused = self._refused(rows)
            if not refused:  # not a row's fault (the table changed ...): the task fails
                first = str(exc).strip().splitlines()[0]
                msg = f"{self.sink.describe()} failed: {first}"
                raise ConnectorError(msg) from None
            raise PoisonInTransaction(refused) from None
        except psycopg.ProgrammingError as exc:  # no row's fault (a permission, a new table)
            self.conn.rollback()
            first = str(exc).strip().splitlines()[0]
            msg = f"{self.sink.describe()} failed: {first}"
            raise ConnectorError(msg) from None
        self.conn.execute(f"INSERT INTO {DELIVERIES} (marker) VALUES (%s)", (marker,))
        self._forget_older(marker, mark)
        self.deliveries += 1
        return marker

    @property
    def _prefix(self) -> str:
        """What every marker of this sink partition begins with."""
        return f"{self.task.pipeline}/{self.task.sink}/{self.task.partition}/"

    def _forget_older(self, marker: str, mark: DeliveryMark | None) -> None:
        """Delete the partition's other markers but its micro-batch's, in the same transaction.

        None of them is asked about again by its marker: this writer resolved what earlier
        attempts left pending before its first delivery (see :meth:`settle`), and each of its
        own earlier deliveries was marked delivered before this one began. Those of the same
        micro-batch are kept for :meth:`delivered_in`. So the table keeps a sink partition's
        markers of one micro-batch, not one per delivery ever; a transaction that never
        commits deletes nothing.
        """
        prefix = self._prefix
        keep = f"%@{mark.incarnation}:{mark.batch}:%" if mark is not None else ""
        self.conn.execute(
            f"DELETE FROM {DELIVERIES} WHERE left(marker, %s) = %s AND marker <> %s "
            "AND marker NOT LIKE %s",
            (len(prefix), prefix, marker, keep),
        )

    def commit(self) -> None:
        """Commit the transaction: the rows and the marker become visible together."""
        self.conn.commit()
        self.in_transaction = False

    def settle(self, identities: Sequence[str]) -> None:
        """End every other session of these sink partitions; wait until they are gone."""
        names = list(identities)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        with self.sink.connect_db(autocommit=True) as admin:
            while True:
                left = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = ANY(%s) AND pid <> pg_backend_pid()",
                    (names,),
                ).fetchall()
                if not left:
                    return
                if time.monotonic() > deadline:
                    msg = f"{len(left)} earlier session(s) of {self.sink.describe()} did not end"
                    raise ConnectorError(msg)
                time.sleep(0.05)

    def committed(self, marker: str) -> bool:
        """Whether the delivery's marker row is in the table (so its rows are)."""
        with self.sink.connect_db(autocommit=True) as conn:
            found = conn.execute(f"SELECT 1 FROM {DELIVERIES} WHERE marker = %s", (marker,))
            return found.fetchone() is not None

    def delivered_in(
        self, batch: int, incarnation: str, since: str | None
    ) -> list[DeliveryMark] | None:
        """The marks of the partition's markers of ``batch`` in the delivery table."""
        prefix = self._prefix
        with self.sink.connect_db(autocommit=True) as conn:
            rows = conn.execute(
                f"SELECT marker FROM {DELIVERIES} WHERE left(marker, %s) = %s AND marker LIKE %s",
                (len(prefix), prefix, f"%@{incarnation}:{batch}:%"),
            ).fetchall()
        marks = [DeliveryMark.parse(str(row[0]).rpartition("@")[2]) for row in rows]
        return sorted((m for m in marks if m is not None), key=lambda m: m.seq)

    def abort(self) -> None:
        """Roll the transaction back (the server does it too if the session died)."""
        self.rows = []
        if self._conn is not None:
            try:
                self._conn.rollback()
            except Exception:  # noqa: BLE001 - a broken session is rolled back by the server
                self._conn = None
        self.in_transaction = False

    def aborted_cleanly(self) -> bool:
        """After a rollback nothing of the transaction can commit: a commit is ours to send."""
        return self._conn is not None

    # -- without transactions (bounded and at-least-once runs) ---------------------------

    def flush(self) -> list[Rejected]:
        """Write what is buffered in a transaction of its own; refused rows come back."""
        rejected: list[Rejected] = []
        while self.rows:
            pending = self.rows
            try:
                self.prepare()
                self.commit()
            except PoisonInTransaction as poison:
                rejected += poison.rejected
                refused = {id(rec) for rec, _ in poison.rejected}
                self.rows = [(rec, row) for rec, row in pending if id(rec) not in refused]
        return rejected

    def close(self) -> None:
        """The task succeeded."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- SQL -----------------------------------------------------------------------------

    def _last_per_key(
        self, rows: list[tuple[Record, dict[str, Any]]]
    ) -> list[tuple[Record, dict[str, Any]]]:
        """Upsert: one row per key, the last (one statement cannot update a row twice)."""
        if self.sink.mode != "upsert":
            return rows
        last: dict[tuple[Any, ...], tuple[Record, dict[str, Any]]] = {}
        for rec, row in rows:
            last[tuple(row.get(c) for c in self.sink.key_columns)] = (rec, row)
        return list(last.values())

    def _insert(self, rows: list[tuple[Record, dict[str, Any]]]) -> None:
        """Each row, in statements by shape: deletes (one per key, see _last_per_key) first."""
        by_columns: dict[tuple[bool, tuple[str, ...]], list[tuple[Any, ...]]] = {}
        for _rec, row in rows:
            shape = (isinstance(row, _Delete), tuple(row))
            by_columns.setdefault(shape, []).append(tuple(row.values()))
        with self.conn.cursor() as cur:
            for (delete, columns), values in sorted(by_columns.items(), key=lambda i: not i[0][0]):
                cur.executemany(statement(self.sink, columns, delete), values)

    def _refused(self, rows: list[tuple[Record, dict[str, Any]]]) -> list[Rejected]:
        """The rows the table refuses, each tried alone under a savepoint (then rolled back)."""
        import psycopg

        refused: list[Rejected] = []
        with self.conn.cursor() as cur:
            for rec, row in rows:
                cur.execute("SAVEPOINT onceflow_row")
                try:
                    sql = statement(self.sink, tuple(row), isinstance(row, _Delete))
                    cur.execute(sql, tuple(row.values()))
                except (psycopg.DataError, psycopg.IntegrityError) as e:
                    cur.execute("ROLLBACK TO SAVEPOINT onceflow_row")
                    first = str(e).strip().splitlines()[0]
                    refused.append((rec, f"{self.sink.table} refused the row: {first}"))
        self.conn.rollback()
        return refused


class _Delete(dict[str, Any]):
    """A row to delete: its key columns' values (``(key, None)`` on a keyed stream)."""


def delete_row(sink: PostgresSink, key: Any) -> dict[str, Any]:
    """``(key, None)``: the row to delete, named by the stream's key (its ``key_columns``)."""
    if sink.mode != "upsert":
        msg = "a None row deletes the key's row, which needs mode='upsert' and key_columns"
        raise ValueError(msg)
    named = keyed_rows.delete_row(key, sink.key_columns)
    assert sink.shape is not None  # read by the sink's prepare, on the driver
    return _Delete(sink.shape.fit(dict(named)))


def statement(sink: PostgresSink, columns: Sequence[str], delete: bool = False) -> str:
    """The SQL of one row of these ``columns``: an insert, an upsert or a delete."""
    if delete:
        where = " AND ".join(f'"{c}" = %s' for c in columns)
        return f'DELETE FROM "{sink.table}" WHERE {where}'
    cols = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join(["%s"] * len(columns))
    sql = f'INSERT INTO "{sink.table}" ({cols}) VALUES ({marks})'
    if sink.mode == "upsert":
        keys = ", ".join(f'"{c}"' for c in sink.key_columns)
        rest = [c for c in columns if c not in sink.key_columns]
        update = ", ".join(f'"{c}" = EXCLUDED."{c}"' for c in rest)
        sql += f" ON CONFLICT ({keys}) " + (f"DO UPDATE SET {update}" if rest else "DO NOTHING")
    return sql
