"""Kafka in and out, with kafka-python or confluent-kafka, for Spark Structured Streaming.

:mod:`~.source` the source users configure and its decoding; :mod:`~.sink` the sink, with
:mod:`~.dead_letters` its dead-letter variant, :mod:`~.serialization` the records' layout,
:mod:`~.writer` the plain writer, :mod:`~.transactional_writer` the transactional one (its
commit protocol), :mod:`~.transactional_producers` registering and fencing transactional
ids and :mod:`~.delivery_log` the markers; :mod:`~.datasource` the Spark data source on the
driver; :mod:`~.worker` reading on the workers; :mod:`~.offsets` offset arithmetic;
:mod:`~.clients` the workers' clients (the :mod:`~.interface` both libraries implement,
:mod:`~.kafka_python` and :mod:`~.confluent`, with :mod:`~.confluent_config` the
translation of settings to librdkafka's); :mod:`~.admin` topic administration (creation,
replication, timestamp bounds); :mod:`~.spark_source` Spark's own connector, with
:mod:`~.spark_jars` fetching its jars; :mod:`~.topics` producing and reading whole topics
outside Spark.

The names below are imported when first used (PEP 562): Spark's planner processes import
:mod:`~.datasource` only, not the sink and the source with their codecs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onceflow.kernel.lazy import exports

if TYPE_CHECKING:
    from onceflow.connectors.kafka.dead_letters import KafkaDeadLetterSink
    from onceflow.connectors.kafka.sink import KafkaSink
    from onceflow.connectors.kafka.source import KafkaSource

# name -> the module that defines it
_EXPORTS = {
    "KafkaDeadLetterSink": "onceflow.connectors.kafka.dead_letters",
    "KafkaSink": "onceflow.connectors.kafka.sink",
    "KafkaSource": "onceflow.connectors.kafka.source",
}


if not TYPE_CHECKING:  # mypy sees the names above, and flags a misspelt one
    __getattr__, __dir__ = exports(globals(), _EXPORTS)

__all__ = ["KafkaDeadLetterSink", "KafkaSink", "KafkaSource"]
