"""Kafka read through Spark's own connector (``spark-sql-kafka-0-10``): ``client="spark"``.

The default Kafka source is a Python data source (:mod:`~.datasource`, :mod:`~.worker`). This
module is the opt-in alternative: ``spark.readStream.format("kafka")``, the JVM connector
Spark ships for Scala and Java users, read into the same raw rows the Python source gives
(``topic, partition, offset, ts, key, value, headers``; ``ts`` in epoch milliseconds, headers
one MessagePack list of ``[key, value]``), so :meth:`~.source.KafkaSource.decoder` and the
rest of the runtime cannot tell the two apart.

**Headers are packed in the JVM.** The connector gives headers as
``array<struct<key string, value binary>>``; :func:`packed_headers` turns that array into the
exact MessagePack bytes :func:`~.worker.pack_headers` writes, with Spark SQL expressions
(``aggregate`` over the array, length prefixes from ``hex``/``unhex``). Chosen over teaching
the decoder a second header form because it keeps one raw schema for every Kafka source (the
runtime unions all sources of a query by name, so a pipeline may mix both clients), keeps the
decoder and the Python path unchanged, and is the cheaper of the two (measured, 1M rows of
which a third carry one header: packing adds ~0.25 µs a row in the JVM, while decoding the
array form in Python costs ~0.6 µs a row more than unpacking MessagePack, on the cores Python
already saturates). Rows without headers (a ``null`` array) stay ``null``.

**Jars.** Spark's PyPI wheel ships no Kafka connector: :mod:`~.spark_jars` fetches it from
Maven Central once, and :func:`session_conf` says which setting a session needs for a
pipeline's sources (the jars must be on the classpath when the session starts).

**A shuffle keeps replays exact.** Onceflow keys a task's backup (with the input IDs it
committed) and its "done" mark by the task's index
(``batch.partition``), so a replayed micro-batch
must give every task the records it had the first time. The Python source plans one task per
Kafka partition in sorted order. Spark's connector orders its tasks by the iteration order
of a Scala map: for up to four topic-partitions that is the order the broker listed them the
first time, but the sorted order of the checkpoint's JSON on a replay. Measured on PySpark
4.3.0 with connector 4.2.0: a capped batch of one topic with three partitions ran as tasks
(p2, p1, p0) and replayed as (p0, p1, p2); a kill -9 after task 0 finished, then a resume,
lost that batch's 101 records of p0 (task 0 was "done", so its new input was skipped). So
:func:`spark_stream` hash-partitions the rows on ``(topic, partition, offset)``: a record's
task is then a function of the record alone, whatever order the scan had (and the work
spreads over every task, even from a topic with one partition). It costs a shuffle in the
JVM; the runtime could make it unnecessary by keying source tasks by what they read.

**Differences from the Python source**, by design of Spark's connector:

* ``on_data_loss="report"`` maps to ``failOnDataLoss=false``: Spark skips deleted records
  with a warning in the JVM log, where the Python source writes a ``data_loss`` dead letter
  and counts it. ``"fail"`` (the default) stops the query in both.
* ``max_records_per_batch`` becomes ``maxOffsetsPerTrigger``: it caps *offsets*, so
  transaction markers count against the cap.
* No consumer group: Spark keeps offsets only in its checkpoint, so ``group_id`` (and with it
  ``starting_offsets="committed"``) is refused for this client.
* No ticks: windows that need micro-batches without new records get them through the
  Python source's offsets (:mod:`onceflow.runtime.driver.ticks`); a source of this client asked to
  tick refuses to start rather than leave panes unfired.
* Connection options are translated from kafka-python's names to the Java client's
  (:data:`JAVA_OPTION_NAMES`, SASL PLAIN/SCRAM logins, a PEM CA file); options without a
  translation are refused rather than dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka.clients import check_client as check_worker_client
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.spark_jars import JARS_CONF, SPARK_CLIENT, session_conf
from onceflow.connectors.kafka.worker import RAW_COLUMNS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# SPARK_CLIENT and session_conf are the jars module's, imported from here by the source and the
# runtime.
__all__ = [
    "FAIL_ON_DATA_LOSS",
    "FORMAT",
    "JARS_CONF",
    "JAVA_OPTION_NAMES",
    "LOGIN_MODULES",
    "LOGIN_OPTIONS",
    "NOT_FOUND_ERRORS",
    "SPARK_CLIENT",
    "STABLE_TASK_COLUMNS",
    "KafkaRead",
    "check_client",
    "java_client_options",
    "packed_headers",
    "raw_columns",
    "reader_options",
    "session_conf",
    "spark_stream",
]

FORMAT = "kafka"
# Spark's error classes for a session without the connector (4.x names it; older: generic).
NOT_FOUND_ERRORS = ("KAFKA_DATA_SOURCE_NOT_ENABLED", "DATA_SOURCE_NOT_FOUND")


# Which task reads a record must not change when a micro-batch replays (see the module
# docstring): rows are hash-partitioned on these, over spark.sql.shuffle.partitions.
STABLE_TASK_COLUMNS = ("topic", "partition", "offset")
# Spark's option for each KafkaSource setting (``on_data_loss`` -> ``failOnDataLoss``).
FAIL_ON_DATA_LOSS = {"fail": "true", "report": "false"}
# kafka-python option -> Java client property (sent as ``kafka.<property>``).
JAVA_OPTION_NAMES: Mapping[str, str] = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "client_id": "client.id",
    "request_timeout_ms": "request.timeout.ms",
    "session_timeout_ms": "session.timeout.ms",
    "heartbeat_interval_ms": "heartbeat.interval.ms",
    "fetch_max_bytes": "fetch.max.bytes",
    "max_partition_fetch_bytes": "max.partition.fetch.bytes",
}
LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
LOGIN_OPTIONS = ("sasl_plain_username", "sasl_plain_password")


class KafkaRead(Protocol):
    """What a stream needs of its :class:`~.source.KafkaSource` (which imports this module)."""

    topics: list[str]
    starting_offsets: str
    max_records_per_batch: int | None
    on_data_loss: str
    tick_file: str | None

    @property
    def settings(self) -> KafkaSettings:
        """Connection settings."""


# -- the stream -------------------------------------------------------------------------------


def check_client(client: str, group_id: str | None) -> None:
    """Refuse an unknown client, and settings the Spark client cannot honour."""
    check_worker_client(client, "KafkaSource", others=(SPARK_CLIENT,))
    if client == SPARK_CLIENT and group_id:
        msg = (
            f"KafkaSource(client='spark') cannot use group_id={group_id!r}: Spark's connector "
            "keeps offsets only in its checkpoint (no consumer group, so no "
            "starting_offsets='committed' and no lag in the group). Drop group_id, or use "
            "client='python'"
        )
        raise ConnectorError(msg)


def spark_stream(source: KafkaRead, session: SparkSession) -> DataFrame:
    """The streaming DataFrame of raw records, read by Spark's Kafka connector."""
    if source.tick_file is not None:
        msg = (
            f"KafkaSource({', '.join(source.topics)!r}, client='spark') was chosen to tick: this "
            "pipeline's windows need micro-batches without new records, which Onceflow asks "
            "for through the offsets of the Python Kafka source, and Spark's connector has no "
            "such offset. Read this topic with client='python'"
        )
        raise ConnectorError(msg)
    reader = session.readStream.format(FORMAT)
    for key, value in reader_options(source).items():
        reader = reader.option(key, value)
    try:
        frame = reader.load()
    except Exception as exc:
        if not any(code in str(exc) for code in NOT_FOUND_ERRORS):
            raise
        msg = (
            "KafkaSource(client='spark') needs Spark's Kafka connector on the classpath of "
            "the session, set when the session starts; this session has none "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Start the session "
            f"with {JARS_CONF} from onceflow.connectors.kafka.spark_source.session_conf(...) "
            "(spark_session(extra_conf=...)), or use client='python'"
        )
        raise ConnectorError(msg) from exc
    return frame.select(*raw_columns()).repartition(*STABLE_TASK_COLUMNS)


