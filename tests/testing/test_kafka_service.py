"""``LocalKafka``: a real Apache Kafka, checked on what the tansu broker gets wrong or lacks.

tansu reports wrong end offsets, shows aborted transactions to ``read_committed`` consumers
and refuses ``delete_records`` and ``create_partitions``; each test here asserts the real
behaviour against one module-wide broker (the kill -9 test restarts it in place).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewPartitions, NewTopic

from onceflow.kernel.errors import ServiceError
from onceflow.testing.kafka import LocalKafka
from onceflow.testing.kafka_jars import java_binary, kafka_home

pytestmark = pytest.mark.kafka


def _tools_missing() -> str | None:
    """Why Kafka cannot be had on this machine, or None."""
    try:
        java_binary()
    except ServiceError as exc:
        return str(exc)
    cached = any((kafka_home() / "libs").glob("kafka_*.jar"))
    if not cached and shutil.which("mvn") is None:
        return "Maven is not installed and the Kafka jars are not cached"
    return None


@pytest.fixture(scope="module")
def kafka() -> Iterator[LocalKafka]:
    why = _tools_missing()
    if why:
        pytest.skip(f"no Apache Kafka here: {why}")
    with LocalKafka() as server:
        yield server


def _topic(kafka: LocalKafka, partitions: int = 1) -> str:
    name = f"svc-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)], wait_for_metadata=True)
    finally:
        admin.close()
    return name


def _consumer(kafka: LocalKafka, isolation_level: str = "read_uncommitted") -> KafkaConsumer:
    return KafkaConsumer(
        bootstrap_servers=kafka.bootstrap,
        enable_auto_commit=False,
        isolation_level=isolation_level,
        fetch_max_wait_ms=100,
    )


def _read_all(
    kafka: LocalKafka, topic: str, isolation_level: str = "read_uncommitted", timeout: float = 30
) -> list:
    """Every record of ``topic`` up to the end offsets (the last stable offsets when committed)."""
    consumer = _consumer(kafka, isolation_level)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"read stopped short of {ends}"
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def test_round_trips_keys_values_and_headers(kafka):
    topic = _topic(kafka)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    for i in range(5):
        producer.send(topic, key=b"k%d" % i, value=b"v%d" % i, headers=[("id", b"%d" % i)])
    producer.flush()
    producer.close()
    got = _read_all(kafka, topic)
    assert [(r.key, r.value, r.headers, r.offset) for r in got] == [
        (b"k%d" % i, b"v%d" % i, [("id", b"%d" % i)], i) for i in range(5)
    ]


def test_end_offsets_count_the_records_of_each_partition(kafka):
    topic = _topic(kafka, partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    for i in range(10):
        producer.send(topic, value=b"%d" % i, partition=0 if i < 7 else 1)
    producer.flush()
    producer.close()
    consumer = _consumer(kafka)
    p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    assert consumer.end_offsets([p0, p1]) == {p0: 7, p1: 3}
    assert consumer.beginning_offsets([p0, p1]) == {p0: 0, p1: 0}
    consumer.assign([p0, p1])
    consumer.seek_to_end(p0)
    assert consumer.position(p0) == 7
    consumer.close()


def test_acknowledged_records_survive_kill_9_and_restart(kafka):
    topic = _topic(kafka, partitions=2)
    bootstrap = kafka.bootstrap
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    futures = [producer.send(topic, key=b"%d" % (i % 7), value=b"%d" % i) for i in range(3000)]
    acked = {(m.partition, m.offset) for m in (f.get(timeout=30) for f in futures)}
    producer.close()
    assert len(acked) == 3000

    kafka.restart(kill=True)

    assert kafka.bootstrap == bootstrap
    got = _read_all(kafka, topic)
    assert sorted(int(r.value) for r in got) == list(range(3000))
    assert {(r.partition, r.offset) for r in got} == acked


def _transactional_producer(kafka: LocalKafka) -> KafkaProducer:
    producer = KafkaProducer(
        bootstrap_servers=kafka.bootstrap,
        transactional_id=f"tx-{uuid.uuid4().hex[:8]}",
        acks="all",
    )
    producer.init_transactions()
    return producer


def _wait_for_markers(kafka: LocalKafka, tp: TopicPartition, timeout: float = 10) -> None:
    """Until no transaction is open on ``tp``: the last stable offset meets the high-water mark.

    ``commit_transaction``/``abort_transaction`` return once the coordinator has logged the
    outcome; the markers reach the partitions just after.
    """
    committed, raw = _consumer(kafka, "read_committed"), _consumer(kafka)
    try:
        deadline = time.monotonic() + timeout
        while committed.end_offsets([tp]) != raw.end_offsets([tp]):
            assert time.monotonic() < deadline, "transaction markers not written"
            time.sleep(0.05)
    finally:
        committed.close()
        raw.close()


def test_aborted_transaction_is_invisible_to_read_committed(kafka):
    topic = _topic(kafka)
    producer = _transactional_producer(kafka)
    producer.begin_transaction()
    for i in range(3):
        producer.send(topic, value=b"aborted-%d" % i)
    producer.flush()
    producer.abort_transaction()
    producer.begin_transaction()
    for i in range(2):
        producer.send(topic, value=b"committed-%d" % i)
    producer.commit_transaction()
    producer.close()
    _wait_for_markers(kafka, TopicPartition(topic, 0))

    committed = [r.value for r in _read_all(kafka, topic, "read_committed")]
    everything = [r.value for r in _read_all(kafka, topic, "read_uncommitted")]

    assert committed == [b"committed-0", b"committed-1"]
    # The aborted records are in the log (so the filter above is real), and each transaction
    # ends in a control record that takes an offset: offsets are not contiguous.
    assert everything == [b"aborted-0", b"aborted-1", b"aborted-2", b"committed-0", b"committed-1"]
    tp = TopicPartition(topic, 0)
    consumer = _consumer(kafka)
    assert consumer.end_offsets([tp]) == {tp: 7}
    consumer.close()


def test_open_transaction_holds_back_the_last_stable_offset(kafka):
    topic = _topic(kafka)
    tp = TopicPartition(topic, 0)
    plain = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    plain.send(topic, value=b"before").get(timeout=30)
    producer = _transactional_producer(kafka)
    producer.begin_transaction()
    producer.send(topic, value=b"open")
    producer.flush()
    plain.send(topic, value=b"after").get(timeout=30)

    committed_view, raw_view = _consumer(kafka, "read_committed"), _consumer(kafka)
    assert committed_view.end_offsets([tp]) == {tp: 1}  # the open transaction's first offset
    assert raw_view.end_offsets([tp]) == {tp: 3}

    producer.commit_transaction()
    _wait_for_markers(kafka, tp)
    assert committed_view.end_offsets([tp]) == {tp: 4}  # past the commit marker, offset 3
    for client in (committed_view, raw_view, producer, plain):
        client.close()


def test_delete_records_moves_the_log_start_offset(kafka):
    topic = _topic(kafka)
    tp = TopicPartition(topic, 0)
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    for i in range(10):
        producer.send(topic, value=b"%d" % i)
    producer.flush()
    producer.close()

    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    result = admin.delete_records({tp: 6})
    admin.close()

    assert result[tp]["low_watermark"] == 6
    consumer = _consumer(kafka)
    assert consumer.beginning_offsets([tp]) == {tp: 6}
    consumer.close()
    assert [int(r.value) for r in _read_all(kafka, topic)] == [6, 7, 8, 9]


def test_create_partitions_adds_partitions(kafka):
    topic = _topic(kafka, partitions=2)
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_partitions({topic: NewPartitions(4)})
    described = admin.describe_topics([topic])
    admin.close()
    assert len(described[0]["partitions"]) == 4

    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    meta = producer.send(topic, value=b"new", partition=3).get(timeout=30)
    producer.close()
    assert (meta.partition, meta.offset) == (3, 0)


def test_new_topic_without_counts_takes_the_broker_defaults(kafka):
    name = f"svc-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    admin.create_topics([NewTopic(name)])  # num_partitions=-1, replication_factor=-1
    described = admin.describe_topics([name])
    admin.close()
    partitions = described[0]["partitions"]
    assert len(partitions) == 2  # num.partitions of LocalKafka
    assert [p["replica_nodes"] for p in partitions] == [[1], [1]]


def test_paused_broker_answers_again_after_resume(kafka):
    from kafka.errors import KafkaError

    topic = _topic(kafka)
    producer = KafkaProducer(
        bootstrap_servers=kafka.bootstrap, acks="all", request_timeout_ms=1000, max_block_ms=1500
    )
    producer.send(topic, value=b"before").get(timeout=30)
    kafka.pause()
    try:
        with pytest.raises(KafkaError):
            producer.send(topic, value=b"paused").get(timeout=1.5)
    finally:
        kafka.resume()
    producer.close()
    values = [r.value for r in _read_all(kafka, topic)]
    # The paused send may have reached the broker before the producer gave up on it.
    assert values in ([b"before"], [b"before", b"paused"])
