"""Kafka in and out, with kafka-python or confluent-kafka, for Spark Structured Streaming.

:mod:`~.source` the source users configure and its decoding; :mod:`~.sink` the sink;
:mod:`~.datasource` the Spark data source on the driver; :mod:`~.worker` reading on the
workers; :mod:`~.offsets` offset arithmetic; :mod:`~.clients` the workers' clients (the
:mod:`~.interface` both libraries implement, :mod:`~.kafka_python` and :mod:`~.confluent`);
:mod:`~.admin` topic administration (creation, replication, timestamp bounds);
:mod:`~.spark_source` Spark's own connector; :mod:`~.topics` producing and reading whole
topics outside Spark.
"""

from __future__ import annotations

from onceflow.connectors.kafka.sink import KafkaDeadLetterSink, KafkaSink
from onceflow.connectors.kafka.source import KafkaSource

__all__ = ["KafkaDeadLetterSink", "KafkaSink", "KafkaSource"]