def reader_options(source: KafkaRead) -> dict[str, str]:
    """The options of ``spark.readStream.format("kafka")`` for a source."""
    from onceflow.connectors.kafka.datasource import ISOLATION  # imports PySpark: not at start

    settings = source.settings
    options = {
        "kafka.bootstrap.servers": settings.bootstrap_servers,
        "subscribe": ",".join(source.topics),
        "startingOffsets": source.starting_offsets,
        "includeHeaders": "true",
        "kafka.isolation.level": ISOLATION,
        "failOnDataLoss": FAIL_ON_DATA_LOSS[source.on_data_loss],
    }
    if source.max_records_per_batch:
        options["maxOffsetsPerTrigger"] = str(int(source.max_records_per_batch))
    options.update({f"kafka.{k}": v for k, v in java_client_options(settings.options).items()})
    return options


def java_client_options(options: Mapping[str, Any]) -> dict[str, str]:
    """kafka-python connection options as Java client properties (refusing what has none)."""
    java: dict[str, str] = {}
    for key, value in options.items():
        if key in JAVA_OPTION_NAMES:
            java[JAVA_OPTION_NAMES[key]] = str(value)
        elif key == "ssl_cafile":
            java["ssl.truststore.type"] = "PEM"
            java["ssl.truststore.location"] = str(value)
        elif key == "ssl_check_hostname":
            java["ssl.endpoint.identification.algorithm"] = "https" if value else ""
        elif key not in LOGIN_OPTIONS:
            msg = (
                f"KafkaSource(client='spark') cannot pass the option {key!r} to Spark's Kafka "
                f"connector: it translates {', '.join(sorted(JAVA_OPTION_NAMES))}, ssl_cafile, "
                "ssl_check_hostname and SASL PLAIN/SCRAM logins. Remove it, or use "
                "client='python'"
            )
            raise ConnectorError(msg)
    if "sasl_plain_username" in options:
        java["sasl.jaas.config"] = _jaas(options)
    return java


