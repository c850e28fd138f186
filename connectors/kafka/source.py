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
(``json``, ``utf-8``, ``raw``, ``msgpack``, or a schema registry's Avro or Protobuf:
``codec=onceflow.codecs.Avro(registry_url, schema)``, see :mod:`onceflow.connectors.registry`);
a value that does not decode becomes a dead letter with its topic, partition and offset.
``format="debezium"`` reads Debezium's change events as
:class:`~onceflow.kernel.changes.Change` records, identified by their place in the database's
log (see :mod:`onceflow.connectors.debezium`).

The sink writes each record with its ID in the ``onceflow-id`` header (and its event time in
``onceflow-ts``), so an Onceflow pipeline reading this topic stays exactly-once end to end.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceflow.connectors.base import (
    SinkConnector,
    SourceCapabilities,
    SourceConnector,
    SourceRun,
    renamed,
)
from onceflow.connectors.decoded import Decoder
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import await_kafka, resolve_client
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.decode import kafka_decoder
from onceflow.connectors.kafka.kafka_python import BOOTSTRAP
from onceflow.connectors.kafka.offsets import flat_offsets, partitions_of, split_tp
from onceflow.connectors.kafka.outage import retrying
from onceflow.connectors.kafka.spark_source import SPARK_CLIENT, check_client, session_conf
from onceflow.connectors.kafka.worker import ON_DATA_LOSS
from onceflow.connectors.registry import RegistryCodec, bind_codec
from onceflow.kernel.codec import ValueCodec, value_codec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


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
        codec: str | ValueCodec | RegistryCodec = "json",
        id: Callable[[Any], Any] | None = None,  # noqa: A002 - reads well at the call site
        timestamp: Callable[[Any], int] | None = None,
        starting_offsets: str = "earliest",
        group_id: str | None = None,
        max_records_per_batch: int | None = 10_000,
        envelope: bool = False,
        key_codec: str | None = None,
        format: str = "plain",  # noqa: A002 - reads well at the call site
        on_data_loss: str = "fail",
        connection: dict[str, Any] | None = None,
        client: str = "auto",
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
        self.client = resolve_client(client)
        self._bootstrap = bootstrap_servers
        hint = "connection settings have the same name on KafkaSink"
        connection = renamed(
            type(self).__name__, "options", "connection", options, connection, hint
        )
        self._connection = dict(connection or {})
        self._resolved: KafkaSettings | None = None
        self.codec = bind_codec(codec, self.topics[0])
        self.format = _check_format(format, envelope)
        self.key_codec = _key_codec(key_codec, self.codec, self.format)
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
        shape = f"{self.format}, {self.codec.name}" if self.format != PLAIN else self.codec.name
        return f"kafka {','.join(self.topics)} ({shape})"

    def capabilities(self) -> SourceCapabilities:
        """Read through the Python data source, it ticks and plans its own ranges."""
        python = self.client != SPARK_CLIENT
        return SourceCapabilities(
            ticks=python,
            reads_in_task=self.read_in_task,
            stable_partitions=python,
            readable_ends=True,
            batch_cap=True,
            python_data_source=python,
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

    def readable_ends(self) -> dict[tuple[str, int], int]:
        """Where each partition's readable records end now: ``{(topic, partition): offset}``.

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
        ends = readable_ends(consumer, topic_partitions(consumer, settings, self.topics))
        return {split_tp(key): offset for key, offset in ends.items()}

    def positions(self, offsets: Any) -> dict[tuple[str, int], int]:
        """``(topic, partition) -> offset`` from a checkpoint's offsets of this source.

        Reads both the Python source's (flat) and Spark's own connector's offsets.
        """
        return {split_tp(key): offset for key, offset in flat_offsets(offsets).items()}

    def spark_conf(self) -> dict[str, str]:
        """``spark.jars`` with Spark's Kafka connector when this source reads with Spark."""
        return session_conf([self])

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
        return kafka_decoder(
            source,
            with_ids,
            codecs=(self.codec, self.key_codec),
            functions=(self.id_fn, self.ts_fn),
            envelope=self.envelope,
            by_position=with_ids and self.positional_ids,
            reader=(self.settings, self.on_data_loss, self.client),
            changes=self.format == DEBEZIUM,
        )


PLAIN, DEBEZIUM = "plain", "debezium"


def _key_codec(name: str | None, codec: ValueCodec, shape: str) -> ValueCodec:
    """The key's codec: as named; by default raw, or a Debezium event's value's (one converter)."""
    if name is not None:
        return value_codec(name)
    return codec if shape == DEBEZIUM else value_codec("raw")


def _check_format(value: str, envelope: bool) -> str:
    """``plain`` or ``debezium`` (change events as :class:`~onceflow.kernel.changes.Change`)."""
    if value not in (PLAIN, DEBEZIUM):
        msg = f"format must be 'plain' or 'debezium', got {value!r}"
        raise ConnectorError(msg)
    if value == DEBEZIUM and envelope:
        msg = "format='debezium' gives change records, envelope=True raw ones: choose one"
        raise ConnectorError(msg)
    return value
