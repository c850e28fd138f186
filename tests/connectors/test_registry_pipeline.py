"""Avro through a pipeline, end to end: Kafka in, decode, transform, Avro out to Kafka.

The input is written by Confluent's own registry-aware serializer (confluent-kafka's
``AvroSerializer``, an implementation independent of Onceflow's) with two versions of the
schema, plus a value not in the wire format and one naming a schema id the registry does not
have. The pipeline reads with a reader schema (the newer version), so the older records come
out with the new field's default; the two bad values become dead letters with their reasons,
as does one output that does not fit the output schema (the sink refuses it).
An independent ``read_committed`` reader with Confluent's ``AvroDeserializer`` then checks
every output record once, with the right values, under the id the sink registered.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from onceflow.codecs import Avro
from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.serialization import CODE_HEADER, ERROR_HEADER
from onceflow.connectors.kafka.topics import read_topic
from onceflow.connectors.registry.wire import frame
from onceflow.pipeline import Pipeline
from onceflow.testing.harness import Crash, crash_and_resume

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.spark, pytest.mark.registry]

V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [{"name": "id", "type": "long"}, {"name": "item", "type": "string"}],
}
V2 = {**V1, "fields": [*V1["fields"], {"name": "qty", "type": "int", "default": 1}]}
TOTAL = {
    "type": "record",
    "name": "Line",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "label", "type": "string"},
        {"name": "qty", "type": "int"},
    ],
}
OLD, NEW = 40, 60  # records written with V1, then with V2
POISON_OUT = 13  # its output does not fit the output schema: a dead letter of the sink


def _produce(bootstrap: str, registry_url: str, topic: str, old: int = OLD, new: int = NEW) -> None:
    """``old`` orders written with V1, two bad values, then ``new`` orders written with V2."""
    registry = SchemaRegistryClient({"url": registry_url})
    context = SerializationContext(topic, MessageField.VALUE)
    as_v1 = AvroSerializer(registry, json.dumps(V1))
    as_v2 = AvroSerializer(registry, json.dumps(V2))
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(old):
        producer.produce(topic, as_v1({"id": i, "item": f"old-{i}"}, context))
    producer.produce(topic, b'{"id": -1, "item": "not in the wire format"}')
    producer.produce(topic, frame(99_999_999, b"\x02\x02x"))  # an id the registry lacks
    for i in range(old, old + new):
        producer.produce(topic, as_v2({"id": i, "item": f"new-{i}", "qty": i % 5 + 2}, context))
    producer.flush(30)


def _label(order: dict) -> dict:
    """The transform; order 13's label is None, which the output schema does not allow."""
    label = None if order["id"] == POISON_OUT else order["item"].upper()
    return {"id": order["id"], "label": label, "qty": order["qty"]}


def test_avro_records_of_two_schema_versions_go_through_once_and_poison_to_dead_letters(
    spark, broker, redis_server, schema_registry, tmp_path, topic_name
):
    src, out, name = topic_name("orders"), topic_name("lines"), topic_name("avro")
    _set_backward(schema_registry, f"{src}-value")
    _produce(broker.bootstrap, schema_registry, src)

    p = Pipeline(name)
    p.read(
        "orders",
        KafkaSource(src, bootstrap_servers=broker.bootstrap, codec=Avro(schema_registry, V2)),
    ).map("label", _label).write(
        "lines",
        KafkaSink(out, bootstrap_servers=broker.bootstrap, codec=Avro(schema_registry, TOTAL)),
    )
    result = p.run(
        session=spark,
        redis_url=redis_server.url,
        available_now=True,
        checkpoint=os.path.join(tmp_path, "ckpt"),
        output_dir=str(tmp_path),
        progress=False,
    )
    assert result.counters["orders/undecodable"] == 2

    settings = KafkaSettings(broker.bootstrap)
    reader = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}))
    context = SerializationContext(out, MessageField.VALUE)
    written = read_topic(settings, out, committed=True)
    lines = [reader(r.value, context) for r in written]
    expected = [{"id": i, "label": f"OLD-{i}", "qty": 1} for i in range(OLD) if i != POISON_OUT]
    expected += [{"id": i, "label": f"NEW-{i}", "qty": i % 5 + 2} for i in range(OLD, OLD + NEW)]
    assert sorted(lines, key=lambda v: v["id"]) == expected, "each record once, right values"
    assert len({r.value[1:5] for r in written}) == 1, "one schema id for the sink's records"

    dead = read_topic(settings, f"{name}.dead-letters")
    reasons = sorted((r.headers[CODE_HEADER], r.headers[ERROR_HEADER].decode()) for r in dead)
    assert [code for code, _ in reasons] == [b"refused", b"undecodable", b"undecodable"]
    assert "does not fit the Avro schema" in reasons[0][1] and "field label" in reasons[0][1]
    assert "not the magic byte 0x00" in reasons[1][1]
    assert "schema id 99999999 is not in the schema registry" in reasons[2][1]


def _set_backward(url: str, subject: str) -> None:
    import urllib.request

    request = urllib.request.Request(
        f"{url}/config/{subject}",
        data=b'{"compatibility": "BACKWARD"}',
        headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


@pytest.mark.long
@pytest.mark.crash
@pytest.mark.parametrize("point", ["after_sink_write", "after_sink_commit"])
def test_avro_lines_are_written_once_across_a_kill_9(
    point, broker, redis_server, schema_registry, tmp_path
):
    """kill -9 of the whole run in the middle of a batch's sink write, then a rerun: each
    order's line is in the output once (read_committed, Confluent's deserializer)."""
    name = f"avro-{uuid.uuid4().hex[:8]}"
    src, out = f"{name}-orders", f"{name}-lines"
    _set_backward(schema_registry, f"{src}-value")
    old, new = 300, 500
    _produce(broker.bootstrap, schema_registry, src, old, new)
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
        "AVRO_REGISTRY": schema_registry,
        "AVRO_PIPELINE": name,
        "AVRO_IN": src,
        "AVRO_OUT": out,
    }
    args = [
        "--available-now",
        "--max-records-per-batch",
        "200",
        "--redis-url",
        redis_server.url,
        "--checkpoint",
        os.path.join(tmp_path, "checkpoint"),
        "--output-dir",
        os.path.join(tmp_path, "out"),
        "--master",
        "local[2,4]",
        "--no-progress",
    ]
    pipeline = os.path.join(os.path.dirname(__file__), "..", "e2e_pipelines", "avro_lines.py")
    crash_and_resume(pipeline, Crash(point, stage="orders", batch=2), args, env=env)

    reader = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}))
    context = SerializationContext(out, MessageField.VALUE)
    written = read_topic(KafkaSettings(broker.bootstrap), out, committed=True)
    lines = [reader(r.value, context) for r in written]
    counts = Counter(line["id"] for line in lines)
    assert sorted(counts) == list(range(old + new)), "an order's line is missing"
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert not twice, f"{len(twice)} orders' lines are in the output more than once: {twice[:10]}"
    by_id = {line["id"]: line for line in lines}
    assert by_id[0] == {"id": 0, "label": "OLD-0", "qty": 1}
    assert by_id[old] == {"id": old, "label": f"NEW-{old}", "qty": old % 5 + 2}
    dead = read_topic(KafkaSettings(broker.bootstrap), f"{name}.dead-letters")
    assert len(dead) == 2, "the two bad values, each once"
