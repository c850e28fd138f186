"""The Kafka source users configure, and how its raw records become records.

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
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from onceflow.connectors.base import Decoded, Decoder, SourceConnector
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.offsets import split_tp
from onceflow.kernel import ids
from onceflow.kernel.codec import value_codec
from onceflow.kernel.records import DeadLetter, Record
from onceflow.kernel.settings import KafkaSettings

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

RAW_COLUMN_COUNT = 7  # topic, partition, offset, ts, key, value, headers

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
                    TopicPartition(*split_tp(k)): OffsetAndMetadata(int(v), "", -1)
                    for k, v in offsets.items()
                }
            )
        finally:
            consumer.close()

    def stream(self, session: SparkSession, pipeline: str, source: str) -> DataFrame:
        """The streaming DataFrame of raw records."""
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
        }
        return session.readStream.format(FORMAT).option("config", json.dumps(config)).load()

    def decoder(self, source: str, with_ids: bool) -> Decoder:
        """Raw rows to records (IDs and event times as in the module docstring)."""
        codec, key_codec = self.codec, self.key_codec
        id_fn, ts_fn, envelope = self.id_fn, self.ts_fn, self.envelope

        def decode(batch: pa.RecordBatch) -> Iterator[Decoded]:
            cols = [batch.column(i).to_pylist() for i in range(RAW_COLUMN_COUNT)]
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
