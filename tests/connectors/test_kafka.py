"""The Kafka source and sink in streaming runs against the real broker, Redis and Spark.

Caps per micro-batch, availableNow, where a new query starts (earliest/latest/committed),
keys/values/headers exposed through the envelope, undecodable records to the dead-letter
topic with their reason and origin, and IDs carried in headers from one Onceflow pipeline to
the next (a downstream pipeline drops upstream re-sends of the same ID). Each runs with both
clients the workers can read and write with (kafka-python, confluent-kafka).
"""

from __future__ import annotations

import json
import os

import pytest

from onceflow.connectors.kafka import KafkaSink, KafkaSource
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.sink import ERROR_HEADER, ORIGIN_HEADER, STAGE_HEADER
from onceflow.connectors.kafka.topics import produce, read_topic
from onceflow.kernel.keyspace import Keyspace
from onceflow.pipeline import Pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.spark]
CLIENTS = pytest.mark.parametrize("client", ["python", "confluent"])


def _run(p, spark, redis_server, tmp_path, **kw):
    return p.run(
        session=spark,
        redis_url=redis_server.url,
        available_now=True,
        checkpoint=os.path.join(tmp_path, p.name, "ckpt"),
        output_dir=os.path.join(tmp_path, p.name),
        progress=False,
        **kw,
    )


@CLIENTS
def test_capped_batches_dead_letters_and_ids_across_pipelines(
    client, spark, broker, redis_server, tmp_path, topic_name
):
    settings = KafkaSettings(broker.bootstrap)
    src, mid, out = topic_name("src"), topic_name("mid"), topic_name("out")
    good = [json.dumps({"n": i}).encode() for i in range(500)]
    bad = [b"\xff\xfe not json", b"{broken", b""]
    produce(settings, src, [(None, v, None) for v in good[:250] + bad + good[250:]], partitions=2)

    up = Pipeline(topic_name("up"))
    up.read("numbers", KafkaSource(src, bootstrap_servers=broker.bootstrap, client=client)).map(
        "double", lambda e: {"n": e["n"], "twice": 2 * e["n"]}
    ).write("mid", KafkaSink(mid, bootstrap_servers=broker.bootstrap, client=client))
    result = _run(up, spark, redis_server, tmp_path, max_records_per_batch=100)
    assert result.records_in == 500 and result.counters["numbers/undecodable"] == 3
    assert result.batches >= 5, "the cap of 100 records per micro-batch was not applied"

    written = read_topic(settings, mid)
    assert sorted(json.loads(r.value)["n"] for r in written) == list(range(500))
    assert all(len(r.headers["onceflow-id"]) == 16 for r in written)
    assert len({r.headers["onceflow-id"] for r in written}) == 500

    dead = read_topic(settings, f"{up.name}.dead-letters")
    assert sorted(r.value for r in dead) == sorted(bad), "dead letters keep the raw payload"
    for r in dead:
        assert r.headers[ERROR_HEADER].startswith(b"cannot decode as json")
        assert r.headers[ORIGIN_HEADER].startswith(src.encode() + b":")
        assert r.headers[STAGE_HEADER] == b"numbers"

    # An at-least-once producer re-sends 40 of the upstream pipeline's records, headers and all.
    produce(settings, mid, [(r.key, r.value, list(r.headers.items())) for r in written[:40]])

    down = Pipeline(topic_name("down"))
    down.read(
        "twice", KafkaSource(mid, envelope=True, bootstrap_servers=broker.bootstrap, client=client)
    ).map(
        "unwrap",
        lambda e: {**e["value"], "from": e["topic"], "had_id": "onceflow-id" in e["headers"]},
    ).write("out", KafkaSink(out, bootstrap_servers=broker.bootstrap, client=client))
    result = _run(down, spark, redis_server, tmp_path)
    assert result.records_in == 540
    final = read_topic(settings, out)
    values = [json.loads(r.value) for r in final]
    assert sorted(v["n"] for v in values) == list(range(500)), "re-sent records were not dropped"
    assert all(v["had_id"] and v["from"] == mid for v in values)
    stats = redis_server.client().hgetall(Keyspace(down.name).stats("twice"))
    assert int(stats[b"duplicates"]) == 40


