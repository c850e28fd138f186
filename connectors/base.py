"""What a source or sink must provide to the compiler.

Driver side, a source gives Spark a DataFrame of its raw rows (a bounded read, or a streaming
read for unbounded sources). Executor side, its decoder turns Arrow batches of those rows
into records, dead letters and lane heartbeats (:mod:`onceflow.connectors.decoded`: one by one,
or a lane's records at once as columns, the hot path). Sinks open a :class:`SinkWriter` per
task; ``flush`` returns only once everything written is durably delivered (for Kafka:
acknowledged by the broker).

Connectors must pickle (Spark ships them to workers): never open clients in ``__init__``.
"""

from __future__ import annotations

import abc
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from onceflow.connectors.decoded import Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.kernel.records import Record

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


# A record a sink refused for good (too big, not encodable), with the reason: it becomes a
# dead letter instead of failing the task on every retry.
Rejected = tuple[Record, str]


@dataclass(frozen=True)
class TaskInfo:
    """Where a sink writer runs: which sink, batch, partition and attempt.

    ``exactly_once`` is True in exactly-once streaming runs (a sink may then write
    transactionally); ``attempt_id`` is unique per task attempt (Spark's). ``keyed`` is True
    when the sink reads a keyed stream (after ``key_by`` or a combine per key): only then are
    its elements ``(key, value)`` pairs. The plan knows; a sink never guesses it from an
    element's shape (an unkeyed stream's element may be any tuple).
    """

    pipeline: str
    sink: str
    batch: int
    partition: int
    attempt: int
    exactly_once: bool = False
    attempt_id: int = 0
    keyed: bool = False


@dataclass(frozen=True)
class SourceCapabilities:
    """What a streaming run may ask of a source: declared by the source, never probed.

    ``ticks``: a tick file (:attr:`SourceRun.tick_file`) makes it plan a micro-batch with no
    new input, so windows close on time (see ``onceflow.runtime.driver.ticks``). ``reads_in_task``:
    its source stage reads its own offset ranges, so the query carries ranges, not raw rows.
    ``stable_partitions``: its input partitions are planned from the offsets in Spark's log
    alone, so a replay gives each record the same task (False for a source whose partitions
    Spark plans itself). ``readable_ends``: :meth:`SourceConnector.readable_ends` answers
    (consumer lag). ``batch_cap``: it honours :attr:`SourceRun.max_records_per_batch`.
    ``python_data_source``: its stream is a Spark Python data source (the run has Spark look
    those up early, see ``onceflow.runtime.spark_env.session.prime_data_sources``).
    ``checks_batches``: :meth:`SourceConnector.check_batch` checks each micro-batch before it
    runs.
    """

    ticks: bool = False
    reads_in_task: bool = False
    stable_partitions: bool = True
    readable_ends: bool = False
    batch_cap: bool = False
    python_data_source: bool = False
    checks_batches: bool = False


@dataclass(frozen=True)
class SourceRun:
    """What one streaming run decides for a source (see :meth:`SourceConnector.for_run`).

    ``read_in_task`` False: give raw rows (a query unions it with sources that do);
    ``positional_ids`` False: its position IDs are deduplicated like any other ID (a query
    unions it with a source whose partitions Spark plans); ``max_records_per_batch``: a cap
    the run's options set (None: the source's own).
    """

    tick_file: str | None = None
    read_in_task: bool = True
    positional_ids: bool = True
    max_records_per_batch: int | None = None


