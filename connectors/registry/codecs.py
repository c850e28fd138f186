"""What Avro and Protobuf codecs share: a registry, a subject, the schema id the sink writes.

A registry codec is bound to the topic of the source or sink it is given to
(:func:`bind_codec`), which makes a :class:`~onceflow.kernel.codec.ValueCodec` out of it:

- decoding reads the wire format (:mod:`.wire`), fetches the writer's schema by its id
  (once per id and process, see :mod:`.client`) and decodes;
- encoding writes with the codec's ``schema`` under the id the subject gives it: the
  ``prepare`` hook, run by the sink on the driver before the run, registers the schema
  (``auto_register=True``) or looks it up (``auto_register=False``: it must be there), so that
  a misconfiguration stops the run at once, with one line, and the workers get the id with
  the pickled sink: they make no HTTP call to write.

The subject is ``<topic>-value`` (Confluent's TopicNameStrategy) unless ``subject`` is given.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from onceflow.connectors.registry.client import SchemaRegistry, as_registry
from onceflow.connectors.registry.wire import unframe
from onceflow.kernel.codec import ValueCodec, value_codec
from onceflow.kernel.errors import CodecError, ConfigError


class RegistryCodec(abc.ABC):
    """A codec whose values carry a schema id of a schema registry (the Confluent wire format).

    ``registry``: its URL or a :class:`SchemaRegistry`; ``username``/``password`` log in with
    HTTP basic auth (never printed). ``subject``: where the sink registers or looks up its
    schema (default ``<topic>-value``). ``auto_register``: the sink registers its schema
    (default) or only looks it up, failing before the run if it is not registered.
    """

    schema_type = "AVRO"
    name = "avro"

    def __init__(
        self,
        registry: str | SchemaRegistry,
        *,
        subject: str | None = None,
        auto_register: bool = True,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.registry = as_registry(registry, username=username, password=password)
        self.subject = subject
        self.auto_register = auto_register

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.registry!r}, subject={self.subject!r})"

    def subject_for(self, topic: str) -> str:
        """The subject of ``topic``'s values: ``subject`` if given, else ``<topic>-value``."""
        return self.subject or f"{topic}-value"

    @abc.abstractmethod
    def writer_schema(self) -> str:
        """The schema text the sink registers (ConfigError if this codec has none)."""

    @abc.abstractmethod
    def decode_payload(self, schema_id: int, payload: memoryview) -> Any:
        """One value of a wire-format record: its schema id and the bytes after the header."""

    @abc.abstractmethod
    def encode_payload(self, schema_id: int, value: Any) -> bytes:
        """One value as a whole wire-format record (header included)."""

    def check_schema_type(self, schema_id: int) -> str:
        """The text of ``schema_id``'s schema; CodecError if it is not of this codec's type."""
        found_type, text = self.registry.schema_by_id(schema_id)
        if found_type != self.schema_type:
            msg = (
                f"schema id {schema_id} is a {found_type} schema; this source decodes "
                f"{self.schema_type} (codec {self.name})"
            )
            raise CodecError(msg)
        return text


@dataclass
class BoundCodec:
    """A registry codec bound to a topic: the functions of its :class:`ValueCodec`."""

    codec: RegistryCodec
    topic: str
    schema_id: int | None = field(default=None)

    @property
    def subject(self) -> str:
        """The subject the sink's schema is under."""
        return self.codec.subject_for(self.topic)

    def prepare(self) -> None:
        """Find the id to write with: register the schema, or look it up (auto_register off)."""
        if self.schema_id is not None:
            return
        schema = self.codec.writer_schema()
        registry, subject, kind = self.codec.registry, self.subject, self.codec.schema_type
        if self.codec.auto_register:
            self.schema_id = registry.register(subject, schema, kind)
            return
        found = registry.lookup(subject, schema, kind)
        if found is None:
            msg = (
                f"the schema of codec {self.codec.name} is not registered under subject "
                f"{subject!r} at {registry.url}, and auto_register is off; register it "
                "first, or pass auto_register=True"
            )
            raise ConfigError(msg)
        self.schema_id = found

    def decode(self, data: bytes) -> Any:
        """A wire-format value decoded with the writer's schema (and the reader's, if given)."""
        schema_id, payload = unframe(data)
        return self.codec.decode_payload(schema_id, payload)

    def encode(self, value: Any) -> bytes:
        """``value`` in the wire format, under the subject's id (found once, see prepare)."""
        if self.schema_id is None:
            self.prepare()
        assert self.schema_id is not None
        return self.codec.encode_payload(self.schema_id, value)


def bind_codec(codec: str | ValueCodec | RegistryCodec, topic: str) -> ValueCodec:
    """The :class:`ValueCodec` of a source or sink of ``topic``, from a name or a codec."""
    if isinstance(codec, RegistryCodec):
        bound = BoundCodec(codec, topic)
        return ValueCodec(codec.name, bound.decode, bound.encode, bound.prepare)
    if isinstance(codec, ValueCodec):
        return codec
    return value_codec(codec)
