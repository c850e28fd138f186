"""Kafka in and out, with kafka-python, for Spark Structured Streaming.

Spark's own Kafka connector is a JVM jar that cannot be loaded here, so the source is a Python
data source (``pyspark.sql.datasource``): offsets are ``{"topic:partition": offset}``
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

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from connectors.base import Decoded, Decoder, SinkConnector, SinkWriter, SourceConnector, TaskInfo
from connectors.errors import ConnectorError
from onceflow import ids
from onceflow.codec import value_codec
from onceflow.errors import CodecError
from onceflow.records import DeadLetter, Record
from onceflow.settings import KafkaSettings

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

FORMAT = "onceflow_kafka"
RAW_SCHEMA = (
    "topic string, partition int, offset long, ts long, key binary, value binary, headers binary"
)
ERROR_HEADER = "onceflow-error"
ORIGIN_HEADER = "onceflow-origin"
STAGE_HEADER = "onceflow-stage"


def _tp_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _split_tp(key: str) -> tuple[str, int]:
    topic, partition = key.rsplit(":", 1)
    return topic, int(partition)


# -- shared clients per worker process ----------------------------------------------------------

_clients: dict[tuple[str, str], Any] = {}
_clients_lock = threading.Lock()


def _client(kind: str, settings: KafkaSettings, **extra: Any) -> Any:
    """A cached producer/consumer for these settings in this process (a new one costs ~0.1 s)."""
    key = (
        kind,
        repr((settings.bootstrap_servers, sorted(settings.options.items()), sorted(extra.items()))),
    )
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            from kafka import KafkaConsumer, KafkaProducer

            config = {**settings.client_config(), **extra}
            if kind == "producer":
                client = KafkaProducer(**config)
            else:
                client = KafkaConsumer(**config)
            _clients[key] = client
    return client


def ensure_topics(settings: KafkaSettings, topics: Sequence[str], partitions: int) -> None:
    """Create missing topics."""
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**settings.client_config())
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics([NewTopic(t, partitions, 1) for t in missing])
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


# -- the Spark data source -------------------------------------------------------------------


class KafkaDataSource(DataSource):
    """``spark.readStream.format("onceflow_kafka").option("config", json)``."""

    @classmethod
    def name(cls) -> str:
        """Format name."""
        return FORMAT

    def schema(self) -> str:
        """Raw Kafka rows; headers are a MessagePack list of ``[key, value]``."""
        return RAW_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:  # noqa: N802 - Spark's name
        """The micro-batch reader."""
        return KafkaStreamReader(json.loads(self.options["config"]))


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets, high-water marks and reads of one or more topics."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.settings = KafkaSettings(config["bootstrap"], config.get("options", {}))
        self.topics: list[str] = config["topics"]
        self.starting: str = config.get("starting_offsets", "earliest")
        self.group_id: str | None = config.get("group_id")
        self.max_records: int | None = config.get("max_records_per_batch")
        self.target: dict[str, int] | None = None
        self._probe: Any = None  # driver-side consumer, created on first use

    # -- driver side ----------------------------------------------------------------------

    def _consumer(self) -> Any:
        if self._probe is None:
            from kafka import KafkaConsumer

            self._probe = KafkaConsumer(
                **self.settings.client_config(),
                enable_auto_commit=False,
                group_id=self.group_id,
                max_partition_fetch_bytes=1,
                fetch_max_bytes=1,
                fetch_max_wait_ms=10,
            )
        return self._probe

    def _partitions(self) -> list[Any]:
        from kafka import TopicPartition

        consumer = self._consumer()
        found: list[Any] = []
        for topic in self.topics:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                msg = (
                    f"Kafka topic {topic!r} does not exist at {self.settings.bootstrap_servers}; "
                    "create it (or produce to it) before starting the pipeline"
                )
                raise ConnectorError(msg)
            found.extend(TopicPartition(topic, p) for p in sorted(parts))
        return found

    def _highwater(self, tps: list[Any]) -> dict[str, int]:
        """High-water marks from one tiny fetch per partition (``end_offsets`` is not trusted)."""
        consumer = self._consumer()
        consumer.unsubscribe()
        consumer.assign(tps)
        begin = consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, begin[tp])
        marks: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=50, max_records=1)
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is not None:
                    marks[_tp_key(tp.topic, tp.partition)] = hw
            if len(marks) == len(tps):
                return marks
        missing = [
            _tp_key(tp.topic, tp.partition)
            for tp in tps
            if _tp_key(tp.topic, tp.partition) not in marks
        ]
        msg = f"no high-water mark from Kafka for {missing} within 30 s; is the broker up?"
        raise ConnectorError(msg)

    def _beginnings(self, tps: list[Any]) -> dict[str, int]:
        begin = self._consumer().beginning_offsets(tps)
        return {_tp_key(tp.topic, tp.partition): off for tp, off in begin.items()}

    def initialOffset(self) -> dict[str, int]:  # noqa: N802 - Spark's name
        """Where a new query starts: earliest, latest or the group's committed offsets."""
        tps = self._partitions()
        if self.starting == "latest":
            return self._highwater(tps)
        start = self._beginnings(tps)
        if self.starting == "committed" and self.group_id:
            consumer = self._consumer()
            for tp in tps:
                committed = consumer.committed(tp)
                if committed is not None:
                    start[_tp_key(tp.topic, tp.partition)] = committed
        return start

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 - Spark's name
        """The per-batch cap, if any."""
        return ReadMaxRows(self.max_records) if self.max_records else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        """Remember today's high-water marks: the query stops there."""
        self.target = self._highwater(self._partitions())

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:  # noqa: N802
        """Where the next batch ends: the high-water marks, capped by the target and limit."""
        tps = self._partitions()
        marks = self._highwater(tps)
        begin = None
        current = dict(start)
        for key in marks:
            if key not in current:  # a partition added since the query started
                begin = begin if begin is not None else self._beginnings(tps)
                current[key] = begin[key]
        end = {}
        for key, hw in marks.items():
            top = hw if self.target is None else min(hw, self.target.get(key, current[key]))
            end[key] = max(current[key], top)
        if isinstance(limit, ReadMaxRows):
            end = cap_offsets(current, end, limit.max_rows)
        return end

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        """One input partition per Kafka partition with records in ``[start, end)``."""
        parts = []
        for key in sorted(end, key=_split_tp):
            lo = start.get(key, 0)
            hi = end[key]
            if hi > lo:
                topic, partition = _split_tp(key)
                parts.append(InputPartition((topic, partition, lo, hi)))
        return parts

    def commit(self, end: dict[str, int]) -> None:
        """Mirror progress into the consumer group (for lag monitoring), if one is named."""
        if not self.group_id:
            return
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        offsets = {
            TopicPartition(*_split_tp(k)): OffsetAndMetadata(v, "", -1) for k, v in end.items()
        }
        try:
            self._consumer().commit(offsets)
        except Exception:  # noqa: BLE001, S110 - monitoring only; the checkpoint is the truth
            pass

    def stop(self) -> None:
        """Close the driver-side consumer."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    # -- worker side ----------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Records ``[lo, hi)`` of one topic-partition, as Arrow batches."""
        import pyarrow as pa
        from kafka import TopicPartition

        topic, part, lo, hi = partition.value
        tp = TopicPartition(topic, part)
        consumer = _client(
            "reader", self.settings, enable_auto_commit=False, max_poll_records=5000, group_id=None
        )
        consumer.assign([tp])
        consumer.seek(tp, lo)
        position = lo
        idle_since = time.monotonic()
        while position < hi:
            batch = consumer.poll(timeout_ms=500).get(tp, [])
            rows = [r for r in batch if lo <= r.offset < hi]
            if rows:
                idle_since = time.monotonic()
                position = rows[-1].offset + 1
                yield pa.RecordBatch.from_arrays(
                    [
                        pa.array([topic] * len(rows), pa.string()),
                        pa.array([part] * len(rows), pa.int32()),
                        pa.array([r.offset for r in rows], pa.int64()),
                        pa.array([r.timestamp for r in rows], pa.int64()),
                        pa.array([r.key for r in rows], pa.binary()),
                        pa.array([r.value for r in rows], pa.binary()),
                        pa.array([_pack_headers(r.headers) for r in rows], pa.binary()),
                    ],
                    names=["topic", "partition", "offset", "ts", "key", "value", "headers"],
                )
            else:
                position = max(position, consumer.position(tp))
                if time.monotonic() - idle_since > 60:
                    msg = (
                        f"reading {topic}:{part} offsets {lo}..{hi} stalled at {position} for "
                        "60 s; were records deleted (retention) or is the broker down?"
                    )
                    raise ConnectorError(msg)


