"""Both Kafka clients behind one interface: kafka-python and confluent-kafka (``client=``).

Settings map to librdkafka's names without ever showing a secret; a missing confluent-kafka
is one clear line. Against a real broker, with each client: records round-trip with keys,
headers and timestamps, read ``read_committed`` from any offset; the transactional sink
writer keeps aborted transactions invisible, answers whether a delivery marker committed,
is fenced by a newer writer of the same partition, and sends records the broker refuses to
the dead letters (only those: the rest of their record batch is written).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from onceflow.connectors.base import PoisonInTransaction, TaskInfo, TransactionBroken
from onceflow.connectors.errors import ConnectorError
from onceflow.connectors.kafka import KafkaSink, KafkaSource, leases, transactional_producers
from onceflow.connectors.kafka.clients import (
    CONFLUENT_CLIENT,
    WORKER_CLIENTS,
    ensure_topics,
    new_producer,
    new_reader,
)
from onceflow.connectors.kafka.confluent_config import (
    CONSUMER_NAMES,
    PRODUCER_NAMES,
    librdkafka_config,
)
from onceflow.connectors.kafka.connection import KafkaSettings
from onceflow.connectors.kafka.topics import read_topic
from onceflow.connectors.kafka.transactional_producers import _TXN_PRODUCERS
from onceflow.kernel.errors import ConfigError
from onceflow.kernel.records import Record

SECRET = "s3cr3t-pa55"
HOUR_MS = 3_600_000
# a topic refusing records stamped more than an hour ago: the broker's own poison
OLD_REFUSED = {"message.timestamp.before.max.ms": str(HOUR_MS)}


def test_settings_map_to_librdkafka_names():
    settings = KafkaSettings(
        "k1:9093,k2:9093",
        {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "onceflow",
            "sasl_plain_password": SECRET,
            "ssl_cafile": "/etc/ca.pem",
            "ssl_check_hostname": False,
            "api_version": (3, 0, 0),  # kafka-python's own: librdkafka negotiates
        },
    )
    consumer = librdkafka_config(settings, {}, CONSUMER_NAMES, "KafkaSource")
    assert consumer == {
        "bootstrap.servers": "k1:9093,k2:9093",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "onceflow",
        "sasl.password": SECRET,
        "ssl.ca.location": "/etc/ca.pem",
        "ssl.endpoint.identification.algorithm": "none",
    }
    options = {"max_request_size": 20_000, "linger_ms": 5, "compression.codec": "lz4"}
    producer = librdkafka_config(settings, options, PRODUCER_NAMES, "KafkaSink")
    assert producer["message.max.bytes"] == 20_000 and producer["linger.ms"] == 5
    assert producer["compression.codec"] == "lz4", "librdkafka's own names pass as they are"


def test_an_option_without_a_librdkafka_name_is_refused_without_its_value():
    settings = KafkaSettings("k:9092", {"sasl_oauth_token_provider": SECRET})
    with pytest.raises(ConfigError, match="'sasl_oauth_token_provider'") as refused:
        librdkafka_config(settings, {}, CONSUMER_NAMES, "KafkaSource")
    assert SECRET not in str(refused.value)
    dotted = KafkaSettings("k:9092", {"sasl.password": SECRET})  # the driver uses kafka-python
    with pytest.raises(ConfigError, match="'sasl.password'") as refused:
        librdkafka_config(dotted, {}, CONSUMER_NAMES, "KafkaSource")
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: KafkaSource("t", client="confluent"),
        lambda: KafkaSink("t", client="confluent", create_topic=False),
    ],
    ids=["source", "sink"],
)
def test_a_missing_confluent_kafka_is_one_line_saying_what_to_install(make, monkeypatch):
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # as if not installed
    with pytest.raises(ConfigError) as missing:
        make()
    message = str(missing.value)
    assert "pip install confluent-kafka" in message and "\n" not in message


@pytest.mark.parametrize("make", [lambda: KafkaSource("t"), lambda: KafkaSink("t")])
def test_the_default_client_is_confluent_kafka_and_kafka_python_without_it(make, monkeypatch):
    assert make().client == "confluent"
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # as if not installed
    assert make().client == "python"


def test_an_unknown_client_is_refused_naming_the_choices():
    with pytest.raises(ConnectorError, match="'python', 'confluent', 'spark'"):
        KafkaSource("t", client="rust")
    with pytest.raises(ConnectorError, match="'python', 'confluent', got 'spark'"):
        KafkaSink("t", client="spark")


# -- against a broker, with each client ---------------------------------------------------------

CLIENTS = pytest.mark.parametrize("client", WORKER_CLIENTS)


def _now() -> int:
    return int(time.time() * 1000)


@pytest.mark.kafka
@CLIENTS
def test_records_round_trip_with_keys_headers_and_timestamps(client, broker, topic_name):
    settings = KafkaSettings(broker.bootstrap)
    topic = topic_name("rt")
    ensure_topics(settings, [topic], 1)
    producer = new_producer(client, settings, {"acks": "all", "linger_ms": 5})
    stamp = _now() - 60_000
    sent = [
        producer.send(
            topic, f"k{i}".encode(), f"v{i}".encode(), [("id", str(i).encode())], stamp + i
        )
        for i in range(300)
    ]
    producer.send(topic, b"k300", None, None, None)  # a tombstone without headers
    producer.flush(60)
    assert all(d.done and d.failure is None for d in sent)
    assert [d.where() for d in sent[:2]] == [(topic, 0, 0), (topic, 0, 1)]

    reader = new_reader(client, settings)
    try:
        assert reader.log_start(topic, 0) == 0
        reader.seek(topic, 0, 100)
        got = {}
        deadline = time.monotonic() + 30
        while len(got) < 201 and time.monotonic() < deadline:
            f = reader.poll(0.5)
            rows = zip(f.keys, f.values, f.headers, f.timestamps, strict=True)
            got.update(zip(f.offsets, rows, strict=True))
        assert sorted(got) == list(range(100, 301)), "read from offset 100 to the end, once"
        assert got[150] == (b"k150", b"v150", [("id", b"150")], stamp + 150)
        assert got[300][:2] == (b"k300", None) and not got[300][2]
        assert reader.position() == 301
    finally:
        reader.close()


def _sink(client: str, bootstrap: str, topic: str, pipeline: str, **kw) -> KafkaSink:
    sink = KafkaSink(topic, bootstrap_servers=bootstrap, client=client, **kw)
    sink.prepare(pipeline, streaming=True)
    return sink


def _task(pipeline: str, batch: int, attempt_id: int) -> TaskInfo:
    return TaskInfo(pipeline, "out", batch, 0, 0, exactly_once=True, attempt_id=attempt_id)


def _records(n: int, ts: int, old: frozenset[int] = frozenset()) -> list[Record]:
    return [
        Record(uuid.uuid4().bytes, ts - 2 * HOUR_MS if i in old else ts, {"i": i}) for i in range(n)
    ]


@pytest.mark.kafka
@CLIENTS
def test_a_transaction_is_invisible_until_committed_and_its_marker_says_which(
    client, kafka_broker, topic_name
):
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("txn"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)

    aborted = sink.open(_task(pipeline, 1, 1))
    assert aborted.write(_records(40, _now())) == []
    gone = aborted.prepare()
    aborted.abort()
    assert not aborted.aborted_cleanly(), "its marker was sent: the next attempt settles it"
    done = sink.open(_task(pipeline, 1, 2))  # a new attempt, in the same worker process
    done.settle([aborted.identity])
    assert done.committed(gone) is False
    assert done.write(_records(25, _now())) == []
    kept = done.prepare()
    assert read_topic(settings, topic) == [], "nothing is visible before the commit"
    done.commit()
    done.close()

    committed = read_topic(settings, topic)
    assert len(committed) == 25, "read_committed sees the committed transaction only"
    assert all(len(r.headers["onceflow-id"]) == 16 for r in committed)
    assert len(read_topic(settings, topic, committed=False)) == 40 + 25, "aborted, not absent"
    assert sink.open(_task(pipeline, 2, 3)).committed(kept) is True


@pytest.mark.kafka
@CLIENTS
def test_a_newer_writer_of_the_same_partition_fences_the_older(client, kafka_broker, topic_name):
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("fence"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    zombie = sink.open(_task(pipeline, 1, 1))
    zombie.write(_records(10, _now()))
    marker = zombie.prepare()
    _TXN_PRODUCERS.clear()  # the owner runs in another process: the zombie's producer lives on
    owner = sink.open(_task(pipeline, 1, 2))  # e.g. Spark re-ran the task elsewhere
    owner.settle([zombie.identity])  # the runtime found the zombie's id recorded in Redis
    with pytest.raises(Exception):  # noqa: B017 - each client names fencing its own way
        zombie.commit()
    assert owner.committed(marker) is False
    owner.write(_records(10, _now()))
    owner.prepare()
    owner.commit()
    assert len(read_topic(settings, topic)) == 10


@pytest.mark.kafka
@CLIENTS
def test_a_worker_process_registers_each_partitions_transactional_id_once(
    client, kafka_broker, topic_name
):
    """Tasks of one process reuse the producer of the sink partition they write."""
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("reuse"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    producers = {}
    for batch, partition in [(1, 0), (1, 1), (2, 0), (2, 1)]:
        writer = sink.open(TaskInfo(pipeline, "out", batch, partition, 0, True, 10 * batch))
        writer.write(_records(5, _now()))
        writer.prepare()
        writer.commit()
        writer.close()
        producers.setdefault(writer.identity, []).append(writer.producer)
    lease = leases.worker_lease(f"onceflow.{pipeline}")  # this process's (see .leases)
    assert sorted(producers) == [f"onceflow.{pipeline}.out.{p}.{lease}" for p in (0, 1)]
    assert all(a is b for a, b in producers.values()), "one registered producer per partition"
    assert len(read_topic(settings, topic)) == 20


@pytest.mark.kafka
@CLIENTS
def test_settling_one_partition_leaves_another_partitions_writer_able_to_commit(
    client, kafka_broker, topic_name
):
    """A retried task settles its partition's writers: never a healthy one of another.

    Two partitions' writers in one process, each with a transaction open; a retry of
    partition 0 (a task of another process, after a failure) settles what partition 0's
    attempt recorded. Partition 1's transaction still commits, at the first try.
    """
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("settle"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    failed = sink.open(TaskInfo(pipeline, "out", 1, 0, 0, True, 1))
    healthy = sink.open(TaskInfo(pipeline, "out", 1, 1, 0, True, 2))
    failed.write(_records(7, _now()))
    healthy.write(_records(9, _now()))
    healthy.prepare()
    _TXN_PRODUCERS.clear()  # the retry runs in another process
    retry = sink.open(TaskInfo(pipeline, "out", 1, 0, 1, True, 3))
    retry.settle([failed.identity])  # what the runtime found recorded for partition 0
    healthy.commit()  # raises if the settle fenced its producer
    retry.write(_records(4, _now()))
    retry.prepare()
    retry.commit()
    assert len(read_topic(settings, topic)) == 9 + 4


@pytest.mark.kafka
@CLIENTS
def test_a_cached_producer_another_process_fenced_is_replaced_without_a_word(
    client, kafka_broker, topic_name, monkeypatch
):
    """The partition's task ran in another process since: its registration fenced ours.

    That process ran on another machine: it left no note here (see ``.registrations``), so
    the fenced producer only learns so from Kafka, and the transaction is redone.
    """
    monkeypatch.setattr(transactional_producers, "registered_elsewhere", lambda *_: False)
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("hop"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    here = sink.open(_task(pipeline, 1, 1))
    here.write(_records(3, _now()))
    here.prepare()
    here.commit()
    _registered_elsewhere(sink, pipeline)
    again = sink.open(_task(pipeline, 3, 3))
    _deliver(again, _records(6, _now()))
    assert len(read_topic(settings, topic)) == 3 + 5 + 6


def _registered_elsewhere(sink, pipeline) -> dict:
    """Another process registers the sink partition's id and delivers 5 records; this process
    then gets back its own producers (one of them fenced by that registration)."""
    ours = dict(_TXN_PRODUCERS)
    _TXN_PRODUCERS.clear()
    elsewhere = sink.open(_task(pipeline, 2, 2))
    _deliver(elsewhere, _records(5, _now()))
    _TXN_PRODUCERS.clear()
    _TXN_PRODUCERS.update(ours)
    return ours


@pytest.mark.kafka
@CLIENTS
def test_a_producer_another_process_here_registered_since_is_replaced_before_sending(
    client, kafka_broker, topic_name
):
    """The note that process left makes this one register anew first: no transaction fails.

    Without the note, ``prepare`` finds the cached producer fenced (TransactionBroken) and
    the runtime has to recover and redo the transaction (the test above).
    """
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("moved"), topic_name("p")
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    here = sink.open(_task(pipeline, 1, 1))
    _deliver(here, _records(3, _now()))
    ours = _registered_elsewhere(sink, pipeline)
    again = sink.open(_task(pipeline, 3, 3))
    assert again.write(_records(6, _now())) == []
    again.prepare()  # TransactionBroken if the fenced producer had been used
    again.commit()
    assert again.producer is not ours[again.identity].producer
    assert again.counts().get("registrations") == 1, "what bench/latency.py counts as a move"
    assert len(read_topic(settings, topic)) == 3 + 5 + 6


@pytest.mark.kafka
@CLIENTS
def test_settling_ends_a_transaction_a_killed_process_left_open(client, kafka_broker, topic_name):
    """Readers are not held up until the transaction times out (here: ten minutes)."""
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("orphan"), topic_name("p")
    slow = {"transaction_timeout_ms": 600_000}
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline, producer_options=slow)
    killed = sink.open(_task(pipeline, 1, 1))
    killed.write(_records(30, _now()))
    killed.producer.flush(30)  # its records are in the log, in a transaction left open
    _TXN_PRODUCERS.clear()  # the process is gone (its producer is never used again)
    retry = sink.open(_task(pipeline, 1, 2))
    assert retry.identity == killed.identity, "the sink partition's id, whichever process"
    retry.settle([killed.identity])
    retry.write(_records(12, _now()))
    retry.prepare()
    retry.commit()
    assert len(read_topic(settings, topic)) == 12, "the open transaction still blocks readers"


def _deliver(writer, records: list[Record]) -> list[tuple[Record, str]]:
    """What the runtime does with a transactional writer (runtime/task/loop.py), Redis aside."""
    rejected: list[tuple[Record, str]] = []
    while True:
        try:
            rejected += _prepare(writer, records, rejected)
            writer.commit()
            return rejected
        except TransactionBroken:
            if writer.recover():
                return rejected


def _prepare(writer, records: list[Record], rejected) -> list[tuple[Record, str]]:
    refused: list[tuple[Record, str]] = []
    while True:
        bad = {id(rec) for rec, _ in [*rejected, *refused]}
        refused += writer.write([r for r in records if id(r) not in bad])
        try:
            writer.prepare()
            return refused
        except PoisonInTransaction as poison:
            refused += poison.rejected


def _alter(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    """Set topic settings, and wait until the broker reports them (then it applies them)."""
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=config)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            asked = ConfigResource(ConfigResourceType.TOPIC, topic, configs=dict.fromkeys(config))
            found = admin.describe_configs([asked])["topic"][topic]
            if all(found.get(k, {}).get("value") == v for k, v in config.items()):
                return
            time.sleep(0.1)
        raise AssertionError(f"the broker did not apply {config} to {topic}")
    finally:
        admin.close()


@pytest.mark.kafka
@pytest.mark.parametrize("transactional", [True, False], ids=["transactional", "plain"])
@CLIENTS
def test_only_the_records_the_broker_refuses_are_rejected(
    client, transactional, kafka_broker, topic_name
):
    """Two records stamped too long ago sit in one record batch with 148 good ones.

    The topic's limit is set after the sink prepared (while a run goes): the sink stamps what
    it knows the topic refuses with the time of writing (tests/connectors/test_kafka_topics.py),
    so only a limit it did not know of reaches the broker.
    """
    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("refuse"), topic_name("p")
    ensure_topics(settings, [topic], 1)
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline, transactional=transactional)
    _alter(kafka_broker.bootstrap, topic, OLD_REFUSED)
    writer = sink.open(_task(pipeline, 1, 1))
    records = _records(150, _now(), old=frozenset({40, 111}))
    if transactional:
        rejected = _deliver(writer, records)
    else:
        rejected = writer.write(records) + writer.flush()
    writer.close()

    assert sorted(rec.elem["i"] for rec, _ in rejected) == [40, 111]
    assert all("refused the record" in why for _, why in rejected)
    written = [r.headers["onceflow-id"] for r in read_topic(settings, topic)]
    assert sorted(written) == sorted(r.id for r in records if r.elem["i"] not in (40, 111))


@pytest.mark.kafka
def test_the_confluent_reader_raises_out_of_range_instead_of_jumping(broker, topic_name):
    from onceflow.connectors.kafka.clients import OffsetOutOfRange

    settings = KafkaSettings(broker.bootstrap)
    topic = topic_name("oor")
    ensure_topics(settings, [topic], 1)
    producer = new_producer(CONFLUENT_CLIENT, settings, {})
    for i in range(5):
        producer.send(topic, None, b"%d" % i, None, None)
    producer.flush(30)
    reader = new_reader(CONFLUENT_CLIENT, settings)
    try:
        reader.seek(topic, 0, 1000)
        with pytest.raises(OffsetOutOfRange):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                assert len(reader.poll(0.5)) == 0
    finally:
        reader.close()


@pytest.mark.kafka
@CLIENTS
def test_a_range_ending_at_a_commit_marker_is_read_however_slow_its_task(
    client, kafka_broker, topic_name, monkeypatch
):
    """The stall clock counts time spent polling, not the task's work on what it yielded.

    A transactional producer's records end with a commit marker, so a range read up to the
    log end finishes with a poll that returns nothing but moves past the marker.
    """
    from onceflow.connectors.kafka import worker

    settings = KafkaSettings(kafka_broker.bootstrap)
    topic, pipeline = topic_name("marker"), topic_name("p")
    ensure_topics(settings, [topic], 1)
    sink = _sink(client, kafka_broker.bootstrap, topic, pipeline)
    writer = sink.open(_task(pipeline, 1, 1))
    assert writer.write(_records(10, _now())) == []
    writer.prepare()
    writer.commit()
    writer.close()
    hi = 11  # 10 records and the commit marker
    monkeypatch.setattr(worker, "STALL_SECONDS", 2.0)
    got = []
    for fetched in worker.fetch_range(settings, topic, 0, 0, hi, client=client):
        got.extend(fetched.offsets)
        if len(got) == 10:  # the task works on them longer than the clock allows for polling
            time.sleep(2.5)
    assert got == list(range(10))
