"""The Avro and Protobuf codecs against a real schema registry (Apicurio, Confluent API).

The wire format byte by byte, schema ids registered and looked up, Avro schema resolution
between older and newer writers and the source's reader schema, Protobuf's message index
path, and what becomes a dead letter (bytes not in the format, unknown ids, unresolvable
records) versus an error (the registry out of reach, a schema it refuses). Seconds in all.
"""

from __future__ import annotations

import io
import pickle
import struct
import uuid

import fastavro
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from onceflow.connectors.registry import Avro, Protobuf, SchemaRegistry, bind_codec
from onceflow.connectors.registry import client as registry_client
from onceflow.connectors.registry.wire import decode_indexes, encode_indexes, frame, unframe
from onceflow.kernel.errors import CodecError, ConfigError, ServiceError
from onceflow.testing.services import free_port

pytestmark = [pytest.mark.registry]

V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "item", "type": "string"}],
}
# V2 adds a field with a default: BACKWARD compatible (a V2 reader reads V1 records).
V2 = {
    **V1,
    "fields": [*V1["fields"], {"name": "qty", "type": "int", "default": 1}],
}


def _subject() -> str:
    return f"orders-{uuid.uuid4().hex[:8]}"


def test_the_wire_format_is_magic_byte_id_and_payload():
    assert frame(258, b"xy") == b"\x00\x00\x00\x01\x02xy"
    schema_id, payload = unframe(b"\x00\x00\x00\x01\x02xy")
    assert (schema_id, bytes(payload)) == (258, b"xy")
    with pytest.raises(CodecError, match="not the magic byte"):
        unframe(b'{"id": 1}')
    with pytest.raises(CodecError, match="fewer than the 5-byte header"):
        unframe(b"\x00\x01")
    # Protobuf's index path: [0] is one zero byte; others are zig-zag varints, length first
    assert encode_indexes((0,)) == b"\x00"
    assert encode_indexes((1, 0)) == b"\x04\x02\x00"
    assert encode_indexes((70,)) == b"\x02\x8c\x01"
    for path in [(0,), (1, 0), (3, 2, 70)]:
        found, rest = decode_indexes(memoryview(encode_indexes(path) + b"msg"))
        assert (found, bytes(rest)) == (path, b"msg")
    with pytest.raises(CodecError, match="cut short"):
        decode_indexes(memoryview(b"\x04\x82"))


def _no_http(*args: object) -> None:
    raise AssertionError("a registry call on the hot path")


def test_avro_records_carry_the_registered_id_and_decode_by_it(schema_registry, monkeypatch):
    topic = _subject()
    sink = bind_codec(Avro(schema_registry, V1), topic)
    assert sink.prepare is not None
    sink.prepare()  # registers V1 under <topic>-value
    data = sink.encode({"id": 7, "item": "tea"})
    schema_id = struct.unpack(">I", data[1:5])[0]
    assert data[0] == 0
    registry = SchemaRegistry(schema_registry)
    assert registry.lookup(f"{topic}-value", sink_schema_text(), "AVRO") == schema_id
    # the payload is plain Avro binary: an independent reader of the registered schema reads it
    kind, text = registry.schema_by_id(schema_id)
    assert kind == "AVRO"
    parsed = fastavro.parse_schema(__import__("json").loads(text))
    assert fastavro.schemaless_reader(io.BytesIO(data[5:]), parsed) == {"id": 7, "item": "tea"}
    source = bind_codec(Avro(schema_registry), topic)
    assert source.decode(data) == {"id": 7, "item": "tea"}
    # the schema is asked for once per id and process: no HTTP call per record after that
    monkeypatch.setattr(SchemaRegistry, "_call", _no_http)
    assert [source.decode(data) for _ in range(3)] == [{"id": 7, "item": "tea"}] * 3
    assert (
        bind_codec(Avro(schema_registry, V1), topic).encode({"id": 9, "item": "x"})[:5] == data[:5]
    )
    # the codec pickles to workers with its id: encoding there makes no registry call
    again = pickle.loads(pickle.dumps(sink))
    assert again.encode({"id": 8, "item": "jam"})[1:5] == data[1:5]


def sink_schema_text() -> str:
    return Avro("http://127.0.0.1:1", V1).writer_schema()