@CLIENTS
def test_where_a_new_query_starts(client, spark, broker, redis_server, tmp_path, topic_name):
    settings = KafkaSettings(broker.bootstrap)
    src = topic_name("start")
    produce(settings, src, [(None, json.dumps({"n": i}).encode(), None) for i in range(50)])

    def pipeline(name, **source):
        p = Pipeline(name)
        p.read(
            "in", KafkaSource(src, bootstrap_servers=broker.bootstrap, client=client, **source)
        ).write("out", KafkaSink(f"{name}-out", bootstrap_servers=broker.bootstrap, client=client))
        return p

    latest = pipeline(topic_name("latest"), starting_offsets="latest")
    assert _run(latest, spark, redis_server, tmp_path).records_in == 0
    group = topic_name("group")
    first = pipeline(topic_name("grouped"), group_id=group)
    assert _run(first, spark, redis_server, tmp_path).records_in == 50

    produce(settings, src, [(None, json.dumps({"n": i}).encode(), None) for i in range(50, 70)])
    # the same checkpoint resumes where it stopped; "latest" only saw what came after its start
    assert _run(latest, spark, redis_server, tmp_path).records_in == 20
    # a new query (new checkpoint) of the same consumer group starts at the group's offsets
    committed = pipeline(topic_name("committed"), starting_offsets="committed", group_id=group)
    assert _run(committed, spark, redis_server, tmp_path).records_in == 20
    earliest = pipeline(topic_name("earliest"))
    assert _run(earliest, spark, redis_server, tmp_path).records_in == 70


def test_only_a_keyed_streams_pairs_become_record_keys(
    spark, broker, redis_server, tmp_path, topic_name
):
    """An unkeyed stream of tuples writes each tuple whole as the value; a keyed one splits."""
    settings = KafkaSettings(broker.bootstrap)
    src, pairs, totals = topic_name("src"), topic_name("pairs"), topic_name("totals")
    events = [{"user": f"u{i % 3}", "a": f"a{i}", "b": i} for i in range(30)]
    produce(settings, src, [(None, json.dumps(e).encode(), None) for e in events])

    p = Pipeline(topic_name("pairs"))
    read = p.read("events", KafkaSource(src, bootstrap_servers=broker.bootstrap))
    read.map("pair", lambda e: (e["a"], e["b"])).write(
        "pairs", KafkaSink(pairs, bootstrap_servers=broker.bootstrap)
    )
    read.key_by("by-user", lambda e: e["user"]).map_values("b", lambda e: e["b"]).combine_per_key(
        "total", "sum"
    ).write("totals", KafkaSink(totals, bootstrap_servers=broker.bootstrap))
    _run(p, spark, redis_server, tmp_path)

    written = read_topic(settings, pairs)
    assert {r.key for r in written} == {None}, "an unkeyed tuple was split into a key"
    values = sorted((json.loads(r.value) for r in written), key=lambda v: v[1])
    assert values == [[f"a{i}", i] for i in range(30)], "the tuple is the value, whole"
    summed = {r.key: json.loads(r.value) for r in read_topic(settings, totals)}
    assert summed == {f"u{u}".encode(): sum(range(u, 30, 3)) for u in range(3)}


def test_an_at_least_once_streaming_run_writes_every_record(
    spark, broker, redis_server, tmp_path, topic_name
):
    """The baseline guarantee streams too (its guards take a batch's parameters alike)."""
    settings = KafkaSettings(broker.bootstrap)
    src, copy, totals = topic_name("src"), topic_name("copy"), topic_name("totals")
    events = [{"user": f"u{i % 3}", "n": i} for i in range(40)]
    produce(settings, src, [(None, json.dumps(e).encode(), None) for e in events])
    p = Pipeline(topic_name("alo"))
    read = p.read("events", KafkaSource(src, bootstrap_servers=broker.bootstrap))
    read.write("copy", KafkaSink(copy, bootstrap_servers=broker.bootstrap))
    read.key_by("by-user", lambda e: e["user"]).map_values("n", lambda e: e["n"]).combine_per_key(
        "total", "sum"
    ).write("totals", KafkaSink(totals, bootstrap_servers=broker.bootstrap))
    result = _run(p, spark, redis_server, tmp_path, guarantee="at-least-once")
    assert result.records_in == 40
    copied = sorted(json.loads(r.value)["n"] for r in read_topic(settings, copy))
    assert copied == list(range(40))  # a clean run: once each
    summed = {r.key: json.loads(r.value) for r in read_topic(settings, totals)}
    assert summed == {f"u{u}".encode(): sum(range(u, 40, 3)) for u in range(3)}


def test_bad_source_settings_are_clear_errors():
    from onceflow.connectors.errors import ConnectorError

    with pytest.raises(ConnectorError, match="earliest, latest or committed"):
        KafkaSource("t", starting_offsets="newest")
    with pytest.raises(ConnectorError, match="needs a group_id"):
        KafkaSource("t", starting_offsets="committed")