def _jaas(options: Mapping[str, Any]) -> str:
    mechanism = str(options.get("sasl_mechanism", "PLAIN")).upper()
    module = LOGIN_MODULES.get(mechanism)
    if module is None:
        msg = (
            f"KafkaSource(client='spark') logs in with SASL {', '.join(LOGIN_MODULES)}, got "
            f"sasl_mechanism={mechanism!r}; use client='python' for other mechanisms"
        )
        raise ConnectorError(msg)
    user = json.dumps(str(options["sasl_plain_username"]), ensure_ascii=False)
    password = json.dumps(str(options.get("sasl_plain_password", "")), ensure_ascii=False)
    return f"{module} required username={user} password={password};"


# -- Spark's rows as the raw schema -------------------------------------------------------------


def raw_columns() -> list[Column]:
    """Spark's Kafka columns as :data:`~.worker.RAW_COLUMNS`, in that order."""
    from pyspark.sql import functions as F  # noqa: N812

    columns = {
        "topic": F.col("topic"),
        "partition": F.col("partition"),
        "offset": F.col("offset"),
        "ts": F.unix_millis(F.col("timestamp")),
        "key": F.col("key"),
        "value": F.col("value"),
        "headers": F.expr(packed_headers("headers")),
    }
    return [columns[name].alias(name) for name in RAW_COLUMNS]


def _big_endian(number: str, width: int) -> str:
    """SQL: the non-negative integer ``number`` as ``width`` big-endian bytes."""
    return f"unhex(lpad(hex({number}), {2 * width}, '0'))"


def _sized(number: str, tiny_base: int | None, tiny_limit: int, markers: tuple[str, ...]) -> str:
    """SQL: a MessagePack length prefix (fix-form below ``tiny_limit``, then 8/16/32 bits).

    ``markers`` are the type bytes of the 1-, 2- and 4-byte length forms (an empty marker
    means that form does not exist for the type, as for arrays, which have no 8-bit form).
    """
    cases = []
    if tiny_base is not None:
        cases.append(f"WHEN {number} < {tiny_limit} THEN unhex(hex({tiny_base} + {number}))")
    for marker, width in zip(markers, (1, 2, 4), strict=True):
        if marker:
            top = 1 << (8 * width)
            cases.append(
                f"WHEN {number} < {top} THEN concat(X'{marker}', {_big_endian(number, width)})"
            )
    return f"CASE {' '.join(cases)} END"


def packed_headers(column: str) -> str:
    """SQL: Spark's header array as :func:`~.worker.pack_headers` packs it (NULL when empty).

    MessagePack: an array of ``[key, value]`` pairs, keys as str (fixstr, str8/16/32), values
    as bin (bin8/16/32) or nil when the header has no value.
    """
    key = "cast(h.key AS BINARY)"
    key_len = f"octet_length({key})"
    value_len = "octet_length(h.value)"
    str_prefix = _sized(key_len, 0xA0, 32, ("D9", "DA", "DB"))
    bin_prefix = _sized(value_len, None, 0, ("C4", "C5", "C6"))
    array_prefix = _sized(f"size({column})", 0x90, 16, ("", "DC", "DD"))
    value = f"CASE WHEN h.value IS NULL THEN X'C0' ELSE concat({bin_prefix}, h.value) END"
    pair = f"concat(X'92', {str_prefix}, {key}, {value})"
    body = f"aggregate({column}, X'', (acc, h) -> concat(acc, {pair}))"
    return (
        f"CASE WHEN {column} IS NULL OR size({column}) = 0 THEN CAST(NULL AS BINARY) "
        f"ELSE concat({array_prefix}, {body}) END"
    )
