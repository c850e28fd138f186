"""The Kafka source users configure, and how its raw records become records.

By default the source is a Python data source (``pyspark.sql.datasource``; ``client="spark"``
reads through Spark's own Kafka connector instead, see :mod:`.spark_source`). Its workers read
with kafka-python, or with confluent-kafka (librdkafka) when ``client="confluent"`` (``pip
install 'onceflow[fast]'``; see :mod:`.clients`); offsets are
``{"topic:partition": offset}``
dictionaries kept in Spark's checkpoint, each micro-batch reads one offset range per
partition, a cap bounds the records per batch, and ``availableNow`` stops at the high-water
marks seen when the query started. Clients are created lazily on each worker and reused.

Record IDs: the ``onceflow-id`` header when present, else the user's ``id`` function, else
source name + topic + partition + offset. Event time: the ``onceflow-ts`` header, else the
user's ``timestamp`` function, else the Kafka record timestamp. Values decode through a codec
(``json``, ``utf-8``, ``raw``, ``msgpack``); a value that does not decode becomes a dead
letter with its topic, partition and offset.

The sink writes each record with its ID in the ``onceflow-id`` header (and its event time in
``onceflow-ts``), so an Onceflow pipeline reading this topic stays exactly-once end to end.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

import msgpack
from crc32c import crc32c

from onceflow.connectors.base import (
    Decoded,
    Decoder,
    SinkConnector,
    SourceCapabilities,
    SourceConnector,
    SourceRun,
    renamed,
)
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import await_kafka
from onceflow.connectors.kafka.kafka_python import BOOTSTRAP
from onceflow.connectors.kafka.offsets import partitions_of, split_tp, tp_key
from onceflow.connectors.kafka.outage import retrying
from onceflow.connectors.kafka.spark_source import SPARK_CLIENT, check_client
from onceflow.connectors.kafka.worker import ON_DATA_LOSS, RANGE_COLUMNS, fetch_range
from onceflow.kernel import ids
from onceflow.kernel.codec import ValueCodec, value_codec
from onceflow.kernel.records import DeadLetter, Record, Redrive
from onceflow.kernel.settings import KafkaSettings

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

RAW_COLUMN_COUNT = 7  # topic, partition, offset, ts, key, value, headers

_registered: set[int] = set()
_probes: dict[str, Any] = {}  # driver-side consumers for readable_ends, per settings


class KafkaSource(SourceConnector):
    """Reads one or more topics as a stream (see the module docstring).

    ``bootstrap_servers`` and ``connection`` (kafka-python's names: ``security_protocol``,
    ``sasl_*``, ``ssl_*`` ...) say where Kafka is and how to log in, for every client the
    source uses; they fall back to the ``KAFKA_*`` environment variables. ``KafkaSink`` takes
    the same ``connection``. (``options`` is its old name, deprecated.)
    """

    bounded = False

    def __init__(
        self,
        topics: str | Sequence[str],
        *,
        bootstrap_servers: str | None = None,
        codec: str = "json",
        id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
        timestamp: Callable[[Any], int] | None = None,
        starting_offsets: str = "earliest",
        group_id: str | None = None,
        max_records_per_batch: int | None = 10_000,
        envelope: bool = False,
        key_codec: str = "raw",
        on_data_loss: str = "fail",
        connection: dict[str, Any] | None = None,
        client: str = "python",
        read_in_task: bool = True,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if not self.topics:
            msg = "KafkaSource needs at least one topic"
            raise ConnectorError(msg)
        if starting_offsets not in ("earliest", "latest", "committed"):
            msg = (
                f"starting_offsets must be earliest, latest or committed, got {starting_offsets!r}"
            )
            raise ConnectorError(msg)
        if starting_offsets == "committed" and not group_id:
            msg = "starting_offsets='committed' needs a group_id"
            raise ConnectorError(msg)
        if on_data_loss not in ON_DATA_LOSS:
            msg = f"on_data_loss must be 'fail' or 'report', got {on_data_loss!r}"
            raise ConnectorError(msg)
        self.on_data_loss = on_data_loss
        # "python": the Python data source, reading with kafka-python (default); "confluent":
        # the same data source reading with confluent-kafka; "spark": Spark's own Kafka
        # connector, whose jars the session must load at start (see .spark_source).
        check_client(client, group_id)
        self.client = client
        self._bootstrap = bootstrap_servers
        hint = "connection settings have the same name on KafkaSink"
        connection = renamed(
            type(self).__name__, "options", "connection", options, connection, hint
        )
        self._connection = dict(connection or {})
        self._resolved: KafkaSettings | None = None
        self.codec = value_codec(codec)
        self.key_codec = value_codec(key_codec)
        self.id_fn = id
        self.ts_fn = timestamp
        self.starting_offsets = starting_offsets
        self.group_id = group_id
        self.max_records_per_batch = max_records_per_batch
        self.envelope = envelope
        self.tick_file: str | None = None  # set on a run's copy (for_run) when windows need ticks
        # The source stage reads its offset ranges itself (see .datasource); a run turns it
        # off (on its copy, see for_run) when one query unions this source with sources that
        # give raw rows.
        self.read_in_task = read_in_task and client != SPARK_CLIENT
        # Position IDs skip the dedup of IDs (see decoder); a run turns that off (on its copy)
        # when one query unions this source with a source whose input partitions Spark plans.
        self.positional_ids = client != SPARK_CLIENT

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings (arguments first, then the environment), fixed once read.

        Read on the driver (:meth:`prepare`); workers get them with the source, never from
        their own environment.
        """
        if self._resolved is None:
            self._resolved = KafkaSettings.from_env(self._bootstrap, **self._connection)
        return self._resolved

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {','.join(self.topics)} ({self.codec.name})"

    def capabilities(self) -> SourceCapabilities:
        """Read through the Python data source, it ticks and plans its own ranges."""
        python = self.client != SPARK_CLIENT
        return SourceCapabilities(
            ticks=python,
            reads_in_task=self.read_in_task,
            stable_partitions=python,
            readable_ends=True,
            batch_cap=True,
        )

    def for_run(self, run: SourceRun) -> KafkaSource:
        """A copy with the run's tick file, cap, and what the run's union allows."""
        source = copy.copy(self)
        source.tick_file = run.tick_file
        source.read_in_task = self.read_in_task and run.read_in_task
        source.positional_ids = self.positional_ids and run.positional_ids
        if run.max_records_per_batch is not None:
            source.max_records_per_batch = run.max_records_per_batch
        return source

    def dead_letter_sink(self, pipeline: str) -> SinkConnector:
        """A topic ``<pipeline>.dead-letters`` on the same cluster, written by the same client."""
        from onceflow.connectors.kafka.clients import CONFLUENT_CLIENT, PYTHON_CLIENT
        from onceflow.connectors.kafka.dead_letters import KafkaDeadLetterSink

        return KafkaDeadLetterSink(
            f"{pipeline}.dead-letters",
            bootstrap_servers=self.settings.bootstrap_servers,
            connection=self.settings.options,
            client=CONFLUENT_CLIENT if self.client == CONFLUENT_CLIENT else PYTHON_CLIENT,
        )

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Fail early and clearly when Kafka or a topic is missing."""
        self.settings  # noqa: B018 - raises a ConfigError when nothing is configured

    def connect(self) -> None:
        """Wait for Kafka to answer: a bounded time, with a progress line, then one line."""
        await_kafka(self.settings)

    def committed(self, offsets: Any) -> None:
        """Store the end of the last committed batch in the consumer group, if one is named.

        Spark tells a source about a committed batch only when it plans the next one, so the
        last batch of a run is mirrored here (what ``starting_offsets="committed"`` and lag
        monitoring read).
        """
        if not self.group_id or not isinstance(offsets, dict) or not offsets:
            return
        retrying(
            self.settings, f"committing group {self.group_id!r}", lambda: self._commit(offsets)
        )

    def _commit(self, offsets: dict[str, Any]) -> None:
        from kafka import KafkaConsumer, TopicPartition
        from kafka.structs import OffsetAndMetadata

        consumer = KafkaConsumer(
            **{**BOOTSTRAP, **self.settings.client_config()},
            group_id=self.group_id,
            enable_auto_commit=False,
        )
        try:
            consumer.commit(
                {
                    TopicPartition(*split_tp(k)): OffsetAndMetadata(int(v), "", -1)
                    for k, v in partitions_of(offsets).items()
                }
            )
        finally:
            consumer.close()

    def readable_ends(self) -> dict[str, int]:
        """Where each partition's readable records end now: ``{"topic:partition": offset}``.

        On the driver, for consumer lag (the end of the last batch against this); one small
        probe consumer per process and settings. Raises when Kafka cannot answer.
        """
        from onceflow.connectors.kafka.datasource import (
            probe_consumer,
            readable_ends,
            topic_partitions,
        )

        settings = self.settings
        key = repr((settings.bootstrap_servers, sorted(settings.options.items())))
        consumer = _probes.get(key)
        if consumer is None:
            consumer = _probes[key] = probe_consumer(settings)
        return readable_ends(consumer, topic_partitions(consumer, settings, self.topics))

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """The streaming DataFrame of raw records."""
        if self.client == SPARK_CLIENT:
            from onceflow.connectors.kafka.spark_source import spark_stream

            return spark_stream(self, session)
        from onceflow.connectors.kafka.datasource import FORMAT, KafkaDataSource

        if id(session) not in _registered:
            session.dataSource.register(KafkaDataSource)
            _registered.add(id(session))
        s = self.settings
        config = {
            "bootstrap": s.bootstrap_servers,
            "options": s.options,
            "topics": self.topics,
            "starting_offsets": self.starting_offsets,
            "group_id": self.group_id,
            "max_records_per_batch": self.max_records_per_batch,
            "on_data_loss": self.on_data_loss,
            "tick_file": self.tick_file,
            "client": self.client,
            "ranges": self.read_in_task,  # the source stage reads its own range
        }
        return session.readStream.format(FORMAT).option("config", json.dumps(config)).load()

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Raw rows, or offset ranges this task reads itself, to records.

        IDs and event times are as in the module docstring. Position IDs are ``positional``
        (:class:`~onceflow.kernel.records.Record`) when read through the Python data source,
        whose input partitions are one offset range per Kafka partition, planned from the
        offsets in Spark's log alone (a replay reads the same records in the same task);
        Spark's own Kafka connector plans its own ranges, so its position IDs are
        deduplicated like any other ID, and so are those of every source of a query that
        unions it (their tasks' numbers follow its partitions, see ``positional_ids``).
        """
        codec, key_codec = self.codec, self.key_codec
        id_fn, ts_fn, envelope = self.id_fn, self.ts_fn, self.envelope
        by_position = with_ids and self.positional_ids
        settings, on_data_loss, client = self.settings, self.on_data_loss, self.client

        lanes: dict[tuple[str, int], str] = {}

        def records(rows: Iterable[tuple[Any, ...]], unpack: bool) -> Iterator[Decoded]:
            """``(topic, partition, offset, ts, key, value, headers)`` rows, decoded."""
            for topic, part, offset, kts, key, value, headers in rows:
                if unpack:  # Arrow rows carry headers as MessagePack
                    hdrs = dict(msgpack.unpackb(headers, raw=False)) if headers else {}
                else:
                    hdrs = dict(headers) if headers else {}
                lane = lanes.get((topic, part))
                if lane is None:
                    lane = lanes[(topic, part)] = tp_key(topic, part)
                yield _decode_one(
                    (source, lane, topic, part, offset, kts, key, value, hdrs),
                    codec,
                    key_codec,
                    envelope,
                    id_fn if with_ids else None,
                    ts_fn,
                    with_ids,
                    by_position,
                )

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            if batch.num_columns == len(RANGE_COLUMNS):  # ranges: this task reads them
                ranges = zip(*(c.to_pylist() for c in batch.columns), strict=True)
                for topic, part, lo, hi in ranges:
                    for f in fetch_range(settings, topic, part, lo, hi, on_data_loss, client):
                        n = len(f)
                        rows = zip(
                            repeat(topic, n),
                            repeat(part, n),
                            f.offsets,
                            f.timestamps,
                            f.keys,
                            f.values,
                            f.headers,
                            strict=True,
                        )
                        yield from records(rows, unpack=False)
                return
            cols = [batch.column(i).to_pylist() for i in range(RAW_COLUMN_COUNT)]
            yield from records(zip(*cols, strict=True), unpack=True)

        return decode


