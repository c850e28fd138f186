"""Avro and Protobuf values with a schema registry, in the Confluent wire format.

:mod:`~.wire` the format (magic byte, schema id, Protobuf's message index path);
:mod:`~.client` the registry's REST API, cached per process; :mod:`~.codecs` what the codecs
share and how a source or sink binds one to its topic; :mod:`~.avro` and :mod:`~.protobuf`
the codecs. Users import them as ``onceflow.codecs.Avro`` / ``onceflow.codecs.Protobuf``.
"""

from __future__ import annotations

from onceflow.connectors.registry.avro import Avro
from onceflow.connectors.registry.client import SchemaRegistry
from onceflow.connectors.registry.codecs import RegistryCodec, bind_codec
from onceflow.connectors.registry.protobuf import Protobuf

__all__ = ["Avro", "Protobuf", "RegistryCodec", "SchemaRegistry", "bind_codec"]