class SourceConnector(abc.ABC):
    """Base of every source."""

    bounded: bool = True

    def capabilities(self) -> SourceCapabilities:
        """What a streaming run may ask of this source (none by default)."""
        return SourceCapabilities()

    def for_run(self, run: SourceRun) -> SourceConnector:
        """This source as one streaming run reads it: a copy with ``run``'s settings.

        The user's object is never changed (it may serve another run). By default the source
        itself: it declares no capability a run sets.
        """
        return self

    def readable_ends(self) -> dict[tuple[str, int], int]:
        """Where each partition's readable records end now (``capabilities().readable_ends``).

        Keyed as :meth:`positions` keys them: ``(topic or file, partition)``.
        """
        msg = f"{type(self).__name__} cannot tell where its readable records end"
        raise NotImplementedError(msg)

    def positions(self, offsets: Any) -> dict[tuple[str, int], int]:
        """Where each partition ended in ``offsets``, this source's entry of a checkpoint.

        ``(topic or file, partition) -> position``, for progress and consumer lag; ``{}`` when
        the source cannot say (the default).
        """
        return {}

    def check_batch(  # noqa: B027 - optional hook
        self, read: Callable[[str], str | None], start: Any, end: Any
    ) -> None:
        """Driver, before a micro-batch runs: raise if it can no longer be read whole.

        ``read(name)`` reads a file of this source's folder of the query's checkpoint
        (``sources/<n>/``; None if there is none); ``start`` and ``end`` are the source's offsets
        before and at the end of the micro-batch (``start`` None for the first).
        ``capabilities().checks_batches`` says whether a source has this check.
        """

    def spark_conf(self) -> dict[str, str]:
        """Settings a new Spark session needs to read this source (``spark.jars``: joined)."""
        return {}

    def dead_letter_sink(self, pipeline: str) -> SinkConnector | None:
        """Where a streaming run reading this source sends dead letters by default.

        None: a JSON Lines file under the run's output folder.
        """
        return None

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for plans."""

    def frame(self, session: SparkSession, parallelism: int) -> DataFrame:
        """Bounded read: a DataFrame of raw rows."""
        msg = f"{type(self).__name__} cannot be read as a bounded source"
        raise NotImplementedError(msg)

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """Streaming read: a streaming DataFrame of raw rows."""
        msg = f"{type(self).__name__} cannot be read as a stream; use it in a bounded run"
        raise NotImplementedError(msg)

    @abc.abstractmethod
    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """A picklable function from raw Arrow batches to records (run on workers).

        ``source`` is the source stage's name (part of position-derived IDs); with
        ``with_ids`` False the decoder may leave IDs empty (the plain runtime needs none).
        """

    def committed(self, offsets: Any) -> None:  # noqa: B027 - optional hook
        """A streaming run ended; ``offsets`` are where its last committed batch ended."""

    def prepare(self, pipeline: str, streaming: bool) -> None:  # noqa: B027 - optional hook
        """Driver-side checks before a run (topics exist, files readable ...)."""

    def connect(self) -> None:  # noqa: B027 - optional hook
        """Driver side, first of all: wait (a bounded time) until the source's system answers."""

    def local_paths(self) -> list[str]:
        """Paths on this machine's own disk that the workers read (none by default)."""
        return []