def _pack_headers(headers: Sequence[tuple[str, bytes]] | None) -> bytes | None:
    if not headers:
        return None
    return msgpack.packb([[k, v] for k, v in headers], use_bin_type=True)  # type: ignore[no-any-return]


def cap_offsets(start: dict[str, int], end: dict[str, int], budget: int) -> dict[str, int]:
    """Limit ``end`` so that at most ``budget`` records are read, shared fairly by partitions."""
    lag = {k: end[k] - start.get(k, 0) for k in end}
    total = sum(lag.values())
    if total <= budget:
        return dict(end)
    share = {k: budget * n // total for k, n in lag.items()}
    leftover = budget - sum(share.values())
    for k in sorted(lag, key=lambda k: (-(lag[k] - share[k]), k)):
        if leftover <= 0:
            break
        if share[k] < lag[k]:
            share[k] += 1
            leftover -= 1
    return {k: start.get(k, 0) + share[k] for k in end}


# -- the connector users configure ---------------------------------------------------------------


_registered: set[int] = set()


class KafkaSource(SourceConnector):
    """Reads one or more topics as a stream (see the module docstring)."""

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
        self._bootstrap = bootstrap_servers
        self._options = dict(options or {})
        self.codec = value_codec(codec)
        self.key_codec = value_codec(key_codec)
        self.id_fn = id
        self.ts_fn = timestamp
        self.starting_offsets = starting_offsets
        self.group_id = group_id
        self.max_records_per_batch = max_records_per_batch
        self.envelope = envelope

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings (arguments first, then the environment)."""
        return KafkaSettings.from_env(self._bootstrap, **self._options)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {','.join(self.topics)} ({self.codec.name})"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Fail early and clearly when Kafka or a topic is missing."""
        self.settings  # noqa: B018 - raises a ConfigError when nothing is configured

    def committed(self, offsets: Any) -> None:
        """Store the end of the last committed batch in the consumer group, if one is named.

        Spark tells a source about a committed batch only when it plans the next one, so the
        last batch of a run is mirrored here (what ``starting_offsets="committed"`` and lag
        monitoring read).
        """
        if not self.group_id or not isinstance(offsets, dict) or not offsets:
            return
        from kafka import KafkaConsumer, TopicPartition
        from kafka.structs import OffsetAndMetadata

        consumer = KafkaConsumer(
            **self.settings.client_config(), group_id=self.group_id, enable_auto_commit=False
        )
        try:
            consumer.commit(
                {
                    TopicPartition(*_split_tp(k)): OffsetAndMetadata(int(v), "", -1)
                    for k, v in offsets.items()
                }
            )
        finally:
            consumer.close()

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """The streaming DataFrame of raw records."""
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
        }
        return session.readStream.format(FORMAT).option("config", json.dumps(config)).load()

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Raw rows to records (IDs and event times as in the module docstring)."""
        codec, key_codec = self.codec, self.key_codec
        id_fn, ts_fn, envelope = self.id_fn, self.ts_fn, self.envelope

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            cols = [batch.column(i).to_pylist() for i in range(7)]
            for topic, part, offset, kts, key, value, headers in zip(*cols, strict=True):
                origin = f"{topic}/{part}@{offset}"
                hdrs = dict(msgpack.unpackb(headers, raw=False)) if headers else {}
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
                    rid = _record_id(source, topic, part, offset, hdrs, None, None, with_ids)
                    error = f"cannot decode as {codec.name}: {type(exc).__name__}: {exc}"
                    yield DeadLetter(rid, kts, source, error, origin, raw=value or b"")
                    continue
                try:
                    rid = _record_id(source, topic, part, offset, hdrs, id_fn, elem, with_ids)
                    ts = _event_time(hdrs, ts_fn, elem, kts)
                except Exception as exc:  # noqa: BLE001 - user id/timestamp function failed
                    rid = _record_id(source, topic, part, offset, hdrs, None, None, with_ids)
                    error = f"id/timestamp function failed: {type(exc).__name__}: {exc}"
                    yield DeadLetter(rid, kts, source, error, origin, raw=value or b"")
                    continue
                yield Record(rid, ts, elem)

        return decode


def _record_id(
    source: str,
    topic: str,
    part: int,
    offset: int,
    headers: dict[str, bytes],
    id_fn: Callable[[Any], Any] | None,
    elem: Any,
    with_ids: bool,
) -> bytes:
    if not with_ids:
        return b""
    header = headers.get(ids.ID_HEADER)
    if header is not None:
        return ids.from_header(header)
    if id_fn is not None:
        return ids.from_user_key(id_fn(elem))
    return ids.from_position(source, topic, part, offset)


def _event_time(
    headers: dict[str, bytes], ts_fn: Callable[[Any], int] | None, elem: Any, kafka_ts: int
) -> int:
    header = headers.get(ids.TS_HEADER)
    if header is not None:
        return ids.parse_ts_header(header)
    if ts_fn is not None:
        return int(ts_fn(elem))
    return int(kafka_ts)


# -- sinks ------------------------------------------------------------------------------------


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    return json.dumps(key, separators=(",", ":")).encode()


class KafkaSink(SinkConnector):
    """Writes to a topic, each record carrying its ID; keyed elements ``(k, v)`` use ``k``.

    Delivery: a record is marked delivered once the broker acknowledged it (``acks=all``). A
    crash between the two can leave a second copy in the topic; it carries the same
    ``onceflow-id``, so Onceflow readers drop it and ``onceflow audit`` counts it.
    """

    def __init__(
        self,
        topic: str,
        *,
        bootstrap_servers: str | None = None,
        codec: str = "json",
        key: Callable[[Any], Any] | None = None,
        partitions: int = 2,
        create_topic: bool = True,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.topic = topic
        self._bootstrap = bootstrap_servers
        self._options = dict(options or {})
        self.codec = value_codec(codec)
        self.key_fn = key
        self.partitions = partitions
        self.create_topic = create_topic

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings (arguments first, then the environment)."""
        return KafkaSettings.from_env(self._bootstrap, **self._options)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka {self.topic} ({self.codec.name})"

    def prepare(self, pipeline: str, streaming: bool) -> None:
        """Create the topic if asked to."""
        if self.create_topic:
            ensure_topics(self.settings, [self.topic], self.partitions)

    def open(self, task: TaskInfo) -> SinkWriter:
        """A writer sharing the worker's producer."""
        return _KafkaWriter(self, task)

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Key, value and extra headers of one record."""
        elem = rec.elem
        if self.key_fn is not None:
            return _key_bytes(self.key_fn(elem)), self.codec.encode(elem), []
        if isinstance(elem, tuple) and len(elem) == 2:
            return _key_bytes(elem[0]), self.codec.encode(elem[1]), []
        return None, self.codec.encode(elem), []


class KafkaDeadLetterSink(KafkaSink):
    """Dead letters to a topic: the original payload as the value, the reason in headers."""

    def __init__(self, topic: str, **kwargs: Any) -> None:
        super().__init__(topic, codec="json", **kwargs)

    def describe(self) -> str:
        """One line for plans."""
        return f"kafka dead letters {self.topic}"

    def encode(self, rec: Record) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """Raw payload (or the letter as JSON) and headers naming stage, error and origin."""
        import base64

        letter = rec.elem
        raw = letter.get("raw_b64")
        value = base64.b64decode(raw) if raw is not None else json.dumps(letter).encode()
        headers = [
            (ERROR_HEADER, str(letter.get("error", ""))[:2000].encode()),
            (ORIGIN_HEADER, str(letter.get("origin", "")).encode()),
            (STAGE_HEADER, str(letter.get("stage", "")).encode()),
        ]
        return None, value, headers


class _KafkaWriter(SinkWriter):
    def __init__(self, sink: KafkaSink, task: TaskInfo) -> None:
        self.sink = sink
        self.producer = _client(
            "producer",
            sink.settings,
            acks="all",
            linger_ms=5,
            batch_size=256 * 1024,
            retries=10,
            max_in_flight_requests_per_connection=1,
            # Dedup is by onceflow-id, so the broker's idempotent producer adds nothing; and a
            # producer id reused across a crashed and a restarted process could let a broker
            # acknowledge a batch as a "duplicate sequence" without storing it.
            enable_idempotence=False,
        )
        self.futures: list[Any] = []

    def write(self, records: Sequence[Record]) -> None:
        send = self.producer.send
        topic = self.sink.topic
        for rec in records:
            try:
                key, value, extra = self.sink.encode(rec)
            except CodecError as exc:
                msg = f"cannot write to Kafka topic {topic!r}: {exc}"
                raise ConnectorError(msg) from exc
            headers = extra
            if rec.id:
                headers = [(ids.ID_HEADER, rec.id), (ids.TS_HEADER, ids.ts_header(rec.ts)), *extra]
            self.futures.append(
                send(
                    topic,
                    value=value,
                    key=key,
                    headers=headers or None,
                    timestamp_ms=rec.ts or None,
                )
            )

    def flush(self) -> None:
        """Return once the broker acknowledged everything written; raise if it refused any."""
        if not self.futures:
            return
        self.producer.flush(timeout=120)
        failed = [f for f in self.futures if f.failed() or not f.is_done]
        self.futures = []
        if failed:
            error = failed[0].exception if failed[0].is_done else "no acknowledgement"
            msg = f"Kafka did not accept {len(failed)} record(s) for {self.sink.topic!r}: {error}"
            raise ConnectorError(msg)

    def close(self) -> None:
        self.flush()

    def abort(self) -> None:
        self.futures = []