RawRecord = tuple[str, str, str, int, int, int, "bytes | None", "bytes | None", dict[str, bytes]]


def _decode_one(
    raw: RawRecord,
    codec: ValueCodec,
    key_codec: ValueCodec,
    envelope: bool,
    id_fn: Callable[[Any], Any] | None,
    ts_fn: Callable[[Any], int] | None,
    with_ids: bool,
    by_position: bool = False,
) -> Decoded:
    """One raw Kafka record as a record, or as a dead letter saying what was wrong with it.

    ``by_position``: a record whose ID is its position is ``positional`` (see
    :meth:`KafkaSource.decoder`). The position ID is only computed where it is used.
    """
    source, lane, topic, part, offset, kts, key, value, hdrs = raw
    origin = f"{lane}@{offset}"
    gap = _gap_of(offset, kts, key, value, hdrs)
    if gap is not None:
        return _gap_letter(source, origin, _position(raw, with_ids), *gap)
    if ids.REDRIVE_HEADER in hdrs:
        return _replayed(raw, origin, with_ids)
    try:
        elem = codec.decode(value) if value is not None else None
        if envelope:
            elem = {
                "key": key_codec.decode(key) if key is not None else None,
                "value": elem,
                "headers": hdrs,
                "topic": topic,
                "partition": part,
                "offset": offset,
                "timestamp": kts,
            }
    except Exception as exc:  # noqa: BLE001 - undecodable: dead letter
        error = f"cannot decode as {codec.name}: {type(exc).__name__}: {exc}"
        return DeadLetter(
            _position(raw, with_ids),
            kts,
            source,
            error,
            origin,
            raw=value or b"",
            code="undecodable",
            raw_key=key,
        )
    try:
        found = _record_id(hdrs, id_fn, elem) if with_ids else b""
    except Exception as exc:  # noqa: BLE001 - a bad header, or the user's id function failed
        error = f"no record ID: {type(exc).__name__}: {exc}"
        return DeadLetter(
            _position(raw, with_ids), kts, source, error, origin, raw=value or b"", code="no_id"
        )
    rid = _position(raw, with_ids) if found is None else found
    positional = found is None and by_position
    printed = fingerprint(key, value) if found is not None else 0
    try:
        ts = _event_time(hdrs, ts_fn, elem, kts)
    except Exception as exc:  # noqa: BLE001 - a bad header, or the user's timestamp function
        error = f"no event time: {type(exc).__name__}: {exc}"
        raw_value = value or b""
        return DeadLetter(rid, kts, source, error, origin, raw_value, code="no_time")
    size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    return Record(rid, ts, elem, lane, offset, positional, size, printed)