def test_a_reader_schema_resolves_older_and_newer_writers(schema_registry):
    topic = _subject()
    old = bind_codec(Avro(schema_registry, V1), topic)
    new = bind_codec(Avro(schema_registry, V2), topic)
    old_record = old.encode({"id": 1, "item": "tea"})
    new_record = new.encode({"id": 2, "item": "jam", "qty": 5})
    assert old_record[1:5] != new_record[1:5], "two versions, two ids"

    as_v2 = bind_codec(Avro(schema_registry, V2), topic)
    assert as_v2.decode(old_record) == {"id": 1, "item": "tea", "qty": 1}, "default filled in"
    assert as_v2.decode(new_record) == {"id": 2, "item": "jam", "qty": 5}
    as_v1 = bind_codec(Avro(schema_registry, V1), topic)
    assert as_v1.decode(new_record) == {"id": 2, "item": "jam"}, "newer field skipped"
    as_written = bind_codec(Avro(schema_registry), topic)
    assert as_written.decode(new_record) == {"id": 2, "item": "jam", "qty": 5}

    # a reader needing a field the writer lacks, with no default: not resolvable
    strict = {**V1, "fields": [*V1["fields"], {"name": "price", "type": "double"}]}
    with pytest.raises(CodecError, match="as the reader schema"):
        bind_codec(Avro(schema_registry, strict), topic).decode(old_record)


def test_what_cannot_be_decoded_says_why(schema_registry):
    codec = bind_codec(Avro(schema_registry, V1), _subject())
    with pytest.raises(CodecError, match="magic byte"):
        codec.decode(b'{"id": 1, "item": "tea"}')
    with pytest.raises(CodecError, match="schema id 987654 is not in the schema registry"):
        codec.decode(frame(987654, b"\x02\x06tea"))
    good = codec.encode({"id": 1, "item": "tea"})
    with pytest.raises(CodecError, match="cannot read an Avro value"):
        codec.decode(good[:6])  # cut short
    with pytest.raises(CodecError, match="does not fit the Avro schema"):
        codec.encode({"id": "one", "item": "tea"})


def test_registry_refusals_and_outages_are_errors_not_dead_letters(schema_registry, monkeypatch):
    monkeypatch.setattr(registry_client, "BACKOFF_S", 0.0)  # the retries of an outage, at once
    topic = _subject()
    off = bind_codec(Avro(schema_registry, V1, auto_register=False), topic)
    assert off.prepare is not None
    with pytest.raises(ConfigError, match="not registered under subject .*auto_register is off"):
        off.prepare()
    registry = SchemaRegistry(schema_registry)
    registry.register(f"{topic}-value", sink_schema_text(), "AVRO")
    off.prepare()  # now it is there

    # an incompatible change under a BACKWARD subject is refused, before any record is written
    _set_compatibility(schema_registry, f"{topic}-value", "BACKWARD")
    breaking = {**V1, "fields": [{"name": "id", "type": "string"}]}
    with pytest.raises(ConfigError, match="refused the schema"):
        bind_codec(Avro(schema_registry, breaking), topic).prepare()  # type: ignore[misc]

    down = bind_codec(Avro(f"http://127.0.0.1:{free_port()}", V1), topic)
    with pytest.raises(ServiceError, match="could not be reached"):
        down.decode(frame(424242, b""))


