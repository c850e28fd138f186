"""Avro values with a schema registry (``pip install 'onceflow[avro]'``, fastavro).

Decoding resolves each record's *writer* schema (the one its schema id names) against the
source's *reader* schema, as Avro's schema resolution says: a field the writer lacks takes
the reader's default, a field the reader lacks is skipped, ``int`` widens to ``long``,
``float`` or ``double``, a union takes the first branch that matches... Records written by
older or newer compatible schemas thus all come out in the reader's shape. A record that
cannot be resolved (say, the writer lacks a field the reader has no default for) is a dead
letter with fastavro's reason. With no reader schema, each record comes out as written.

Values are plain Python (dict, list, str, bytes, int, float, bool, None), as Onceflow records
must be: logical types are read and written as their underlying Avro type
(``timestamp-millis`` as an int of milliseconds, ``decimal`` as bytes, ``uuid`` as str,
``date`` as an int of days). The schema registered keeps its logical types.
"""

from __future__ import annotations

import io
import json
from typing import Any

from onceflow.connectors.registry.client import SchemaRegistry
from onceflow.connectors.registry.codecs import RegistryCodec
from onceflow.connectors.registry.wire import frame
from onceflow.kernel.errors import CodecError, ConfigError

fastavro: Any
try:
    import fastavro
except ImportError:  # pragma: no cover - an optional extra
    fastavro = None

# Per process: (registry url, schema id) -> the parsed writer schema.
_PARSED: dict[tuple[str, int], Any] = {}


def _plain(schema: Any) -> Any:
    """``schema`` without logical types (see the module docstring), as JSON values."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_plain(v) for v in schema]
    return schema


def _schema_json(schema: str | dict[str, Any] | list[Any] | None, what: str) -> Any:
    if schema is None or not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except ValueError:
        if schema.strip().startswith(("{", "[", '"')):
            msg = f"the Avro {what} is not valid JSON: {schema[:80]!r}"
            raise ConfigError(msg) from None
        return schema  # a primitive type name: "string", "long" ...


def _parse(schema: Any, what: str) -> Any:
    try:
        return fastavro.parse_schema(_plain(schema))
    except Exception as exc:
        msg = f"the Avro {what} does not parse: {type(exc).__name__}: {exc}"
        raise ConfigError(msg) from exc


class Avro(RegistryCodec):
    """Avro in the Confluent wire format, with schemas in a registry (see the module docstring).

    ``schema`` (a dict, or its JSON text): on a sink, the schema records are written with
    (registered under ``<topic>-value``, or looked up with ``auto_register=False``); on a
    source, the *reader* schema records are resolved to (None: each record as written).
    """

    schema_type = "AVRO"
    name = "avro"

    def __init__(
        self,
        registry: str | SchemaRegistry,
        schema: str | dict[str, Any] | list[Any] | None = None,
        *,
        subject: str | None = None,
        auto_register: bool = True,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if fastavro is None:
            msg = "the Avro codec needs fastavro: pip install 'onceflow[avro]'"
            raise ConfigError(msg)
        super().__init__(
            registry,
            subject=subject,
            auto_register=auto_register,
            username=username,
            password=password,
        )
        self.schema = _schema_json(schema, "schema")
        self._parsed = None if self.schema is None else _parse(self.schema, "schema")

    def writer_schema(self) -> str:
        """The schema's JSON text, as registered (with its logical types)."""
        if self.schema is None:
            msg = "an Avro codec writing to Kafka needs its schema: Avro(registry, schema=...)"
            raise ConfigError(msg)
        return json.dumps(self.schema, separators=(",", ":"))

    def writer(self, schema_id: int) -> Any:
        """The parsed schema ``schema_id`` names (fetched and parsed once per process)."""
        key = (self.registry.url, schema_id)
        parsed = _PARSED.get(key)
        if parsed is None:
            text = self.check_schema_type(schema_id)
            try:
                parsed = fastavro.parse_schema(_plain(json.loads(text)))
            except Exception as exc:
                msg = f"schema id {schema_id} is not an Avro schema fastavro reads: {exc}"
                raise CodecError(msg) from exc
            _PARSED[key] = parsed
        return parsed

    def decode_payload(self, schema_id: int, payload: memoryview) -> Any:
        """The record resolved from its writer schema to the reader schema (if any)."""
        writer = self.writer(schema_id)
        stream = io.BytesIO(payload)
        try:
            value = fastavro.schemaless_reader(stream, writer, self._parsed)
        except Exception as exc:
            msg = (
                f"cannot read an Avro value of schema id {schema_id}"
                f"{' as the reader schema' if self._parsed is not None else ''}: "
                f"{type(exc).__name__}: {exc}"
            )
            raise CodecError(msg) from exc
        if stream.tell() != len(payload):
            msg = (
                f"an Avro value of schema id {schema_id} has {len(payload) - stream.tell()} "
                "bytes left over after the record: it was not written with that schema"
            )
            raise CodecError(msg)
        return value

    def encode_payload(self, schema_id: int, value: Any) -> bytes:
        """``value`` in Avro's binary encoding, framed with ``schema_id``."""
        out = io.BytesIO()
        try:
            fastavro.schemaless_writer(out, self._parsed, value)
        except Exception as exc:
            msg = f"the value does not fit the Avro schema: {type(exc).__name__}: {exc}"
            raise CodecError(msg) from exc
        return frame(schema_id, out.getvalue())