def _replayed(raw: RawRecord, origin: str, with_ids: bool) -> Decoded:
    """A record ``onceflow dead-letters replay`` sent: the input of the node it failed in.

    Its value is that input as JSON (whatever the source's codec), its ID and event time are
    in headers (set from the letter, so a second replay of the letter is a duplicate); the
    user's id and timestamp functions do not apply (they read source records, not inputs).
    """
    source, lane, _topic, _part, offset, kts, key, value, hdrs = raw
    try:
        node = bytes(hdrs[ids.REDRIVE_HEADER]).decode("utf-8")
        elem = json.loads(value or b"")
        rid = ids.from_header(hdrs.get(ids.ID_HEADER)) if with_ids else b""
        ts = ids.parse_ts_header(hdrs.get(ids.TS_HEADER))
    except Exception as exc:  # noqa: BLE001 - a malformed replay: dead letter, not a crash
        error = f"a replayed dead letter is malformed: {type(exc).__name__}: {exc}"
        position = _position(raw, with_ids)
        return DeadLetter(position, kts, source, error, origin, value or b"", code="undecodable")
    size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    return Record(rid, ts, Redrive(node, elem), lane, offset, False, size, fingerprint(key, value))


def fingerprint(key: bytes | None, value: bytes | None) -> int:
    """A record's content checksum (see :class:`~onceflow.kernel.records.Record`); never 0."""
    return crc32c(value or b"", crc32c(key or b"")) or 1