def _set_compatibility(url: str, subject: str, level: str) -> None:
    import json
    import urllib.request

    request = urllib.request.Request(
        f"{url}/config/{subject}",
        data=json.dumps({"compatibility": level}).encode(),
        headers={"Content-Type": registry_client.CONTENT_TYPE},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


def test_credentials_are_sent_and_never_printed():
    """Basic auth reaches the server in the Authorization header (Apicurio needs Keycloak for
    auth, so a loopback HTTP server stands in to see the header); no repr shows it."""
    import base64
    import http.server
    import json
    import threading

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"schema": json.dumps(V1), "schemaType": "AVRO"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://alice:s3cret@127.0.0.1:{server.server_port}/base/"
        registry = SchemaRegistry(url)
        assert registry.url == f"http://127.0.0.1:{server.server_port}/base"
        assert registry.schema_by_id(77_000 + server.server_port)[0] == "AVRO"
        codec = Avro(SchemaRegistry(registry.url, username="bob", password="pw"), V1)
        assert bind_codec(codec, "t").decode(frame(78_000 + server.server_port, b"\x02\x02x"))
    finally:
        server.shutdown()
    assert seen == [
        "Basic " + base64.b64encode(b"alice:s3cret").decode(),
        "Basic " + base64.b64encode(b"bob:pw").decode(),
    ]
    for shown in (repr(registry), repr(codec), repr(Avro(url, V1))):
        assert "s3cret" not in shown and "alice" not in shown and "pw" not in shown
    with pytest.raises(ConfigError, match="http"):
        SchemaRegistry("registry:8081")


def _order_class():
    """A Protobuf message type built at run time, as protoc's output would define it."""
    file = descriptor_pb2.FileDescriptorProto(name=f"o{uuid.uuid4().hex[:6]}.proto", package="shop")
    file.syntax = "proto3"
    other = file.message_type.add(name="Other")
    other.field.add(name="x", number=1, type=5, label=1)
    line = file.message_type.add(name="Order")
    line.field.add(name="id", number=1, type=3, label=1)  # int64
    line.field.add(name="item", number=2, type=9, label=1)  # string
    line.field.add(name="tags", number=3, type=9, label=3)  # repeated string
    nested = line.nested_type.add(name="Note")
    nested.field.add(name="text", number=1, type=9, label=1)
    line.field.add(name="note", number=4, type=11, label=1, type_name=".shop.Order.Note")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    full = descriptor_pb2.FileDescriptorSet(file=[file]).SerializeToString()
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order")), full


def test_protobuf_values_carry_their_message_index_path(schema_registry):
    order, file_set = _order_class()
    topic = _subject()
    sink = bind_codec(Protobuf(schema_registry, order), topic)
    data = sink.encode({"id": 2**40, "item": "tea", "tags": ["a", "b"], "note": None})
    schema_id, payload = unframe(data)
    indexes, body = decode_indexes(payload)
    assert indexes == (1,), "Order is the file's second message"
    assert order.FromString(bytes(body)).id == 2**40
    assert SchemaRegistry(schema_registry).schema_by_id(schema_id)[0] == "PROTOBUF"

    source = bind_codec(Protobuf(schema_registry, "shop.Order", descriptors=file_set), topic)
    assert source.decode(data) == {"id": 2**40, "item": "tea", "tags": ["a", "b"], "note": None}
    noted = sink.encode(order(id=1, note={"text": "hi"}))
    assert source.decode(noted)["note"] == {"text": "hi"}
    # a value of another message type of the file is not read as an Order
    wrong = frame(schema_id, encode_indexes((0,)) + bytes(body))
    with pytest.raises(CodecError, match="message \\[0\\]"):
        source.decode(wrong)
    # an Avro schema id is not a Protobuf one
    avro_id = SchemaRegistry(schema_registry).register(f"{topic}-a", sink_schema_text(), "AVRO")
    with pytest.raises(CodecError, match="is a AVRO schema"):
        source.decode(frame(avro_id, b"\x00"))
    pickle.loads(pickle.dumps(source))  # a class built at run time still travels to workers


def _source_decode(source, values):
    """What a Kafka source's decoder makes of raw values at offsets 0, 1 ... of ``t:0``."""
    import pyarrow as pa

    from onceflow.connectors.kafka.worker import RAW_COLUMNS, pack_headers

    n = len(values)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(["t"] * n, pa.string()),
            pa.array([0] * n, pa.int32()),
            pa.array(range(n), pa.int64()),
            pa.array([1] * n, pa.int64()),
            pa.array([None] * n, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([pack_headers([])] * n, pa.binary()),
        ],
        names=list(RAW_COLUMNS),
    )
    from tests.connectors.test_source_decoding import flat

    return flat(source.decoder("src", True)(batch))


def test_a_source_dead_letters_bad_values_but_fails_when_the_registry_is_away(
    schema_registry, monkeypatch
):
    monkeypatch.setattr(registry_client, "BACKOFF_S", 0.0)
    from onceflow.connectors.kafka.source import KafkaSource
    from onceflow.kernel.records import DeadLetter, Record

    topic = _subject()
    good = bind_codec(Avro(schema_registry, V1), topic).encode({"id": 1, "item": "tea"})
    source = KafkaSource("t", bootstrap_servers="127.0.0.1:1", codec=Avro(schema_registry, V2))
    record, letter, unknown = _source_decode(source, [good, b"plain", frame(876543, b"")])
    assert isinstance(record, Record) and record.elem == {"id": 1, "item": "tea", "qty": 1}
    assert isinstance(letter, DeadLetter) and letter.code == "undecodable"
    assert "cannot decode as avro" in letter.error and "magic byte" in letter.error
    assert isinstance(unknown, DeadLetter) and "schema id 876543 is not in" in unknown.error

    away = Avro(f"http://127.0.0.1:{free_port()}", V2)
    source = KafkaSource("t", bootstrap_servers="127.0.0.1:1", codec=away)
    with pytest.raises(ServiceError, match="could not be reached"):
        _source_decode(source, [frame(876544, b"")])  # not written off as undecodable


def test_protobuf_values_read_and_written_by_confluents_serializers(schema_registry):
    """Confluent's own Protobuf serializer and deserializer agree with the codec, byte for byte
    on the header and index path (an independent implementation of the format)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    order, _ = _order_class()
    topic = _subject()
    context = SerializationContext(topic, MessageField.VALUE)
    theirs = ProtobufSerializer(
        order, SchemaRegistryClient({"url": schema_registry}), {"use.deprecated.format": False}
    )(order(id=5, item="x", tags=["t"]), context)
    ours = bind_codec(Protobuf(schema_registry, order), topic)
    assert ours.decode(theirs) == {"id": 5, "item": "x", "tags": ["t"], "note": None}
    back = ProtobufDeserializer(order, {"use.deprecated.format": False})(
        ours.encode({"id": 6, "item": "y", "note": {"text": "n"}}), context
    )
    assert (back.id, back.item, back.note.text) == (6, "y", "n")
