"""Protobuf values with a schema registry (``pip install 'onceflow[protobuf]'``).

The user gives the message type: a generated class (``orders_pb2.Order``), or its full name
with ``descriptors=`` a serialized ``FileDescriptorSet`` (``protoc --include_imports
--descriptor_set_out=orders.desc orders.proto``). The codec keeps the type as that descriptor
set and builds the class again where it decodes (a generated class need not be importable on
the workers).

Decoding reads the wire format's message index path, checks that it names the codec's message
type and that the schema id is a Protobuf schema of the registry, and parses. Protobuf's own
rules make old and new writers compatible: an unknown field is skipped, a missing one reads
as its default. A value comes out as a dict by field name: nested messages as dicts (None when
unset), repeated fields as lists, maps as dicts, enums as their names, 64-bit integers as ints.

Encoding takes such a dict (or a message) and registers the message's ``.proto`` file as the
subject's schema: ``schema=`` the ``.proto`` text, or by default the file descriptor, base64
encoded, as Confluent's serializers register it (registries accept both forms).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from onceflow.connectors.registry.client import SchemaRegistry
from onceflow.connectors.registry.codecs import RegistryCodec
from onceflow.connectors.registry.wire import decode_indexes, encode_indexes, frame
from onceflow.kernel.errors import CodecError, ConfigError

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from google.protobuf.message import DecodeError, Message
except ImportError:  # pragma: no cover - an optional extra
    descriptor_pb2 = None

# Per process: (descriptor set bytes, full name) -> the message class built from them.
_CLASSES: dict[tuple[bytes, str], Any] = {}


def _file_set(cls: Any) -> bytes:
    """The FileDescriptorSet of a generated class's file and of all it imports."""
    files: dict[str, Any] = {}

    def add(file: Any) -> None:
        if file.name in files:
            return
        for dep in file.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        files[file.name] = proto

    add(cls.DESCRIPTOR.file)
    found: bytes = descriptor_pb2.FileDescriptorSet(file=list(files.values())).SerializeToString()
    return found


def _message_class(file_set: bytes, full_name: str) -> Any:
    key = (file_set, full_name)
    cls = _CLASSES.get(key)
    if cls is None:
        pool = descriptor_pool.DescriptorPool()
        for file in descriptor_pb2.FileDescriptorSet.FromString(file_set).file:
            pool.Add(file)
        try:
            cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))
        except KeyError:
            msg = f"the Protobuf descriptors hold no message type {full_name!r}"
            raise ConfigError(msg) from None
        _CLASSES[key] = cls
    return cls


def _index_path(descriptor: Any) -> tuple[int, ...]:
    """Where a message type sits in its file: top-level index, then nested indexes."""
    path: list[int] = []
    while descriptor.containing_type is not None:
        path.append(descriptor.containing_type.nested_types.index(descriptor))
        descriptor = descriptor.containing_type
    top = list(descriptor.file.message_types_by_name.values())
    path.append(top.index(descriptor))
    return tuple(reversed(path))


def to_value(message: Any) -> dict[str, Any]:
    """A message as plain values (see the module docstring)."""
    return {
        f.name: _field_value(f, getattr(message, f.name), message)
        for f in message.DESCRIPTOR.fields
    }


def _field_value(field: Any, value: Any, parent: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {k: _single(value_field, v) for k, v in value.items()}
    if field.is_repeated:
        return [_single(field, v) for v in value]
    if field.message_type is not None and not parent.HasField(field.name):
        return None
    return _single(field, value)


def _single(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return to_value(value)
    if field.enum_type is not None:
        named = field.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    return value


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


class Protobuf(RegistryCodec):
    """Protobuf in the Confluent wire format, with a registry (see the module docstring)."""

    schema_type = "PROTOBUF"
    name = "protobuf"

    def __init__(
        self,
        registry: str | SchemaRegistry,
        message: Any,
        *,
        descriptors: bytes | str | Path | None = None,
        schema: str | None = None,
        subject: str | None = None,
        auto_register: bool = True,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if descriptor_pb2 is None:
            msg = "the Protobuf codec needs protobuf: pip install 'onceflow[protobuf]'"
            raise ConfigError(msg)
        super().__init__(
            registry,
            subject=subject,
            auto_register=auto_register,
            username=username,
            password=password,
        )
        if isinstance(message, str):
            if descriptors is None:
                msg = (
                    f"Protobuf({message!r}) needs descriptors= a FileDescriptorSet (bytes or path)"
                )
                raise ConfigError(msg)
            raw = descriptors if isinstance(descriptors, bytes) else Path(descriptors).read_bytes()
            self.file_set, self.full_name = raw, message
        elif isinstance(message, type) and issubclass(message, Message):
            descriptor: Any = message.DESCRIPTOR  # type: ignore[attr-defined]
            self.file_set, self.full_name = _file_set(message), descriptor.full_name
        else:
            msg = (
                "Protobuf(registry, message) takes a generated message class, or a full message "
                f"name with descriptors=; got {type(message).__name__}"
            )
            raise ConfigError(msg)
        cls = self.message_class()
        self.indexes = _index_path(cls.DESCRIPTOR)
        self.schema = schema

    def message_class(self) -> Any:
        """The message class, built from the descriptors (once per process)."""
        return _message_class(self.file_set, self.full_name)

    def writer_schema(self) -> str:
        """The ``.proto`` text given, else the message's file descriptor in base64."""
        if self.schema is not None:
            return self.schema
        file = self.message_class().DESCRIPTOR.file
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        return base64.b64encode(proto.SerializeToString()).decode("ascii")

    def decode_payload(self, schema_id: int, payload: memoryview) -> Any:
        """The message as a dict, if its index path names this codec's type."""
        indexes, body = decode_indexes(payload)
        self.check_schema_type(schema_id)
        if indexes != self.indexes:
            msg = (
                f"the value is message {list(indexes)} of schema id {schema_id}; this codec "
                f"reads {self.full_name}, message {list(self.indexes)} of its file"
            )
            raise CodecError(msg)
        try:
            return to_value(self.message_class().FromString(bytes(body)))
        except DecodeError as exc:
            msg = f"cannot parse a {self.full_name} of schema id {schema_id}: {exc}"
            raise CodecError(msg) from exc

    def encode_payload(self, schema_id: int, value: Any) -> bytes:
        """A dict (or a message) as a framed, indexed message."""
        cls = self.message_class()
        try:
            message = value if isinstance(value, Message) else cls(**_without_none(value))
            body = message.SerializeToString()
        except Exception as exc:
            msg = f"the value does not fit {self.full_name}: {type(exc).__name__}: {exc}"
            raise CodecError(msg) from exc
        return frame(schema_id, encode_indexes(self.indexes) + body)