def _position(raw: RawRecord, with_ids: bool) -> bytes:
    """The ID of a raw record's position (``b""`` when IDs are off)."""
    source, _lane, topic, part, offset = raw[:5]
    return ids.from_position(source, topic, part, offset) if with_ids else b""


def _gap_of(
    offset: int, kts: int, key: bytes | None, value: bytes | None, hdrs: dict[str, bytes]
) -> tuple[int, int] | None:
    """``(first, after)`` if the row is the reader's own marker for deleted records.

    Only a row exactly as :func:`onceflow.connectors.kafka.worker._gap` makes it counts (no
    key, value or timestamp, the gap header alone, starting at the row's offset): a record
    that merely carries such a header (a producer set or forwarded it) is an ordinary record.
    """
    gap = hdrs.get(ids.GAP_HEADER)
    if gap is None or len(hdrs) != 1 or key is not None or value is not None or kts != 0:
        return None
    try:
        first, after = (int(x) for x in bytes(gap).decode("ascii").split("-"))
    except (ValueError, UnicodeDecodeError):
        return None
    return (first, after) if first == offset and after > first else None


def _gap_letter(source: str, origin: str, position: bytes, first: int, after: int) -> DeadLetter:
    """The dead letter standing for records deleted before the pipeline read them."""
    error = (
        f"offsets {first}..{after - 1} were deleted (retention or delete_records) before the "
        f"pipeline read them: {after - first} records lost upstream"
    )
    return DeadLetter(position, 0, source, error, origin, code="data_loss", lost=after - first)


def _record_id(
    headers: dict[str, bytes], id_fn: Callable[[Any], Any] | None, elem: Any
) -> bytes | None:
    """The user's id function, else the ``onceflow-id`` header; None: the position is the ID.

    What the user asked for wins over what the record carries (an app between two pipelines
    may copy one header onto several records). An id function that returns None for a record
    leaves it to the header; with no header either, that is an error (a dead letter).
    """
    if id_fn is not None:
        key = id_fn(elem)
        if key is not None or ids.ID_HEADER not in headers:
            return ids.from_user_key(key)
    if ids.ID_HEADER in headers:  # a header without a value is an error, not "no header"
        return ids.from_header(headers[ids.ID_HEADER])
    return None


def _event_time(
    headers: dict[str, bytes], ts_fn: Callable[[Any], int] | None, elem: Any, kafka_ts: int
) -> int:
    header = headers.get(ids.TS_HEADER)
    if header is not None:
        return ids.parse_ts_header(header)
    if ts_fn is not None:
        return ids.check_event_time(int(ts_fn(elem)))
    return int(kafka_ts)
