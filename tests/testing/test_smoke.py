"""Each real service the suite relies on answers and behaves as the runtime assumes."""

from __future__ import annotations

import pytest


@pytest.mark.spark
def test_spark_runs_a_python_arrow_stage(spark):
    import pyarrow as pa

    def double(batches):
        for b in batches:
            yield pa.RecordBatch.from_arrays([pa.compute.multiply(b.column(0), 2)], names=["id"])

    rows = spark.range(10, numPartitions=2).mapInArrow(double, "id long").collect()
    assert sorted(r.id for r in rows) == [2 * i for i in range(10)]


@pytest.mark.redis
def test_redis_answers_with_aof_on(redis_server):
    client = redis_server.client()
    client.set("smoke:key", b"value")
    assert client.get("smoke:key") == b"value"
    if redis_server.local is not None:
        assert client.config_get("appendonly")["appendonly"] == "yes"


@pytest.mark.redis
def test_redis_keeps_acknowledged_writes_across_kill_9(redis_factory):
    server = redis_factory()
    client = server_client(server)
    pipe = client.pipeline(transaction=False)
    for i in range(2000):
        pipe.set(f"k{i}", i)
    pipe.execute()
    server.restart(kill=True)
    client = server_client(server)
    assert client.dbsize() == 2000
    assert int(client.get("k1999")) == 1999


def server_client(server):
    import redis

    return redis.Redis.from_url(server.url)


@pytest.mark.kafka
def test_broker_round_trips_keys_values_and_headers(broker, topic_name):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    topic = topic_name("smoke")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    for i in range(5):
        producer.send(topic, key=b"k%d" % i, value=b"v%d" % i, headers=[("h", b"%d" % i)])
    producer.flush()
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    got = []
    for _ in range(20):
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(records)
        if len(got) >= 5:
            break
    consumer.close()
    assert [(r.key, r.value, r.headers) for r in got] == [
        (b"k%d" % i, b"v%d" % i, [("h", b"%d" % i)]) for i in range(5)
    ]
