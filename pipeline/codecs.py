"""Codecs that need more than a name: Avro and Protobuf with a schema registry.

``KafkaSource(topic, codec=onceflow.codecs.Avro("http://registry:8081", schema))``;
see :mod:`onceflow.connectors.registry` (re-exported from there).
"""

from __future__ import annotations

from onceflow.connectors.registry import Avro, Protobuf, SchemaRegistry

__all__ = ["Avro", "Protobuf", "SchemaRegistry"]