class SinkWriter(abc.ABC):
    """Writes records of one task.

    A record the sink can never take (poison: too big, not encodable by its codec) is not an
    error of the task: ``write`` and ``flush`` return it with the reason, and it becomes a
    dead letter. Anything that may pass on a retry (the broker is down) raises instead.
    """

    @abc.abstractmethod
    def write(self, records: Sequence[Record]) -> list[Rejected]:
        """Send records (they may be buffered until :meth:`flush`); return the refused ones."""

    def flush(self) -> list[Rejected]:
        """Return once everything written so far is durably delivered, with refused records."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """The task succeeded: make what was written final and release resources."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """The task failed: drop what is not yet final and release resources."""

    def counts(self) -> dict[str, int]:
        """Counters of what the writer did, by name (the task adds them as ``<name>/<sink>``).

        For example the Kafka sink's ``restamped``: records stamped with the time of writing
        because their topic would have deleted or refused their event time.
        """
        return {}


@dataclass(frozen=True)
class DeliveryMark:
    """What a transactional delivery's marker says of it, so that the sink alone can tell.

    A sink keeps it with the delivery's marker (Kafka: the record in the delivery log; a
    PostgreSQL row; an Iceberg snapshot's property) and names it back with
    :meth:`TransactionalWriter.delivered_in`: so the runtime can find a delivery that
    committed after Redis lost its record (see ``onceflow.runtime.task.sink_delivery``).
    ``incarnation``: the pipeline namespace's (new at each ``onceflow reset``); ``batch``
    the micro-batch; ``seq`` the delivery's number among its sink partition's deliveries of
    that micro-batch, over every attempt; ``digest`` one of its records (IDs and encoded
    values, as the runtime encodes them), empty when not computed.
    """

    incarnation: str
    batch: int
    seq: int
    digest: str = ""

    def text(self) -> str:
        """``incarnation:batch:seq:digest`` (``-`` for no digest); :meth:`parse` reads it."""
        return f"{self.incarnation}:{self.batch}:{self.seq}:{self.digest or '-'}"

    @classmethod
    def parse(cls, text: str) -> DeliveryMark | None:
        """The mark :meth:`text` made, or None for text that is not one (an older marker)."""
        parts = text.split(":")
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():  # noqa: PLR2004
            return None
        digest = "" if parts[3] == "-" else parts[3]
        return cls(parts[0], int(parts[1]), int(parts[2]), digest)


class TransactionalWriter(SinkWriter):
    """A writer whose records become visible only when its transaction commits.

    The runtime drives it in two phases, so that the sink's commit and the delivered-marks in
    Redis act as one: ``write`` (in an open transaction), ``prepare`` (everything written is
    durably held, not yet visible; returns a *marker* that can later tell whether the
    transaction committed), the runtime records the delivery as pending with that marker,
    ``commit``; then the runtime marks the records delivered.

    A writer writes under an :attr:`identity` (Kafka: a transactional id), which outlives the
    task: one per sink partition, whose producer each worker process registers once and
    reuses for the partition's later tasks. The runtime records the identity in Redis before a
    delivery's
    first ``write`` (which begins a transaction) for a sink partition, and forgets it once
    that transaction's records are marked delivered. A task that finds identities recorded for
    its sink partition first has its writer :meth:`settle` them (end their transactions: a
    crashed or zombie attempt's is aborted unless it committed); only then does
    ``committed(marker)`` answer for good.
    """

    #: Whether :meth:`delivered_in` answers: the sink keeps each delivery's mark, so the
    #: runtime can tell a delivery happened without Redis.
    keeps_marks: bool = False

    @property
    @abc.abstractmethod
    def identity(self) -> str:
        """What the writer's transactions are known by (recorded before one begins)."""

    @abc.abstractmethod
    def settle(self, identities: Sequence[str]) -> None:
        """End any transaction these identities may hold open (this writer's own included).

        Afterwards none of them can commit what it began before: a marker of theirs is either
        committed or never will be.
        """

    def ready(self) -> None:  # noqa: B027 - optional hook
        """Before a transaction begins: get what it needs that may end another's.

        For Kafka: register the transactional id if this process holds no producer of it fit
        for a transaction (registering fences every other producer of the id). The runtime
        calls it, then records the writer in Redis (a call fenced by the attempt's ownership
        of the sink partition), then begins: nothing between that record and the transaction
        may register, so an attempt that took the partition over and settled this writer's
        identity is never undone by it (a zombie's transaction would stay open, and hold
        ``read_committed`` readers back until Kafka times it out).
        """

    def aborted_cleanly(self) -> bool:
        """After :meth:`abort`: whether nothing of the transaction can still become visible.

        True lets the runtime forget the identity at once (it was never prepared, and the
        abort went through); False leaves it for the next attempt to :meth:`settle`.
        """
        return False

    @abc.abstractmethod
    def prepare(self, mark: DeliveryMark | None = None) -> str:
        """Flush the open transaction; return its marker (raises if records were refused).

        ``mark``: kept with the marker, for :meth:`delivered_in` (None outside exactly-once
        streaming runs).
        """

    @abc.abstractmethod
    def commit(self) -> None:
        """Commit the open transaction."""

    @abc.abstractmethod
    def committed(self, marker: str) -> bool:
        """Whether an earlier writer's transaction, named by its marker, committed."""

    def delivered_in(
        self, batch: int, incarnation: str, since: str | None
    ) -> list[DeliveryMark] | None:
        """The marks of this sink partition's committed deliveries of micro-batch ``batch``.

        Oldest first, those of namespace ``incarnation`` only, read from the sink itself
        (never from Redis); call once every identity recorded for the partition is settled.
        ``since``: the marker of the partition's last delivery Redis still knows (None: none),
        before which none of them can lie (a sink that scans a log starts there). None: the
        sink cannot tell (the default); the runtime then never relies on it.
        """
        return None

    def recover(self) -> bool:
        """After :class:`TransactionBroken`: end the transaction; whether it committed.

        The writer ends its open transaction for good (waiting for its system, within a
        bound) and tells whether the transaction whose marker :meth:`prepare` last returned
        committed (False when it returned none). The runtime calls it only once it made sure
        its attempt still owns the sink partition; False, it writes the records again.
        """
        msg = f"{type(self).__name__} cannot recover a broken transaction"
        raise NotImplementedError(msg)


class TransactionBroken(Exception):  # noqa: N818 - a state of the transaction, not an error text
    """The sink's transaction cannot commit any more: its system failed under it.

    Raised by :meth:`TransactionalWriter.prepare` or :meth:`~TransactionalWriter.commit` (a
    Kafka broker went away, or the producer was fenced). Whether a commit under way happened
    is not known yet: :meth:`TransactionalWriter.recover` answers that.
    """


class PoisonInTransaction(Exception):  # noqa: N818 - it carries records, not an error text
    """Records the sink refused inside a transaction, which it aborted: send the rest again."""

    def __init__(self, rejected: list[Rejected]) -> None:
        super().__init__(f"{len(rejected)} record(s) refused")
        self.rejected = rejected


class SinkConnector(abc.ABC):
    """Base of every sink."""

    #: True for sinks whose records travel back to the driver (Collect).
    to_driver: bool = False

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for plans."""

    def prepare(self, pipeline: str, streaming: bool) -> None:  # noqa: B027 - optional hook
        """Driver-side setup before a run (create directories, topics ...)."""

    def notes(self) -> list[str]:
        """What :meth:`prepare` found that the person starting the run should be told, once.

        For example a Kafka cluster whose topics are not replicated. Said at the start of a
        run (its log, and the progress output); never a reason to stop.
        """
        return []

    def connect(self) -> None:  # noqa: B027 - optional hook
        """Driver side, first of all: wait (a bounded time) until the sink's system answers."""

    def local_paths(self) -> list[str]:
        """Paths on this machine's own disk that the workers write (none by default)."""
        return []

    def staging_folder(self) -> str | None:
        """Where killed attempts may leave staged files (``onceflow gc`` clears old ones)."""
        return None

    def open(self, task: TaskInfo) -> SinkWriter:
        """Executor side: a writer for one task."""
        msg = f"{type(self).__name__} does not write from workers"
        raise NotImplementedError(msg)

    def receive(self, values: Sequence[Any]) -> None:  # noqa: B027 - optional hook
        """Driver side: elements sent back by workers (``to_driver`` sinks only)."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Driver side, after a bounded run or a micro-batch."""


def element_row(elem: Any) -> dict[str, Any] | None:
    """A dict or dataclass element as a row (a new dict, by field); None for anything else.

    What the table-like sinks (Parquet, PostgreSQL) write an element as.
    """
    if dataclasses.is_dataclass(elem) and not isinstance(elem, type):
        return dataclasses.asdict(elem)
    if isinstance(elem, dict):
        return dict(elem)
    return None


T = TypeVar("T")


def renamed(
    owner: str, old: str, new: str, old_value: T | None, value: T | None, hint: str
) -> T | None:
    """``value``, or ``old_value`` if it was given under the argument's old name.

    An old name keeps working for one release, with a DeprecationWarning that names the new
    one (attributed to the caller of ``owner``); both at once is refused: which one is meant
    cannot be told. ``hint`` is added to either message. Values are never shown (they may
    hold passwords).
    """
    if old_value is None:
        return value
    if value is not None:
        msg = f"{owner}: pass {new}= only ({old}= is its old name); {hint}"
        raise ConnectorError(msg)
    warnings.warn(
        f"{owner}({old}=...) is deprecated and goes in the next release: pass {new}=... "
        f"instead; {hint}",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value
